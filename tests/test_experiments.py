"""The bookkeeping of minimal_asymloop.experiments: the ALRS study's queue and the reuse of committed runs (the runs
themselves are precomputed)."""

import json

import pytest

from minimal_asymloop import experiments as ex
from minimal_asymloop.experiments import alrs_study, chain, common, lm


def test_best_lr_uses_the_mean_over_seeds_and_only_complete_lrs():
    runs = [dict(arm="uniform", lr=1e-3, seed=0, val_loss=4.0), dict(arm="uniform", lr=1e-3, seed=1, val_loss=4.4),
            dict(arm="uniform", lr=2e-3, seed=0, val_loss=4.1), dict(arm="uniform", lr=2e-3, seed=1, val_loss=4.2),
            dict(arm="uniform", lr=4e-3, seed=0, val_loss=3.0),  # best, but seed 1 is missing
            dict(arm="alrs", lr=1e-3, seed=0, val_loss=1.0), dict(arm="alrs", lr=1e-3, seed=1, val_loss=1.0)]
    assert ex.best_lr(runs, "uniform", (0, 1)) == 2e-3  # mean 4.15 < 4.2; seed 0 alone would pick 1e-3
    assert ex.best_lr(runs, "uniform", (0,)) == 4e-3
    assert ex.best_lr(runs, "alrs_hill", (0, 1)) is None
    assert ex.best_lr(runs, "uniform", (0, 1), grid=(2e-3, 4e-3)) == 2e-3 and ex.best_lr(runs, "uniform", (0, 1), grid=(1e-3,)) == 1e-3


def test_alrs_records_reads_logged_allocations():
    rows = [dict(step=1, loss=5.0), dict(step=1, alrs_step=0, alrs_alpha={"a": 2.0}, alrs_multiplier={"a": 1.0}),
            dict(step=11, alrs_step=10, alrs_alpha={"a": 3.0}, alrs_multiplier={"a": 5.0}), dict(step=250, val_loss=4.0)]
    assert ex.alrs_records(rows) == [dict(step=0, alpha={"a": 2.0}, multiplier={"a": 1.0}),
                                     dict(step=10, alpha={"a": 3.0}, multiplier={"a": 5.0})]


def test_alrs_study_setting_fits_two_tokens_per_param_and_tunes_every_matrix():
    from minimal_asymloop import alrs
    from minimal_asymloop.model import LoopedLM, ModelConfig
    from minimal_asymloop.trainer import TrainConfig

    cfg = ModelConfig(arch="asymloop", n_iter=3, **ex.ALRS_LM)
    budget = ex.describe_budget(cfg, TrainConfig(**{**ex.ALRS_TRAIN, "max_steps": 250}))
    assert budget["tokens_per_param"] >= 2
    model = LoopedLM(cfg)
    n_matrices = sum(1 for p in model.parameters() if p.dim() == 2)
    assert len(alrs.tuned_matrices(model)) == n_matrices  # d_model 64: every matrix has >= 50 eigenvalues


def test_alrs_queue_order_edge_extension_and_controls(monkeypatch, tmp_path):
    """With a fake trainer: seed 0 sweeps both grids (one LR beyond a winning edge), the other seeds follow at the
    first seed's best, then the scaled-uniform control at base x mean multiplier, unpinned, the rest of the sweep, hill,
    uniform LR with only embedding/head pinned at the top, the decoder boost at ALRS's mean multiplier, and last the
    paper-literal ALRS (embedding and head at 1x) over its own grid, with one LR beyond a winning edge."""
    order, mults = [], []
    monkeypatch.setattr(common, "RESULTS", tmp_path)  # no committed results to reuse

    def fake_arm(arm, lr, seed, steps, dec_mult=None):
        order.append((arm, lr, seed))
        mults.append(dec_mult)
        loss = 4.0 - lr if arm == "uniform" else 4.0 + lr if arm == "alrs_blocks" else 4.0 + abs(lr - 2.5e-3)  # ALRS: 2.5e-3
        return dict(arm=arm, lr=lr, seed=seed, val_loss=loss + 0.01 * seed, mean_multiplier=3.0)

    writes = []
    monkeypatch.setattr(alrs_study, "alrs_arm", fake_arm)
    monkeypatch.setattr(alrs_study, "alrs_spectra", lambda best, seed: dict(best=best))
    monkeypatch.setattr(alrs_study, "write_json", lambda path, obj: writes.append(obj))
    monkeypatch.setattr(common, "SEEDS", (0, 1, 2))
    res = ex.alrs_experiment()
    first = [(a, lr, 0) for a in ("uniform", "alrs") for lr in ex.ALRS_LRS[a]] + [("uniform", 2e-2, 0)]
    assert order[:7] == first  # uniform's best (1e-2) is its grid's top edge: 2e-2 added
    assert order[7:11] == [("uniform", 2e-2, 1), ("alrs", 2.5e-3, 1), ("uniform", 2e-2, 2), ("alrs", 2.5e-3, 2)]
    assert res["scaled_uniform_lr"] == 7.5e-3 and order[11:14] == [("uniform", 7.5e-3, s) for s in (0, 1, 2)]
    assert order[14:17] == [("alrs_unpinned", 2.5e-3, s) for s in (0, 1, 2)]
    assert order[17:19] == [("uniform", 1e-2, 1), ("uniform", 1e-2, 2)]  # the rest of the sweep, nearest each best first
    pins = [(a, 2e-2, s) for a in ("uniform_top_embed", "uniform_top_head") for s in (0, 1, 2)]  # one pinned matrix each
    assert order[-6:] == pins and set(mults[-6:]) == {None}
    order, mults = order[:-6], mults[:-6]
    blocks = [("alrs_blocks", lr, s) for lr in (*ex.ALRS_LRS["alrs_blocks"], 6.25e-4) for s in (0, 1, 2)]
    assert order[-12:] == blocks  # its own sweep; its best, 1.25e-3, is the grid's low edge: 6.25e-4 added
    assert list(res["setting"]["lr_grids"]["alrs_blocks"]) == [6.25e-4, *ex.ALRS_LRS["alrs_blocks"]]
    order, mults = order[:-12], mults[:-12]
    assert order[-9:-6] == [("alrs_hill", 2.5e-3, s) for s in (0, 1, 2)]
    assert order[-6:-3] == [("uniform_top", 2e-2, s) for s in (0, 1, 2)]  # at uniform's best LR
    assert order[-3:] == [("decoder_boost", 2e-2, s) for s in (0, 1, 2)] and mults[-3:] == [3.0] * 3  # x ALRS's mean
    assert res["decoder_boost_mult"] == 3.0 and set(mults[:-3]) == {None}
    assert len(order) == len(set(order)) == 3 * (4 + 3) + 5 * 3  # every (arm, lr, seed) once
    assert res["best_lr"] == {"uniform": 2e-2, "alrs": 2.5e-3} and res["partial"] is False
    # the scaled-uniform control (7.5e-3) is not a sweep LR, so it never becomes uniform's best
    assert ex.best_lr([*res["runs"], *[dict(arm="uniform", lr=7.5e-3, seed=s, val_loss=0.0) for s in (0, 1, 2)]], "uniform", (0, 1, 2),
                      res["setting"]["lr_grids"]["uniform"]) == 2e-2
    assert len(writes) == len(order) + 18 and writes[-1]["partial"] is True


def test_alrs_study_reuses_the_committed_runs_of_its_setting(monkeypatch, tmp_path):
    """A fresh clone (no out/experiments/) trains only the arms missing from the committed JSON; another setting
    or --fresh trains everything."""
    calls = []

    def fake_arm(arm, lr, seed, steps, dec_mult=None):
        calls.append((arm, lr, seed))
        return dict(arm=arm, lr=lr, seed=seed, val_loss=4.0 + abs(lr - 2.5e-3), mean_multiplier=3.0)

    monkeypatch.setattr(alrs_study, "alrs_arm", fake_arm)
    monkeypatch.setattr(alrs_study, "alrs_spectra", lambda best, seed: calls.append("spectra") or dict(best=best))
    monkeypatch.setattr(alrs_study, "write_json", lambda path, obj: None)
    monkeypatch.setattr(common, "SEEDS", (0, 1, 2))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    full = ex.alrs_experiment()
    everything = list(calls)
    assert "spectra" in everything and ("uniform_top", 2.5e-3, 2) in everything
    kept = [r for r in full["runs"] if r["arm"] != "uniform_top"]  # the file as committed before the new control
    (tmp_path / "alrs.json").write_text(json.dumps(dict(full, runs=kept)))
    calls.clear()
    again = ex.alrs_experiment()
    assert calls == [("uniform_top", 2.5e-3, s) for s in (0, 1, 2)]  # the spectra and every other run reused
    assert len(again["runs"]) == len(full["runs"])
    calls.clear()
    monkeypatch.setattr(common, "FRESH", True)
    ex.alrs_experiment()
    assert calls == everything
    monkeypatch.setattr(common, "FRESH", False)
    calls.clear()
    monkeypatch.setattr(common, "SEEDS", (0, 1, 2, 3))  # one more seed: the committed seeds are reused, the spectra too
    ex.alrs_experiment()
    assert calls and all(c[2] == 3 or c[0] in ("uniform_top", "decoder_boost") for c in calls)
    monkeypatch.setattr(common, "SEEDS", (0, 1, 2))
    calls.clear()
    monkeypatch.setattr(alrs_study, "ALRS_STEPS", 100)  # another setting (fewer steps) reuses nothing
    ex.alrs_experiment()
    assert len(calls) == len(everything)


def test_lm_runs_reuse_committed_rows_of_the_same_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    setting = ex.lm_setting(200, (0, 1, 2))
    row = dict(name="asymloop_k5_no_local", seed=1, arch="asymloop", n_iter=5, context="global_kv", local_kv=False, val_loss=3.9)
    (tmp_path / "global_kv.json").write_text(json.dumps(dict(setting=setting, runs=[row])))
    done = ex.committed_rows(setting, "matched_depth", "global_kv")
    assert done == {("asymloop_k5_no_local", 1): row}
    monkeypatch.setattr(lm, "train_lm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    cfg = ex.lm_config("asymloop", n_iter=5, **ex.CONTEXTS["no_local"])
    assert ex.run_lm("asymloop_k5_no_local", cfg, 1, 200, batch=None, done=done) == row
    with pytest.raises(AssertionError, match="trained"):  # same name, other architecture fields: not reused
        ex.run_lm("asymloop_k5_no_local", ex.lm_config("asymloop", n_iter=5), 1, 200, batch=None, done=done)
    assert ex.committed_rows(ex.lm_setting(100, (0, 1, 2)), "global_kv") == {}
    assert ex.committed_rows(ex.lm_setting(200, (0, 1, 2, 3)), "global_kv") == done  # more seeds: the committed ones reused


def test_chain_task_reuses_committed_runs_and_trains_the_missing_seeds(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    trained = []

    def fake_run(name, cfg, task, setting, seed, cache=True):
        trained.append((name, seed))
        return dict(name=name, seed=seed, steps=100, params=1000)

    monkeypatch.setattr(chain, "chain_run", fake_run)
    monkeypatch.setattr(common, "SEEDS_SET", True)  # as with --seeds 0
    monkeypatch.setattr(common, "SEEDS", (0,))
    first = ex.chain_task()
    assert trained == [(n, 0) for n in ex.chain_models(ex.ChainTask(**ex.CHAIN_TASK))]
    (tmp_path / "chain_task.json").write_text(json.dumps(first))
    trained.clear()
    monkeypatch.setattr(common, "SEEDS", (0, 1))
    both = ex.chain_task()
    assert trained and all(seed == 1 for _, seed in trained) and len(both["runs"]) == 2 * len(trained)
    first = both["runs"][0]
    assert first["tokens"] == 100 * ex.CHAIN_BATCH * 32 and first["tokens_per_param"] == first["tokens"] / 1000  # the budget


def test_chain_task_runs_its_own_five_seeds_unless_told(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(chain, "chain_run",
                        lambda name, cfg, task, setting, seed, cache=True: dict(name=name, seed=seed, steps=1, params=1))
    assert ex.chain_task()["setting"]["seeds"] == list(ex.CHAIN_SEEDS) == [0, 1, 2, 3, 4]  # plain `chain_task` or `all`
    for name in ("SEEDS", "SEEDS_SET", "STEPS", "STEPS_SET", "CACHED_ONLY", "FRESH"):  # main() sets them: restore after
        monkeypatch.setattr(common, name, getattr(common, name))
    ex.main(["chain_task", "--seeds", "7", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "chain_task.json").read_text())["setting"]["seeds"] == [7]
    assert ex.SEEDS == common.SEEDS == (7,) and ex.SEEDS_SET is True  # the package reads the settings main() set


def test_chain_context_trains_its_own_arms_beside_each_other(monkeypatch, tmp_path):
    """The context block never borrows the depth grid's committed rows of the same names (trained earlier): it reuses
    only its own committed file, and its six arms are at matched effective depth 4."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    trained = []
    monkeypatch.setattr(chain, "chain_run", lambda name, cfg, task, setting, seed, cache=True:
                        trained.append((name, seed)) or dict(name=name, seed=seed, steps=10, params=1))
    monkeypatch.setattr(common, "SEEDS_SET", True)
    monkeypatch.setattr(common, "SEEDS", (0,))
    grid = ex.chain_task()
    (tmp_path / "chain_task.json").write_text(json.dumps(grid))
    trained.clear()
    ctx = ex.chain_context()
    assert trained == [(n, 0) for n in ex.CONTEXT_ARMS] and ("asymloop_k3", 0) in {(r["name"], r["seed"]) for r in grid["runs"]}
    models = ex.chain_models(ex.ChainTask(**ex.CHAIN_TASK))
    assert {models[n].effective_depth for n in ex.CONTEXT_ARMS} == {4}
    (tmp_path / "chain_context.json").write_text(json.dumps(ctx))
    trained.clear()
    assert len(ex.chain_context()["runs"]) == len(ex.CONTEXT_ARMS) and trained == []  # its own committed rows are reused
