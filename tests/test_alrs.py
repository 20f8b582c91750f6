import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from minimal_asymloop import alrs
from minimal_asymloop.model import LoopedLM, ModelConfig


def small_model(arch="asymloop", seed=0):
    """Smallest LoopedLM whose matrices all have >= 50 eigenvalues (so all are tuned)."""
    torch.manual_seed(seed)
    return LoopedLM(ModelConfig(arch=arch, n_layer=2, d_model=64, n_head=2, d_ff=128, vocab_size=128, max_seq_len=16))


def per_matrix_optimizer(model):
    tuned = alrs.tuned_matrices(model)
    rest = [p for n, p in model.named_parameters() if n not in tuned]
    groups = [dict(params=[p], name=n, lr_mult=1.0) for n, p in tuned.items()] + [dict(params=rest, name="other", lr_mult=1.0)]
    return torch.optim.AdamW(groups, lr=1e-3)


# ----------------------------------------------------------------------------- the multiplier map


def test_multiplier_map_is_linear_from_lo_to_hi():
    m = alrs.multipliers_from_alphas({"a": 2.0, "b": 6.0, "c": 3.0, "d": 4.0}, lo=1.0, hi=5.0)
    assert m == pytest.approx({"a": 1.0, "b": 5.0, "c": 2.0, "d": 3.0})
    m = alrs.multipliers_from_alphas({"a": 2.0, "b": 6.0, "c": 5.0}, lo=0.5, hi=2.5)
    assert m == pytest.approx({"a": 0.5, "b": 2.5, "c": 2.0})


def test_multiplier_map_equal_alphas_and_top_names():
    assert alrs.multipliers_from_alphas({"a": 3.0, "b": 3.0}, lo=1.0, hi=5.0) == {"a": 1.0, "b": 1.0}
    # embedding/head get the top multiplier and do not stretch the range of the others
    m = alrs.multipliers_from_alphas({"embed.weight": 40.0, "a": 2.0, "b": 4.0, "head.weight": 1.1}, top=alrs.TOP_NAMES)
    assert m == {"embed.weight": 5.0, "a": 1.0, "b": 5.0, "head.weight": 5.0}
    with pytest.raises(ValueError, match="lo <= hi"):
        alrs.multipliers_from_alphas({"a": 1.0}, lo=5.0, hi=1.0)
    with pytest.raises(ValueError, match="non-finite alpha"):
        alrs.multipliers_from_alphas({"a": 1.0, "b": float("nan")})


# ----------------------------------------------------------------------------- the estimators


def test_hill_median_matches_hand_computation():
    # nonzero eigenvalues [0.5, 1, 2, 4, 8] (1e-6 is below the 1e-5 zero cut); N=5, xmin = e[5//2] = 2,
    # tail [2, 4, 8], n=3: alpha = 1 + 3 / (ln 2 + ln 4 + ln 8 - 3 ln 2) = 1 + 1/ln 2
    evals = [4.0, 1e-6, 8.0, 0.5, 2.0, 1.0]
    assert alrs.hill_median_alpha(evals) == pytest.approx(1 + 1 / math.log(2), rel=1e-12)
    assert alrs.hill_median_alpha(torch.tensor(evals)) == pytest.approx(1 + 1 / math.log(2), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        alrs.hill_median_alpha([1e-7, 3.0])


def test_hill_median_without_the_zero_cut_is_the_reference_codes_default():
    # [1e-6, 0.5, 1, 2, 4, 8, 16]: all 7 (the reference's filter_zeros=False): xmin = e[3] = 2, tail [2, 4, 8, 16],
    # alpha = 1 + 4 / (10 ln 2 - 4 ln 2) = 1 + 2 / (3 ln 2); our cut leaves 6: xmin = 4, tail [4, 8, 16], 1 + 1 / ln 2
    evals = [16.0, 1e-6, 0.5, 1.0, 2.0, 4.0, 8.0]
    assert alrs.hill_median_alpha(evals, filter_zeros=False) == pytest.approx(1 + 2 / (3 * math.log(2)), rel=1e-12)
    assert alrs.hill_median_alpha(evals) == pytest.approx(1 + 1 / math.log(2), rel=1e-12)  # the default: the cut (ours)
    with pytest.raises(ValueError, match="median eigenvalue is 0.0"):
        alrs.hill_median_alpha([0.0, 0.0, 0.0, 1.0], filter_zeros=False)


def test_eigenvalues_are_squared_singular_values_on_a_copy():
    w = torch.randn(70, 50, dtype=torch.float64)
    before = w.clone()
    e = alrs.eigenvalues(w, dtype=torch.float64)
    np.testing.assert_allclose(e, np.sort(np.linalg.eigvalsh((w.T @ w).numpy())), rtol=1e-9)
    assert torch.equal(w, before) and e.dtype == np.float64 and len(e) == 50


@pytest.mark.skipif(torch.cuda.is_available(), reason="weightwatcher casts weights to fp16 on CUDA machines")
def test_ww_alpha_equals_weightwatcher_analyze():
    """Real model matrices plus a heavy-tailed and a spiked one: our alpha = weightwatcher's to 1e-6."""
    g = torch.Generator().manual_seed(0)
    mats = {k: v.detach() for k, v in alrs.tuned_matrices(small_model()).items() if ".0." in k or k in alrs.TOP_NAMES}
    mats["student_t.weight"] = torch.distributions.StudentT(2.0).sample((96, 160)) * 0.02
    q = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    mats["spiked.weight"] = torch.randn(128, 64, generator=g) @ torch.diag(torch.logspace(0, 2, 64)) @ q
    watcher = alrs.weightwatcher_module().WeightWatcher()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pandas deprecation warnings inside weightwatcher
        details = watcher.analyze(mats, plot=False)
    assert len(details) == len(mats)
    for _, row in details.iterrows():
        w = mats[row["name"] + ".weight"]
        assert alrs.ww_alpha(w, dtype=torch.float64) == pytest.approx(row["alpha"], rel=1e-6), row["name"]
        # the default float32 eigenvalues move alpha by ~1e-5 relative at most (measured in docs/alrs.md)
        assert alrs.ww_alpha(w) == pytest.approx(row["alpha"], rel=1e-4), row["name"]


@pytest.mark.parametrize("fit", alrs.FITS)
def test_planted_heavy_tail_gives_lower_alpha(fit):
    """Entries with tail index 1.5 give a power-law ESD; Gaussian entries give the light-tailed MP bulk."""
    fn = alrs.FIT_FNS[fit]
    for seed in range(3):
        torch.manual_seed(seed)
        gauss = torch.randn(128, 256)
        heavy = torch.distributions.StudentT(1.5).sample((128, 256))
        a_gauss, a_heavy = fn(alrs.eigenvalues(gauss)), fn(alrs.eigenvalues(heavy))
        assert a_heavy < a_gauss - 0.5, (seed, a_heavy, a_gauss)


def test_importing_weightwatcher_leaves_warnings_and_logging_alone():
    """weightwatcher silences all warnings and configures the root logger on import; we contain it."""
    code = ("import logging, warnings\n"
            "from minimal_asymloop.alrs import weightwatcher_module\n"
            "filters = list(warnings.filters)\n"
            "weightwatcher_module()\n"
            "assert warnings.filters == filters, 'warning filters changed'\n"
            "assert not logging.getLogger().handlers, 'root logger configured'\n"
            "warnings.warn('still-visible')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "still-visible" in out.stderr and "CUDA" not in out.stderr


# ----------------------------------------------------------------------------- which matrices, which groups


def test_tuned_matrices_and_groups():
    names = list(alrs.tuned_matrices(small_model()))
    assert names[0] == "embed.weight" and names[-1] == "head.weight"
    assert "decoder.0.attn.wk_glob.weight" in names and not any("norm" in n for n in names)
    assert len(names) == 2 + 7 + 9  # embed, head; one encoder block; one decoder block with Global KV
    groups = {n: alrs.group_of(n) for n in names}
    assert groups["encoder.0.attn.wq.weight"] == "encoder attention"
    assert groups["encoder.0.mlp.down.weight"] == "encoder FFN"
    assert groups["decoder.0.attn.wo.weight"] == "decoder attention"
    assert groups["decoder.0.attn.wv_glob.weight"] == "global KV"
    assert groups["decoder.0.mlp.gate.weight"] == "decoder FFN"
    assert groups["head.weight"] == "embedding/head"
    dense = alrs.tuned_matrices(small_model("full_loop"))
    assert {alrs.group_of(n) for n in dense} == {"attention", "FFN", "embedding/head"}
    # matrices with fewer than 50 eigenvalues are not tuned
    tiny = LoopedLM(ModelConfig(n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=64, max_seq_len=8))
    assert alrs.tuned_matrices(tiny) == {}


# ----------------------------------------------------------------------------- the schedule


def scripted_alphas(monkeypatch, model):
    """Replace the fit with scripted alphas (one dict per allocation) and count the calls."""
    names = list(alrs.tuned_matrices(model))
    calls = []

    def fake(m, fit):
        k = len(calls)
        calls.append(k)
        return {n: 2.0 + ((i + k) % len(names)) for i, n in enumerate(names)}  # a different ranking each time

    monkeypatch.setattr(alrs, "matrix_alphas", fake)
    return calls


def test_schedule_allocation_steps_ramp_and_freeze(monkeypatch):
    model = small_model()
    opt = per_matrix_optimizer(model)
    calls = scripted_alphas(monkeypatch, model)
    logged = []
    sched = alrs.ALRS(total_steps=1000, every=100, phase=0.2, ramp=50)
    assert [s for s in range(1000) if sched.allocates_at(s)] == [0, 100, 200]
    assert [s for s in range(1000) if alrs.ALRS(1000, first_step=1).allocates_at(s)] == [1, 101]
    name = "decoder.0.mlp.up.weight"
    group = next(g for g in opt.param_groups if g["name"] == name)
    seen = {}
    for step in range(1000):
        if (rec := sched.on_step(step, model, opt)) is not None:
            logged.append(rec)
        seen[step] = group["lr_mult"]
        if step in (0, 100, 200):
            assert len(calls) == step // 100 + 1
    targets = [r["alrs_multiplier"][name] for r in logged]
    assert [r["alrs_step"] for r in logged] == [0, 100, 200] and len(calls) == 3
    assert seen[0] == 1.0 and seen[25] == pytest.approx((1.0 + targets[0]) / 2) and seen[50] == pytest.approx(targets[0])
    assert seen[99] == pytest.approx(targets[0]) and seen[100] == pytest.approx(targets[0])
    assert seen[125] == pytest.approx((targets[0] + targets[1]) / 2) and seen[150] == pytest.approx(targets[1])
    assert seen[250] == pytest.approx(targets[2]) and seen[999] == pytest.approx(targets[2])  # frozen
    assert len(set(targets)) > 1  # the ramp had something to move between
    other = next(g for g in opt.param_groups if g["name"] == "other")
    assert other["lr_mult"] == 1.0
    assert {r["alrs_group_mean"]["embedding/head"] for r in logged} == {5.0}


def test_unpinned_embedding_and_head_are_allocated_by_their_alphas(monkeypatch):
    """top=() (the experiments' control) puts embedding and head into the alpha range like every other matrix."""
    model = small_model()
    names = list(alrs.tuned_matrices(model))
    alphas = {n: 3.0 + i for i, n in enumerate(names)} | {"embed.weight": 1.0, "head.weight": 2.0}  # the two lowest alphas
    monkeypatch.setattr(alrs, "matrix_alphas", lambda m, fit: dict(alphas))
    pinned = alrs.ALRS(100, every=10, phase=0.2, ramp=0).on_step(0, model, per_matrix_optimizer(model))["alrs_multiplier"]
    free = alrs.ALRS(100, every=10, phase=0.2, ramp=0, top=()).on_step(0, model, per_matrix_optimizer(model))["alrs_multiplier"]
    assert pinned["embed.weight"] == pinned["head.weight"] == 5.0
    assert free == pytest.approx(alrs.multipliers_from_alphas(alphas))  # one linear map over every matrix
    assert free["embed.weight"] == 1.0 and free["head.weight"] < pinned["head.weight"]


def test_skipped_embedding_and_head_stay_at_base_lr_outside_the_range(monkeypatch):
    """skip=TOP_NAMES (the paper's wording: ALRS on encoder and decoder matrices): embedding and head are fitted and
    logged, keep lr_mult 1, and their alphas do not move the other matrices' range."""
    model = small_model()
    names = [n for n in alrs.tuned_matrices(model) if n not in alrs.TOP_NAMES]
    alphas = {n: 3.0 + i for i, n in enumerate(names)} | {"embed.weight": 1.0, "head.weight": 99.0}  # outside the blocks'
    monkeypatch.setattr(alrs, "matrix_alphas", lambda m, fit: dict(alphas))
    opt = per_matrix_optimizer(model)
    rec = alrs.ALRS(100, every=10, phase=0.2, ramp=0, top=(), skip=alrs.TOP_NAMES).on_step(0, model, opt)
    blocks = {n: alphas[n] for n in names}
    assert rec["alrs_multiplier"] == pytest.approx(alrs.multipliers_from_alphas(blocks))  # the range is the blocks' own
    assert rec["alrs_alpha"]["head.weight"] == 99.0  # still fitted and logged
    mult = {g["name"]: g["lr_mult"] for g in opt.param_groups}
    assert mult["embed.weight"] == mult["head.weight"] == 1.0 and max(mult.values()) == 5.0
    with pytest.raises(ValueError, match="both pinned and skipped"):
        alrs.ALRS(100, skip=alrs.TOP_NAMES)  # the default top pins them


def test_state_dict_resume_reproduces_multipliers():
    """Real hill_median fits; the weights change between allocations; resume at step 130 from state_dict."""
    import copy

    def perturb(model, step):  # stands in for training: a heavier tail in one matrix at step 150
        if step == 150:
            torch.manual_seed(1)
            model.decoder[0].mlp.up.weight.data += torch.distributions.StudentT(1.5).sample((128, 64)) * 0.05

    model_a = small_model()
    a, opt_a = alrs.ALRS(1000, fit="hill_median", ramp=50), per_matrix_optimizer(model_a)
    for step in range(130):
        a.on_step(step, model_a, opt_a)
    model_b = copy.deepcopy(model_a)
    b, opt_b = alrs.ALRS(1000, fit="hill_median", ramp=50), per_matrix_optimizer(model_b)
    b.load_state_dict(a.state_dict())
    mults = []
    for step in range(130, 400):
        for model, sched, opt in ((model_a, a, opt_a), (model_b, b, opt_b)):
            perturb(model, step)
            sched.on_step(step, model, opt)
        assert [g["lr_mult"] for g in opt_a.param_groups] == [g["lr_mult"] for g in opt_b.param_groups], step
        if step >= 200:
            mults.append(next(g["lr_mult"] for g in opt_b.param_groups if g["name"] == "decoder.0.mlp.up.weight"))
    assert a.alphas == b.alphas and len(set(mults)) > 1  # the allocation at 200 moved the perturbed matrix


def test_real_fit_on_model_and_clear_errors():
    model = small_model()
    sched = alrs.ALRS(total_steps=10, fit="hill_median")
    with pytest.raises(ValueError, match="one optimizer group per tuned matrix"):
        sched.on_step(0, model, torch.optim.AdamW(model.parameters()))
    rec = sched.on_step(0, model, per_matrix_optimizer(model))
    assert sched.on_step(1, model, per_matrix_optimizer(model)) is None
    assert set(rec["alrs_alpha"]) == set(alrs.tuned_matrices(model))
    assert all(1.0 < a < 10.0 for a in rec["alrs_alpha"].values())
    assert min(rec["alrs_multiplier"].values()) == 1.0 and max(rec["alrs_multiplier"].values()) == 5.0
    with pytest.raises(ValueError, match="unknown ALRS fit 'hill'"):
        alrs.ALRS(10, fit="hill")


def test_history_and_plot(tmp_path):
    records = [dict(step=1, alrs_step=0, alrs_multiplier={"encoder.0.mlp.up.weight": 2.0, "decoder.0.mlp.up.weight": 3.0}),
               dict(step=50, loss=3.0),
               dict(step=101, alrs_step=100, alrs_multiplier={"encoder.0.mlp.up.weight": 2.0, "decoder.0.mlp.up.weight": 4.0})]
    steps, hist = alrs.multiplier_history(records, ramp_len=50, last_step=300)
    assert steps == [0, 50, 100, 150, 300]
    assert hist["decoder.0.mlp.up.weight"] == [1.0, 3.0, 3.0, 4.0, 4.0]
    ratios = alrs.plot_alrs(records, 50, 300, tmp_path / "alrs.png")
    assert ratios == {"FFN": 2.0} and (tmp_path / "alrs.png").stat().st_size > 10_000


# ----------------------------------------------------------------------------- with the trainer

ALRS_MODEL = dict(d_model=64, d_ff=128)  # every matrix has >= 50 eigenvalues, so all are tuned


@pytest.mark.parametrize("arch", ["asymloop", "dense"])
def test_every_parameter_in_exactly_one_group(arch):
    from minimal_asymloop.trainer import param_groups

    model = small_model(arch)
    groups = param_groups(model, 0.1, per_matrix=alrs.ALRS.per_matrix)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    alrs.check_groups(torch.optim.AdamW(groups), alrs.tuned_matrices(model))  # each tuned matrix alone, named after it


def test_alrs_on_by_default_for_asymloop_only_and_cli_errors(capsys):
    import train_minimal
    from minimal_asymloop.trainer import TrainConfig, make_alrs

    cfg = TrainConfig(max_steps=1000)
    assert isinstance(make_alrs(cfg, "asymloop"), alrs.ALRS)
    assert make_alrs(cfg, "dense") is None and make_alrs(cfg, "full_loop") is None
    assert make_alrs(TrainConfig(max_steps=10, alrs=False), "asymloop") is None
    # the paper presets train AsymLoop with ALRS; the CPU-sized tiny preset (ours) does not
    assert isinstance(make_alrs(TrainConfig.from_preset("60m"), "asymloop"), alrs.ALRS)
    assert make_alrs(TrainConfig.from_preset("60m"), "full_loop") is None
    assert make_alrs(TrainConfig.from_preset("tiny"), "asymloop") is None
    assert isinstance(make_alrs(TrainConfig.from_preset("tiny", alrs=True), "asymloop"), alrs.ALRS)
    hook = make_alrs(TrainConfig(max_steps=10, alrs=True, alrs_fit="hill_median", alrs_lo=0.5, alrs_hi=2.0), "full_loop")
    assert (hook.fit, hook.lo, hook.hi, hook.total_steps) == ("hill_median", 0.5, 2.0, 10)
    modes = {m: make_alrs(TrainConfig(max_steps=10, alrs_top=m), "asymloop") for m in ("pin", "base", "fit")}
    assert [(h.top, h.skip) for h in modes.values()] == [(alrs.TOP_NAMES, ()), ((), alrs.TOP_NAMES), ((), ())]
    assert make_alrs(TrainConfig(max_steps=10), "asymloop").top == alrs.TOP_NAMES  # He et al.'s code by default
    for argv, message in ((["--alrs-fit", "hill"], "unknown ALRS fit 'hill'; choose one of ww, hill_median"),
                          (["--alrs-top", "none"], "unknown alrs_top 'none'; choose one of pin, base, fit"),
                          (["--alrs-range", "5", "1"], "ALRS multiplier range needs 0 < lo <= hi, got lo=5.0, hi=1.0")):
        with pytest.raises(SystemExit) as e:
            train_minimal.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_resume_with_alrs_is_exact(tiny_configs, tmp_path):
    """Allocations at steps 0, 2, 4, 6 with 3-step ramps; stopping after 5 steps cuts a ramp in two."""
    from minimal_asymloop.trainer import read_metrics, train

    over = dict(max_steps=10, eval_interval=5, alrs_every=2, alrs_phase=0.6, alrs_ramp=3)
    mcfg, full = tiny_configs(model=ALRS_MODEL, out_dir=str(tmp_path / "full"), **over)
    res = train(mcfg, full)
    _, half = tiny_configs(model=ALRS_MODEL, out_dir=str(tmp_path / "half"), stop_step=5, **over)
    train(mcfg, half)
    _, rest = tiny_configs(model=ALRS_MODEL, out_dir=str(tmp_path / "half"), resume=True, **over)
    train(mcfg, rest)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "half")
    assert [r["alrs_step"] for r in a if "alrs_step" in r] == [0, 2, 4, 6]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    keys = ("loss", "lr", "grad_norm", "val_loss", "alrs_alpha", "alrs_multiplier")
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in keys if k in ra} == {k: rb[k] for k in keys if k in rb}
    assert res["alrs_plot"].endswith("alrs.png")


DDP_SCRIPT = """
import json, os, sys
import torch
from minimal_asymloop import alrs
from minimal_asymloop.model import ModelConfig
from minimal_asymloop.trainer import TrainConfig, train

rank = int(os.environ["RANK"])


class Recorded(alrs.ALRS):
    # rank 1's weights get a heavy tail before the first allocation, so a fit of its own would differ
    def on_step(self, step, model, optimizer):
        if step == 0 and rank == 1:
            torch.manual_seed(5)
            w = model.decoder[0].mlp.up.weight
            with torch.no_grad():
                w.add_(torch.distributions.StudentT(1.5).sample(w.shape) * 0.05)
            self.local = alrs.matrix_alphas(model, self.fit)
        self.lrs.append([g["lr"] for g in optimizer.param_groups])  # set by the trainer for the previous step
        record = super().on_step(step, model, optimizer)
        self.lr_mults.append([g["lr_mult"] for g in optimizer.param_groups])
        out = dict(lrs=self.lrs[1:], lr_mults=self.lr_mults, alphas=self.alphas, local=getattr(self, "local", None))
        with open(os.path.join(sys.argv[3], f"lrs_rank{rank}.json"), "w") as f:
            json.dump(out, f)
        return record


mcfg, tcfg = ModelConfig(**json.loads(sys.argv[1])), TrainConfig(**json.loads(sys.argv[2]))
hook = Recorded(tcfg.total_steps(), "hill_median", every=2, phase=1.0, ramp=1)
hook.lrs, hook.lr_mults = [], []
train(mcfg, tcfg, lr_hook=hook)
"""


@pytest.mark.slow  # two torch processes start up under torchrun (~15-25 s on a shared 2-core box)
def test_ddp_alrs_gives_every_rank_the_same_lrs(data_cache, tmp_path):
    import json
    import os
    from pathlib import Path

    from conftest import DATA, MODEL, run_group

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "ddp_alrs.py"
    script.write_text(DDP_SCRIPT)
    mcfg = dict(MODEL, **ALRS_MODEL, arch="asymloop")
    tcfg = dict(DATA, data_cache=str(data_cache), out_dir=str(tmp_path / "out"), seq_len=32, global_batch=8, micro_batch=2,
                max_steps=6, lr=3e-3, eval_interval=6, eval_batches=2, device="cpu", dtype="float32", quiet=True, seed=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           json.dumps(mcfg), json.dumps(tcfg), str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = run_group(cmd, cwd=tmp_path, env=env)  # a timeout fails the test at once
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"lrs_rank{r}.json").read_text()) for r in (0, 1))
    assert len(r0["lrs"]) == 5 and r0["lrs"] == r1["lrs"] and r0["lr_mults"] == r1["lr_mults"]
    assert r0["alphas"] == r1["alphas"]
    assert r1["local"] != r0["alphas"]  # rank 1 alone would have allocated differently
    assert len({m for row in r0["lr_mults"] for m in row}) > 2  # the multipliers really vary


def test_normalized_stable_rank_bounds_and_groups():
    from minimal_asymloop.alrs import normalized_stable_rank, stable_rank_summary

    assert normalized_stable_rank(torch.eye(64)) == pytest.approx(1.0)  # flat spectrum
    rank_one = torch.outer(torch.randn(64), torch.randn(96))
    assert normalized_stable_rank(rank_one) == pytest.approx(1 / 64, rel=1e-4)  # one direction: 1 / min(shape)
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig.from_preset("tiny", "asymloop"))
    s = stable_rank_summary(model)
    assert set(s) == {"srank encoder attention", "srank encoder FFN", "srank decoder attention", "srank decoder FFN"}
    assert all(0 < v <= 1 for v in s.values())
    assert set(stable_rank_summary(LoopedLM(ModelConfig.from_preset("tiny", "dense")))) == {"srank attention", "srank FFN"}
