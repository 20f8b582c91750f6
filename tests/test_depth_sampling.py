"""Train once, run at any depth: K sampled per optimizer step and truncated backprop through the loop (depth.py)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import DATA, MODEL, run_group

import train_minimal
from minimal_asymloop.config import TrainConfig
from minimal_asymloop.depth import DepthSampler
from minimal_asymloop.flops import flops_per_token, train_flops_per_token
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.system import ConfigError
from minimal_asymloop.trainer import read_metrics, train

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = dict(depth_sampler="uniform", depth_min=1, depth_max=4)


# ----------------------------------------------------------------------------- the sampler


def test_k_sequence_is_reproducible_and_follows_its_distribution():
    draws = lambda s, n=40: [s.draw() for _ in range(n)]  # noqa: E731
    uni = lambda seed: DepthSampler("uniform", 3, lo=2, hi=5, seed=seed)  # noqa: E731
    assert draws(uni(7)) == draws(uni(7)) != draws(uni(8))
    assert set(draws(uni(7), 400)) == {2, 3, 4, 5}
    ln = DepthSampler("lognormal_poisson", 3, mean=3.0, cap=8, seed=0)
    ks = draws(ln, 20000)
    assert set(ks) <= set(range(1, 9)) and ks.count(8) > 0  # the heavy tail reaches the cap
    assert abs(sum(ks) / len(ks) - ln.expected()) < 0.03  # E[K] by quadrature: 2.977 (the cap pulls it below 3)
    assert abs(sum(ln.pmf().values()) - 1) < 1e-9 and 2.95 < ln.expected() < 3.0
    fixed = DepthSampler("fixed", 3, seed=0)
    assert draws(fixed, 5) == [3] * 5 and fixed.expected() == 3.0
    s = uni(3)
    draws(s, 5)
    saved, after = s.state_dict(), draws(s, 10)
    s2 = uni(99)
    s2.load_state_dict(saved)
    assert draws(s2, 10) == after  # the generator state is all a resume needs


def test_expected_k_sets_the_training_flops():
    cfg = ModelConfig(arch="asymloop", **MODEL)
    three = 3 * flops_per_token(cfg, 32)["total"]
    uniform = DepthSampler("uniform", 3, lo=1, hi=5).pmf()  # E[K] = 3: FLOPs are linear in K
    assert train_flops_per_token(cfg, 32, uniform) == pytest.approx(three, rel=1e-12)
    assert train_flops_per_token(cfg, 32) == three  # fixed K: 3x forward, as before
    per_iter = flops_per_token(ModelConfig(arch="asymloop", n_iter=3, **MODEL), 32)["total"] - \
        flops_per_token(ModelConfig(arch="asymloop", n_iter=2, **MODEL), 32)["total"]
    # backprop through the last 1 of K=3: two iterations forward only, 2x per_iter each saved
    assert train_flops_per_token(cfg, 32, backprop_depth=1) == pytest.approx(three - 4 * per_iter, rel=1e-12)


# ----------------------------------------------------------------------------- bad settings: one line, before data


@pytest.mark.parametrize("settings, message", [
    (dict(depth_sampler="normal"), "unknown depth_sampler 'normal'; choose one of fixed, uniform, lognormal_poisson"),
    (dict(depth_sampler="uniform", depth_min=0, depth_max=3), "depth_min must be an integer >= 1"),
    (dict(depth_sampler="uniform", depth_min=4, depth_max=3), "depth_max must be an integer >= depth_min=4"),
    (dict(depth_sampler="uniform"), "--depth-sampler uniform needs --depth-max"),
    (dict(depth_sampler="lognormal_poisson", depth_mean=9.0, depth_cap=8), "depth_mean must be in (1, depth_cap=8], got 9.0"),
    (dict(depth_sampler="lognormal_poisson", depth_mean=1.0, depth_cap=8), "raise it"),
    (dict(depth_max=5), "depth_max=5 applies only to --depth-sampler uniform"),
    (dict(backprop_depth=-1), "backprop_depth must be an integer >= 0"),
])
def test_bad_depth_settings_are_one_line(settings, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(max_steps=1, **settings)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_combinations_fail_before_data_preparation(tmp_path, capsys):
    cache = tmp_path / "cache"  # never created: the error comes first
    common = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--d-ff", "64", "--vocab-size", "512", "--max-steps", "1",
              "--data-cache", str(cache), "--out-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match=r"error: --backprop-depth 1 < K=2 would leave the embedding without gradient"):
        train_minimal.main(["--arch", "full_loop", "--backprop-depth", "1", *common])
    with pytest.raises(SystemExit, match=r"error: --depth-sampler uniform needs a looping model .* got dense"):
        train_minimal.main(["--arch", "dense", "--depth-sampler", "uniform", "--depth-max", "3", *common])
    with pytest.raises(SystemExit) as e:  # a TrainConfig error: argparse's usage, then the one line
        train_minimal.main(["--depth-sampler", "lognormal_poisson", "--depth-mean", "9", "--depth-cap", "8", *common])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.endswith("error: depth_mean must be in (1, depth_cap=8], got 9.0; lower it or raise --depth-cap")
    assert not cache.exists()


# ----------------------------------------------------------------------------- truncated backprop


def _grads(model, idx, **kw):
    model.zero_grad(set_to_none=True)
    model(idx, idx, return_logits=False, **kw)[1].backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch, extra", [("asymloop", {}), ("asymloop", dict(context="additive")), ("full_loop", {})])
def test_truncation_n_ge_k_equals_full_backprop(arch, extra):
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(arch=arch, n_iter=3, **MODEL, **extra))
    idx = torch.randint(0, 512, (2, 16))
    full = _grads(model, idx)
    for n in (3, 5):
        trunc = _grads(model, idx, backprop_depth=n)
        assert all(torch.equal(full[k], trunc[k]) for k in full)
    cut = _grads(model, idx, backprop_depth=1)
    assert not torch.allclose(full["decoder.0.mlp.up.weight" if arch == "asymloop" else "blocks.0.mlp.up.weight"],
                              cut["decoder.0.mlp.up.weight" if arch == "asymloop" else "blocks.0.mlp.up.weight"])


def test_truncation_backpropagates_through_the_last_n_iterations_only():
    """Full Loop K=3, n=1: the gradient equals that of one pass through the blocks from the detached z_2."""
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(arch="full_loop", n_iter=3, **MODEL))
    idx = torch.randint(0, 512, (2, 16))
    cut = _grads(model, idx, backprop_depth=1)
    model.zero_grad(set_to_none=True)
    x = model.states(idx, 2)[-1].detach()  # z_2, no graph
    for blk in model.blocks:
        x = blk(x, model.rope)
    torch.nn.functional.cross_entropy(model.logits(x).flatten(0, 1), idx.flatten()).backward()
    for n, p in model.named_parameters():
        assert (cut[n] is None) == (p.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(cut[n], p.grad, rtol=1e-5, atol=1e-7)
    assert cut["embed.weight"] is None  # the embedding reaches the loop only through z_0: why the trainer refuses n < K here
    # AsymLoop with Global KV: the encoder still learns, through the Global KV of the last iterations
    asym = LoopedLM(ModelConfig(arch="asymloop", n_iter=3, **MODEL))
    g = _grads(asym, idx, backprop_depth=1)
    assert g["encoder.0.mlp.up.weight"].abs().sum() > 0 and g["embed.weight"].abs().sum() > 0


# ----------------------------------------------------------------------------- the trainer


def test_sampled_k_is_logged_and_resume_is_exact(tiny_configs, tmp_path):
    mcfg, whole = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(tmp_path / "whole"), **UNIFORM)
    train(mcfg, whole)
    _, half = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(tmp_path / "half"), stop_step=4, **UNIFORM)
    train(mcfg, half)
    _, rest = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(tmp_path / "half"), resume=True, **UNIFORM)
    train(mcfg, rest)
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "half")
    ks = [r["n_iter"] for r in a if "n_iter" in r]
    assert len(ks) == 8 and ks[:4] != ks[4:] and len(set(ks)) > 1  # a restarted generator would repeat ks[:4]
    assert ks == [r["n_iter"] for r in b if "n_iter" in r]
    assert [r.get("loss", r.get("val_loss")) for r in a] == [r.get("loss", r.get("val_loss")) for r in b]
    ref = DepthSampler("uniform", 3, lo=1, hi=4, seed=whole.seed)
    assert ks == [ref.draw() for _ in range(8)]  # drawn from the run's seed


# a 10-step tiny run (conftest's model and data, seed 0) before sampled depth existed: fixed K must not move. Bit for
# bit on the CPU that recorded them; another CPU's float rounding moves them by about 1e-6 (seen: 5e-7 on an AVX2
# AMD EPYC), while any change to what fixed-K training draws or computes moves them by far more than TOL
TOL = 1e-5
BEFORE = {"asymloop": [6.262590408325195, 6.237105846405029, 6.192770004272461, 6.193567276000977, 6.137782573699951,
                       6.135359287261963, 6.033649921417236, 6.029570579528809, 6.031004905700684, 6.000643730163574,
                       6.030712366104126],
          "full_loop": [6.237523078918457, 6.215751647949219, 6.176563262939453, 6.163789749145508, 6.117111682891846,
                        6.073704242706299, 5.994101524353027, 5.988000869750977, 5.977931976318359, 5.946907043457031,
                        5.969046115875244]}


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="losses recorded with torch 2.13 on CPU, float32")
@pytest.mark.parametrize("arch", ["asymloop", "full_loop"])
def test_fixed_k_trains_as_before_sampled_depth(tiny_configs, arch):
    mcfg, tcfg = tiny_configs(arch, max_steps=10, eval_interval=10)
    result = train(mcfg, tcfg)
    losses = [r["loss"] for r in result["history"] if "loss" in r] + [result["val_loss"]]
    assert len(losses) == len(BEFORE[arch]) and max(abs(a - b) for a, b in zip(losses, BEFORE[arch])) < TOL, losses


DDP_SCRIPT = """
import json, os, sys
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.trainer import TrainConfig, train
seen, forward = [], LoopedLM.forward
def recording(self, idx, targets=None, n_iter=None, **kw):
    if self.training:
        seen.append(n_iter)
    return forward(self, idx, targets, n_iter, **kw)
LoopedLM.forward = recording
train(ModelConfig(**json.loads(sys.argv[1])), TrainConfig(**json.loads(sys.argv[2])))
open(os.path.join(sys.argv[3], f"k_rank{os.environ['RANK']}.json"), "w").write(json.dumps(seen))
"""


@pytest.mark.slow  # two torch processes start up under torchrun (~15-25 s on a shared 2-core box)
def test_every_rank_and_micro_batch_runs_the_same_k(data_cache, tmp_path):
    script = tmp_path / "ddp_depth.py"
    script.write_text(DDP_SCRIPT)
    tcfg = dict(DATA, data_cache=str(data_cache), out_dir=str(tmp_path / "out"), seq_len=32, global_batch=8, micro_batch=2,
                max_steps=6, lr=3e-3, eval_interval=6, eval_batches=2, device="cpu", dtype="float32", quiet=True, seed=0,
                depth_sampler="lognormal_poisson", depth_mean=3.0, depth_cap=6)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           json.dumps(dict(MODEL, arch="asymloop")), json.dumps(tcfg), str(tmp_path)]
    proc = run_group(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"k_rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and len(r0) == 12  # 6 steps x 2 micro-batches (global 8 = 2 ranks x micro 2 x accumulation 2)
    assert r0[0::2] == r0[1::2]  # both micro-batches of a step
    logged = [r["n_iter"] for r in read_metrics(tmp_path / "out") if "n_iter" in r]
    assert logged == r0[0::2] and len(set(logged)) > 1


# ----------------------------------------------------------------------------- test time: any K


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_logit_lens_and_kv_cached_generation_work_at_any_k(k):
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(arch="asymloop", n_iter=3, **MODEL)).eval()
    idx = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        lens = model.states(idx, 8)  # one pass at the largest K: the lens of every smaller K
        torch.testing.assert_close(model.logits(lens[k - 1]), model(idx, n_iter=k)[0])
    cached = model.generate(idx, 6, temperature=0.0, n_iter=k, use_cache=True)
    plain = model.generate(idx, 6, temperature=0.0, n_iter=k, use_cache=False)
    assert torch.equal(cached, plain)


# ----------------------------------------------------------------------------- the experiment: cached per run, resumable


def test_sampled_depth_experiment_reuses_cached_runs_and_lists_the_missing(monkeypatch, tmp_path):
    import importlib

    from minimal_asymloop.experiments import common
    sd = importlib.import_module("minimal_asymloop.experiments.sampled_depth")  # the module (the package exports the function)

    monkeypatch.setattr(sd, "OUT", tmp_path)
    monkeypatch.setattr(sd, "probe_batch", lambda: None)
    monkeypatch.setattr(sd, "peak_memory", lambda k: 1000 * k)
    monkeypatch.setattr(sd, "train_on_task", lambda *a, **k: pytest.fail("trained a cached run"))
    monkeypatch.setattr(common, "CACHED_ONLY", True)
    setting = dict(task=sd.CHAIN_TASK, model=sd.CHAIN_MODEL, steps=sd.CHAIN_STEPS, batch=sd.CHAIN_BATCH, lr=sd.CHAIN_LR,
                   recipe=sd.RECIPES["lognormal_k3"])
    cached = dict(task="chain", recipe="lognormal_k3", seed=1, mean_k=2.9)
    (tmp_path / "chain-lognormal_k3-s1.json").write_text(json.dumps(dict(setting=setting, run=cached)))
    result = sd.sampled_depth()
    assert result["runs"] == [cached]
    assert len(result["missing"]) == 3 * 3 * 2 + 3 * 3 - 1 and dict(task="lm", recipe="fixed_k3", seed=0) in result["missing"]
    assert dict(task="finetune", recipe="uniform_k1_5", seed=3) in result["missing"]  # the fine-tune part, from seed 3's weights
    assert result["memory"]["lognormal_k3"]["peak_bytes_at_largest_k"] == 8000  # the cap sets the peak
    setting["steps"] += 1  # another setting: the cached run is not this one's
    (tmp_path / "chain-lognormal_k3-s1.json").write_text(json.dumps(dict(setting=setting, run=cached)))
    with pytest.raises(pytest.fail.Exception, match="trained a cached run"):
        sd.chain_run("lognormal_k3", 1, sd.CHAIN_STEPS)
    ft = dict(start="asymloop_k3-s1.safetensors", steps=sd.FINETUNE_STEPS, batch=sd.CHAIN_BATCH, lr=sd.CHAIN_LR,
              recipe=sd.RECIPES["fixed_k3"])
    (tmp_path / "finetune-fixed_k3-s1.json").write_text(json.dumps(dict(setting=ft, run=cached)))
    assert sd.finetune_run("fixed_k3", 1, sd.FINETUNE_STEPS) == cached  # its setting: read, not retrained
    with pytest.raises(pytest.fail.Exception, match="trained a cached run"):
        sd.finetune_run("fixed_k3", 1, sd.FINETUNE_STEPS + 1)


def test_sampled_depth_figures_and_within_seed_differences():
    from minimal_asymloop.course import sampled_depth as fig

    def run(task, recipe, seed, ces):
        fixed = [dict(k=k, mean_iter=k, ce=c, acc_by_hops={"3": 1 - c}, flops_per_token=1e3 * k) for k, c in enumerate(ces, 1)]
        adaptive = [dict(tau=t, mean_iter=m, ce=c, flops_per_token=1e3 * m + 100)  # + the exit checks
                    for t, m, c in ((0.0, 3, ces[-1]), (0.1, 2.5, ces[1] - 0.1), (1.0, 1.2, ces[0]))]
        return dict(task=task, recipe=recipe, seed=seed, sweep=dict(fixed=fixed, adaptive=adaptive))

    result = dict(runs=[run(t, "fixed_k3", s, [0.9, 0.6, 0.5]) for t in ("lm", "chain") for s in (0, 1)]
                  + [run(t, "lognormal_k3", s, [0.8, 0.5, 0.45 + s / 10]) for t in ("lm", "chain") for s in (0, 1)])
    diff = fig.within_seed(result)["lognormal_k3"]
    assert diff["seeds"] == [0, 1] and [round(d, 6) for d in diff["diff"][1]] == [-0.1, -0.1, 0.05]
    best = fig.beats_fixed(result)["lognormal_k3"]
    assert [b["tau"] for b in best] == [0.1, 0.1] and round(best[0]["gain"], 6) == -0.1  # 0.4 at 2.5 iterations < 0.5 at K=3
    assert fig.fig_test_k(result).axes[0].get_title() and "FLOPs" in fig.fig_frontier(result).axes[0].get_xlabel()


def test_bench_samplers_times_every_recipe_side_by_side(capsys):
    from minimal_asymloop.bench import main

    rows = main(["depth", "--samplers", "--steps", "4", "--batch", "1", "--seq", "16"])
    assert [r["recipe"] for r in rows][0] == "fixed K=3" and rows[0]["mean_k"] == 3 and rows[0]["vs_fixed"] == 1
    assert all(r["s_per_token"] > 0 for r in rows) and {r["mean_k"] for r in rows[1:]} != {3.0}  # K was drawn
    assert "per iteration" in capsys.readouterr().out
