"""Notebook 00's tables and figures (course.tour) and its closing demo (experiments.depth_demo)."""

import importlib
import inspect

import pytest
import torch
from matplotlib.figure import Figure

from minimal_asymloop.course import tour
from minimal_asymloop.experiments.depth_demo import demo_model
from minimal_asymloop.flops import count_params
from minimal_asymloop.model import ModelConfig


def _paper_precision(r):
    return (round(r["full"], 6), round(r["asym"], 6), round(r["proj"], 2), round(r["attn"], 2), round(r["overhead"], 2))


def test_table9_reproduces_the_paper_to_every_printed_digit():
    rows = tour.table9()
    assert [r["size"] for r in rows] == ["60m", "135m", "350m", "1b"]
    for r in rows:
        assert _paper_precision(r) == r["paper"], r["size"]


def test_table9_check_tells_a_wrong_setting_apart():
    """The same comparison fails at another sequence length: the match is not loose enough to hold anywhere."""
    assert all(_paper_precision(r) != r["paper"] for r in tour.table9(seq_len=2048))


def test_share_is_overhead_over_one_plus_overhead():
    for r in tour.table9():
        assert r["share"] == pytest.approx(100 * r["overhead"] / (100 + r["overhead"]))
        assert r["share"] < r["overhead"]
    assert "| 60m | 0.256967 (0.256967) | 0.292356 (0.292356) | 2.75 (2.75) | 11.02 (11.02) | 13.77 (13.77) | 12.10" in \
        tour.table9_markdown(tour.table9())


def test_table10_parameters_match_the_paper():
    for size, (full_p, asym_p) in tour.TABLE10_PARAMS.items():
        assert round(count_params(ModelConfig.from_preset(size, "full_loop")) / 1e6, 2) == full_p
        assert round(count_params(ModelConfig.from_preset(size, "asymloop")) / 1e6, 2) == asym_p
    assert "| 60m | 91.83M (91.83M) | 95.37M (95.37M) | 3.54M = 3.9% |" in tour.table10_markdown()


def test_demo_models_share_initial_weights_across_k():
    """One random draw at every K; only the residual output projections (wo, mlp.down) are scaled by
    1/sqrt(2·effective depth): depth 2 at K = 1, 4 at K = 3, a factor sqrt(2) apart."""
    a, b = demo_model(1, seed=0).state_dict(), demo_model(3, seed=0).state_dict()
    assert a.keys() == b.keys()
    scaled = [n for n in a if n.endswith(("attn.wo.weight", "mlp.down.weight"))]
    assert len(scaled) == 4 and all(torch.equal(a[n], b[n]) for n in a if n not in scaled)
    assert all(torch.allclose(a[n], b[n] * 2 ** 0.5) for n in scaled)
    c = demo_model(1, seed=1).state_dict()
    assert not all(torch.equal(a[n], c[n]) for n in a)  # another seed, other weights


def _fake_result(fresh_k1, fresh_k3, steps_k3):
    runs = []
    for k, accs, steps in ((1, fresh_k1, [None] * len(fresh_k1)), (3, fresh_k3, steps_k3)):
        for seed, (a, s) in enumerate(zip(accs, steps)):
            runs.append(dict(n_iter=k, seed=seed, converged_at=s, curve=[(0, {"1": 0.3, "2": 0.3, "3": 0.3}),
                                                                         (100, {"1": 1.0, "2": a, "3": a})],
                             fresh={"1": 1.0, "2": a, "3": a}))
    return dict(setting=dict(steps=1000), runs=runs)


def test_final_accuracy_and_steps_are_per_k_in_seed_order():
    res = _fake_result([0.5, 0.6], [0.995, 0.4], [750, None])
    res["runs"].reverse()
    for r in res["runs"]:  # the fresh programs' score differs: final_accuracy reads the held-out check, not it
        r["fresh"] = {"1": 0.0, "2": 0.0, "3": 0.0}
    assert tour.final_accuracy(res, hops=3) == {1: [0.5, 0.6], 3: [0.995, 0.4]}
    assert tour.demo_steps(res) == {1: [None, None], 3: [750, None]}


def _chain(accs):
    return {"asymloop_k1": [(a, 6000, False) for a in accs], "asymloop_k3": [(1.0, 750, True) for _ in accs]}


def test_figures_build_and_count_converged_seeds():
    assert isinstance(tour.architectures_figure(), Figure)
    res = _fake_result([0.5, 0.6, 0.5, 0.45, 0.5], [0.99, 1.0, 0.97, 0.52, 0.995], [500, 750, None, None, 1000])
    fig = tour.seeds_figure(res, _chain([0.5] * 5))
    title = fig._suptitle.get_text()  # two lines: the converged counts, then the key
    assert title.startswith("Converged seeds, AsymLoop K = 3: 3/5 within 1,000 steps (left), 5/5 within 6,000 "
                            "(chain_task). K = 1: 0/5 and 0/5, the same budgets\n"), title
    assert title.count("\n") == 1
    assert fig.axes[1].get_title() == "at most 6,000 steps (chain_task)"
    live = {k: dict(curve=r["curve"]) for k, r in ((1, res["runs"][0]), (3, res["runs"][5]))}
    assert len(tour.live_figure(live).axes) == 3


def test_my_states_reference_matches_the_package_and_the_mistake_does_not():
    from minimal_asymloop.model import LoopedLM
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(arch="asymloop", n_layer=4, d_model=32, n_head=2, d_ff=64, vocab_size=32, max_seq_len=16)).eval()
    x = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        pkg, ref, wrong = m.states(x, n_iter=3), tour.my_states(m, x, 3), tour.my_states(m, x, 3, recompute=True)
    assert len(ref) == 3 and all(torch.equal(a, b) for a, b in zip(ref, pkg))
    assert torch.equal(wrong[0], pkg[0]) and not torch.equal(wrong[-1], pkg[-1])


def test_notebook_00s_build_check_passes_the_reference_and_fails_both_wrong_versions():
    from minimal_asymloop.course import build
    from minimal_asymloop.model import LoopedLM
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(arch="asymloop", n_layer=4, d_model=32, n_head=2, d_ff=64, vocab_size=32, max_seq_len=16)).eval()
    x = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        pkg = m.states(x, n_iter=3)

    def check(f):  # the notebook's: every z_k at K = 3 bit for bit
        with torch.no_grad():
            out = f(m, x, 3)
        assert len(out) == len(pkg) and all(torch.equal(u, v) for u, v in zip(out, pkg))

    assert build.passes(check, tour.my_states)
    assert not build.passes(check, lambda m, idx, K: tour.my_states(m, idx, K, recompute=True))  # Global KV from z_{k-1}
    assert not build.passes(check, lambda m, idx, K: tour.my_states(m, idx, 1) * K)  # no loop: z_1 repeated


def test_seeds_summary_names_the_converged_seeds_and_their_steps():
    res = _fake_result([0.5, 0.6, 0.5, 0.45, 0.5], [0.99, 1.0, 0.97, 0.52, 0.995], [500, 750, None, None, 1000])
    lines = tour.seeds_summary(res, {"x": [(0.5, 6000, False), (1.0, 750, True)]}).splitlines()
    assert lines[1].endswith("0.99 1.00 0.97 0.52 0.99 | converged 3/5: seed (step) 0 (500), 1 (750), 4 (1,000)"), lines
    assert lines[2].endswith("0.50 1.00 | converged 1/2: seed (step) 1 (750)") and lines[0].endswith("converged 0/5"), lines


def test_same_run_tells_the_stored_run_of_its_seed_from_another():
    res = _fake_result([0.5, 0.6], [0.995, 0.4], [100, None])
    live = dict(res["runs"][2], curve=res["runs"][2]["curve"][:1])  # K = 3, seed 0, its first check only
    assert tour.same_run(dict(res["runs"][2]), res) and tour.same_run(dict(res["runs"][1]), res)
    assert tour.same_run(dict(live, converged_at=None), res)  # a shorter run: a prefix of the stored one
    assert not tour.same_run(dict(res["runs"][2], seed=1), res)  # seed 1's run did not reach 0.995
    assert not tour.same_run(dict(res["runs"][2], converged_at=200), res)
    assert not tour.same_run(dict(res["runs"][2], seed=7), res)  # no stored run


def test_trained_chain_model_names_the_committed_seeds():
    with pytest.raises(FileNotFoundError, match="committed seeds: 0, 1, 3"):
        tour.trained_chain_model(2)


def test_chain_seeds_reads_each_arm_in_seed_order():
    runs = [dict(name=f"asymloop_k{k}", seed=s, n_iter=k, steps=100 * s + k, converged=k == 3,
                 acc_by_test_k={str(k): {"3": s / 10 + k}}) for s in (1, 0) for k in (1, 3)]
    runs.append(dict(name="dense_l4", seed=0, n_iter=1, steps=1, converged=True, acc_by_test_k={"1": {"3": 9.0}}))
    assert tour.chain_seeds(dict(runs=runs), names=("asymloop_k1", "asymloop_k3")) == {
        "asymloop_k1": [(1.0, 1, False), (1.1, 101, False)], "asymloop_k3": [(3.0, 3, True), (3.1, 103, True)]}


def test_executed_blocks_counts_what_runs():
    """Hooks count E + K·D blocks and D Global KV projections at any K; Full Loop K·L blocks and none."""
    def cfg(arch, k):
        return ModelConfig(arch=arch, n_layer=4, n_iter=k, d_model=16, n_head=2, d_ff=32, vocab_size=8, max_seq_len=8)
    assert tour.executed_blocks(cfg("asymloop", 3)) == {"blocks": 8, "global_kv": 2}
    assert tour.executed_blocks(cfg("asymloop", 3), n_iter=1) == {"blocks": 4, "global_kv": 2}
    assert tour.executed_blocks(cfg("full_loop", 2)) == {"blocks": 8, "global_kv": 0}


def test_forward_excerpt_is_the_running_source_without_the_additive_branch():
    text = tour.forward_excerpt()
    assert "self.global_kv(h, start, cache)" in text and "return self.head(self.norm(z))" in text
    assert "z = z + h" not in text and "for k in range(n_iter)" in text


def test_demo_trains_with_chain_tasks_schedule_and_stops_at_its_budget(monkeypatch):
    """The LR schedule runs over chain_task's 6,000 steps (warm-up 600), cut at the budget: not a schedule of `steps`."""
    dd = importlib.import_module("minimal_asymloop.experiments.depth_demo")  # the module (the package exports its function)
    seen = {}
    real = dd.train_on_task

    def spy(model, task, **kw):
        seen.update(kw)
        return real(model, task, **kw)

    monkeypatch.setattr(dd, "train_on_task", spy)
    run, _ = dd.demo_train(1, seed=0, steps=10)
    assert seen["steps"] == 6000 and run["steps"] == 10 and run["converged_at"] is None
    assert [s for s, _ in run["curve"]] == [0, 10] and set(run["fresh"]) == {"1", "2", "3"}


def test_a_check_changes_no_weight_and_training_moves_them():
    """trained_weights: held-out checks every 2 steps leave the weights bit for bit as no checks do; one step fewer does not."""
    def same(a, b):
        return all(torch.equal(a[n], b[n]) for n in a)
    unchecked = tour.trained_weights(None, steps=4)
    assert same(tour.trained_weights(2, steps=4), unchecked)
    assert not same(tour.trained_weights(None, steps=3), unchecked)


def test_figures_take_reference_lines_and_label_each_arm():
    acc = {s: {k: {2: 0.9, 3: 0.2 * k} for k in (1, 2, 3)} for s in (0, 1)}
    ax = tour.test_time_figure(acc, {1: 1.0, 2: 0.56, 3: 0.59}).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()][-2:] == ["chance: 0.25", "no-chain rule, 3 hops: 0.59"]
    zoomed = tour.test_time_figure(acc, {3: 0.59}, ylim=(0.97, 1.0), title="zoomed").axes[0]  # lines out of view: no entry
    assert zoomed.get_title() == "zoomed" and not any(
        w in t.get_text() for t in zoomed.get_legend().get_texts() for w in ("chance", "rule"))
    res = _fake_result([0.5] * 5, [0.5] * 5, [None] * 5)
    fig = tour.seeds_figure(res, _chain([0.5] * 5))
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["AsymLoop K = 1\n(depth 2)", "AsymLoop K = 3\n(depth 4)"]


def test_check_seed_is_the_early_stops_and_the_rule_scores_those_programs():
    """The no-chain rule drawn beside the training curves is scored on the curves' own check programs."""
    from minimal_asymloop.tasks import ChainTask, accuracy_by_hops
    assert tour.CHECK_SEED == inspect.signature(accuracy_by_hops).parameters["seed"].default
    task = ChainTask(n_stmt=8, max_hops=3, n_vars=8, n_values=4)
    idx, _, _ = task.batch(16, torch.Generator().manual_seed(tour.CHECK_SEED))
    g = torch.Generator().manual_seed(tour.CHECK_SEED)  # frequency_rule walks task.program as task.batch does
    assert [task.program(g)[0] for _ in range(16)] == [task.decode(row) for row in idx]
    assert tour.frequency_rule(task, n=256, seed=tour.CHECK_SEED) != tour.frequency_rule(task, n=256, seed=4321)


def test_init_iter_starts_k1_from_k3s_weights_and_only_k_differs():
    """demo_model(1, init_iter=3): K = 3's initial weights bit for bit (not K = 1's √2-larger projections), run at K = 1."""
    same, k3, k1 = demo_model(1, seed=0, init_iter=3), demo_model(3, seed=0), demo_model(1, seed=0)
    assert same.config.n_iter == 1 and all(torch.equal(v, k3.state_dict()[n]) for n, v in same.state_dict().items())
    assert not all(torch.equal(v, k1.state_dict()[n]) for n, v in same.state_dict().items())


def test_same_init_runs_get_their_own_row_and_column():
    res = _fake_result([0.5] * 5, [0.99, 1.0, 0.97, 0.52, 0.995], [500, 750, None, None, 1000])
    res["same_init"] = [dict(r, init_iter=3, curve=[r["curve"][0], (100, {"1": 1.0, "2": 0.55, "3": 0.51})])
                        for r in res["runs"] if r["n_iter"] == 1]
    lines = tour.seeds_summary(res, {}).splitlines()
    assert lines[2].startswith("depth_demo K=1, K=3's init") and lines[2].endswith("0.51 0.51 0.51 0.51 0.51 | converged 0/5")
    fig = tour.seeds_figure(res, _chain([0.5] * 5))
    ticks = [t.get_text().split("\n") for t in fig.axes[0].get_xticklabels()]  # like for like first: only K differs
    assert [t[1] for t in ticks] == ["K = 3's init", "K = 3", "K = 1"] and ticks[2][2] == "(own init)"
    assert fig._suptitle.get_text().split("\n")[0].endswith("; from K = 3's init, 0/5")
    del res["same_init"]
    assert len(tour.seeds_figure(res, _chain([0.5] * 5)).axes[0].get_xticklabels()) == 2
