"""Trainer options: boolean flags, Weights & Biases, compile once, resume on other hardware, MFU peaks,
stable-rank logging, kept checkpoints and the cap on skipped non-finite steps."""

import json
import sys
import warnings
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_reliability import rechecksum

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import trainer
from minimal_asymloop.model import ModelConfig, joint_attention_masked
from minimal_asymloop.trainer import NAN_ENV, ConfigError, NonFiniteLossError, TrainConfig, read_metrics, train

KEYS = ("step", "loss", "lr", "grad_norm", "val_loss")


def _curve(out) -> list[dict]:
    return [{k: r[k] for k in KEYS if k in r} for r in read_metrics(out)]


# ----------------------------------------------------------------------------- command line


def test_every_boolean_option_works_bare_and_with_a_value():
    p = train_minimal.build_parser()
    bools = [f for cls in (ModelConfig, TrainConfig) for f in fields(cls) if train_minimal._kind(f) is bool and f.name != "arch"]
    assert {"qk_norm", "compile", "wandb", "resume", "alrs"} <= {f.name for f in bools}
    for f in bools:
        flag = "--" + f.name.replace("_", "-")
        assert vars(p.parse_args([flag]))[f.name] is True, flag
        assert vars(p.parse_args([flag, "false"]))[f.name] is False, flag
        assert vars(p.parse_args([flag, "--lr", "1"]))[f.name] is True, flag  # a bare flag before another option
    assert vars(p.parse_args(["--alrs", "none"]))["alrs"] is None and vars(p.parse_args(["--compile", "none"]))["compile"] is None
    with pytest.raises(SystemExit):
        p.parse_args(["--qk-norm", "maybe"])


def test_wandb_without_the_package_is_a_one_line_error_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(SystemExit, match=r'error: --wandb needs the wandb package, an optional extra: pip install -e "\.\[wandb\]"'):
        train_minimal.main(["--wandb", "--data", str(tmp_path / "nowhere/*.txt"), "--out-dir", str(tmp_path / "o")])


@pytest.mark.slow  # wandb starts its service process: ~10-15 s
@pytest.mark.extra  # CI runs it again after installing the extras
def test_wandb_offline_logs_exactly_the_rows_of_metrics_jsonl(tiny_configs, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason='wandb is an optional extra: pip install -e ".[wandb]"')
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, runs, init = [], [], wandb.init

    def spy_init(**kw):  # the real offline run, with its log calls recorded on the way through
        run = init(**kw)
        log = run.log
        run.log = lambda row, *a, **k: (logged.append(json.loads(json.dumps(row))), log(row, *a, **k))[1]
        runs.append((kw, run))
        return run

    monkeypatch.setattr(wandb, "init", spy_init)
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=2, wandb=True, wandb_project="test-project", wandb_run_name="tiny")
    train(mcfg, tcfg)
    rows = read_metrics(tcfg.out_dir)
    assert len(rows) == 6 and logged == rows  # 4 steps + 2 evaluations, the same objects in the same order
    (kw, run), = runs
    assert (kw["project"], kw["name"], kw["config"]["train"]["lr"]) == ("test-project", "tiny", tcfg.lr)
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb")), "the offline run wrote no file"


@pytest.mark.slow  # wandb starts its service process, twice
@pytest.mark.extra
def test_a_resumed_run_continues_its_wandb_run(tiny_configs, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason='wandb is an optional extra: pip install -e ".[wandb]"')
    for k, v in dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true").items():
        monkeypatch.setenv(k, v)
    runs, init = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append((kw, init(**kw))) or runs[-1][1])
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=2, stop_step=2, wandb=True)
    train(mcfg, tcfg)  # stopped at step 2, as if interrupted
    train(mcfg, replace(tcfg, stop_step=None, resume=True))
    (kw1, run1), (kw2, run2) = runs
    assert kw1["id"] is None and kw2["id"] == run1.id and kw2["resume"] == "allow" and run2.id == run1.id


# ----------------------------------------------------------------------------- compile


def test_compile_is_automatic_on_cuda_only():
    on = trainer.compile_on
    assert TrainConfig(max_steps=1).compile is None
    assert on(TrainConfig(max_steps=1), torch.device("cuda", 0)) and not on(TrainConfig(max_steps=1), torch.device("cpu"))
    assert not on(TrainConfig(max_steps=1, compile=False), torch.device("cuda", 0))
    assert on(TrainConfig(max_steps=1, compile=True), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"unknown compile_backend 'inductr'; choose one of .*inductor"):
        bad = TrainConfig(max_steps=1, compile=True, compile_backend="inductr")
        trainer.compile_and_wrap(SimpleNamespace(cfg=bad, device=torch.device("cpu"), raw=torch.nn.Linear(2, 2), world=1))


def test_joint_mask_does_not_make_compile_recompile():
    # a module-level mask cache is a dynamo guard: once it fills, the second call recompiles
    torch._dynamo.reset()
    q, kg, vg, kl, vl = torch.randn(5, 1, 2, 8, 4).unbind(0)
    fn = torch.compile(joint_attention_masked, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            fn(q, kg, vg, kl, vl)
    torch._dynamo.reset()


@pytest.mark.slow  # dynamo + AOT autograd capture of the tiny model: ~10-20 s on a shared 2-core box
def test_the_model_compiles_once_over_steps_and_evaluations(tiny_configs):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mcfg, tcfg = tiny_configs(max_steps=6, eval_interval=2, compile=True, compile_backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile after the first step raises
        res = train(mcfg, tcfg)
    assert res["step"] == 6 and len([r for r in res["history"] if "val_loss" in r]) == 3
    assert counters["stats"]["unique_graphs"] >= 1 and counters["frames"]["ok"] >= 1  # it did compile
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- resume anywhere


def test_rng_restore_takes_the_current_device_and_ignores_cuda_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state.tolist(), device)))
    cpu = torch.get_rng_state()
    eight_gpus = [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]  # an older checkpoint: rank 0's view of 8 GPUs
    trainer.restore_rng(dict(torch=cpu, cuda=eight_gpus), torch.device("cpu"))
    assert calls == [] and torch.equal(torch.get_rng_state(), cpu)  # CPU after GPU: the CUDA state has nothing to apply to
    trainer.restore_rng(dict(torch=cpu, cuda=eight_gpus), torch.device("cuda", 1))  # 8 GPUs -> rank 1 of 2
    trainer.restore_rng(dict(torch=cpu, cuda=torch.full((8,), 7, dtype=torch.uint8)), torch.device("cuda", 5))  # per device
    trainer.restore_rng(dict(torch=cpu, cuda=None), torch.device("cuda", 0))  # GPU after CPU: keeps the seeded CUDA state
    assert calls == [([0] * 8, torch.device("cuda", 1)), ([7] * 8, torch.device("cuda", 5))]
    assert trainer.rng_state(torch.device("cpu"))["cuda"] is None


@pytest.mark.slow  # three short training runs: ~10-15 s on a shared box
def test_resume_from_a_checkpoint_saved_with_more_gpus_on_cpu_is_exact(tiny_configs, tmp_path):
    mcfg, full = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(tmp_path / "full"))
    train(mcfg, full)
    for fake in ([torch.zeros(16, dtype=torch.uint8)] * 8, torch.zeros(16, dtype=torch.uint8)):  # old format (8 GPUs), new format
        out = tmp_path / f"half-{type(fake).__name__}"
        _, half = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(out), stop_step=4)
        train(mcfg, half)
        path = ckpt.find_checkpoint(out) / "state.pt"
        state = torch.load(path, weights_only=True)
        torch.save({**state, "rng": {**state["rng"], "cuda": fake}}, path)  # as if saved by a CUDA run
        rechecksum(path.parent)  # as that run would have recorded it
        _, rest = tiny_configs(max_steps=8, eval_interval=4, out_dir=str(out), resume=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(mcfg, rest)
        assert _curve(out) == _curve(tmp_path / "full")


# ----------------------------------------------------------------------------- MFU


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM5
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A10", 125e12),  # not A100's
    ("NVIDIA L40S", 362.05e12),
    ("NVIDIA L40", 181.05e12),  # not L40S's
    ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("NVIDIA H100", None),  # not a product name torch reports: no guess
    ("Tesla V100-SXM2-16GB", None),  # no bf16 tensor cores
    ("NVIDIA H800 PCIe", None),
])
def test_mfu_peak_is_matched_by_exact_product_name(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert trainer.gpu_peak_flops(torch.device("cuda", 0)) == peak
    said = []
    assert trainer.peak_flops_or_reason(torch.device("cuda", 0), said.append) == peak
    assert len(said) == (peak is None) and all(f"MFU not logged: no peak bf16 FLOP/s is known for {name!r}" in s for s in said)
    assert trainer.gpu_peak_flops(torch.device("cpu")) is None


# ----------------------------------------------------------------------------- logging and checkpoints


def test_stable_rank_is_logged_at_evaluations_and_kept_checkpoints_survive(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=12, eval_interval=4, keep_every=6)
    res = train(mcfg, tcfg)
    evals = [r for r in read_metrics(tcfg.out_dir) if "val_loss" in r]
    keys = {"srank encoder attention", "srank encoder FFN", "srank decoder attention", "srank decoder FFN"}
    assert [r["step"] for r in evals] == [4, 8, 12] and all(keys <= set(r) for r in evals)
    assert all(0 < r[k] <= 1 for r in evals for k in keys)
    assert not any(k.startswith("srank") for r in read_metrics(tcfg.out_dir) if "loss" in r for k in r)  # evaluations only
    assert Path(res["srank_plot"]).name == "srank.png" and Path(res["srank_plot"]).stat().st_size > 1000
    out = Path(tcfg.out_dir)
    best = (out / "best").resolve().name
    # written at 4, 6 (keep_every, no evaluation), 8 and 12; kept: multiples of 6, latest (12) and best
    assert {p.name for p in out.glob("ckpt_*")} == {"ckpt_0000006", "ckpt_0000012", best}
    assert ckpt.read_meta(out / "ckpt_0000006")["step"] == 6 and ckpt.read_meta(out / "ckpt_0000006")["val_loss"] is None
    _, again = tiny_configs(max_steps=12, eval_interval=4, resume=True)  # resuming without --keep-every would delete them
    with pytest.raises(ConfigError, match=r"keep_every: 6 -> None"):
        train(mcfg, again)


def test_skipping_non_finite_steps_stops_after_max_skips_in_a_row(tiny_configs, monkeypatch):
    monkeypatch.setenv(NAN_ENV, "3,5,6")
    mcfg, tcfg = tiny_configs(max_steps=8, eval_interval=4, skip_nonfinite=True, max_skips=2)
    assert train(mcfg, tcfg)["nonfinite_skipped"] == 3  # never more than 2 in a row
    monkeypatch.setenv(NAN_ENV, "3,4,5")
    _, tcfg = tiny_configs(max_steps=8, eval_interval=4, skip_nonfinite=True, max_skips=2, out_dir=tcfg.out_dir + "-b")
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at 3 steps in a row, up to step 5: the run has diverged"):
        train(mcfg, tcfg)
    assert max(r["step"] for r in read_metrics(tcfg.out_dir)) == 4 and ckpt.read_meta(tcfg.out_dir)["step"] == 4
