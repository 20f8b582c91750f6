"""The trainer as a system: DDP under torchrun, signals, and the bf16 + compile path."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DATA, MODEL, run_group

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.trainer import read_metrics, train

ROOT = Path(__file__).resolve().parents[1]


def cli_args(data_cache, out_dir, **over):
    """train_minimal.py arguments for the test model and data slice."""
    args = dict(MODEL, **{k: v for k, v in DATA.items()}, data_cache=data_cache, out_dir=out_dir, seq_len=32, global_batch=8,
                lr=3e-3, device="cpu", dtype="float32", seed=0, quiet=True, **over)
    return [x for k, v in args.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.mark.slow  # two torch processes start up (~15-25 s on a shared 2-core box)
def test_torchrun_ddp_matches_single_process(tiny_configs, data_cache, tmp_path):
    # single process: one micro-batch of 8; DDP: 2 ranks x micro 2 x accumulation 2. Same global batch of 8.
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=2, micro_batch=8, out_dir=str(tmp_path / "single"))
    train(mcfg, tcfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ROOT / "train_minimal.py"),
           *cli_args(data_cache, tmp_path / "ddp", max_steps=4, eval_interval=2, eval_batches=2, micro_batch=2)]
    proc = run_group(cmd, cwd=tmp_path, env=_env())  # a timeout fails the test at once
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, ddp = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in ddp] == [r["step"] for r in single] == [1, 2, 2, 3, 4, 4]  # rank 0 only: no duplicate rows
    for a, b in zip(single, ddp):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) < 1e-5, (key, a, b)
    assert ckpt.read_meta(tmp_path / "ddp")["step"] == 4


class CtrlC:
    """An lr_hook that presses Ctrl-C (SIGINT to this process) during step `at`, 0-based."""

    per_matrix = False

    def __init__(self, at=None):
        self.at = at

    def on_step(self, step, model, optimizer):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGINT)

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def test_sigint_checkpoints_and_resume_continues(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=8, eval_interval=100)
    before = signal.getsignal(signal.SIGINT)
    res = train(mcfg, tcfg, lr_hook=CtrlC(at=2))  # the loop finishes step 3, checkpoints and returns
    assert res["interrupted"] and res["step"] == 3 and ckpt.read_meta(tcfg.out_dir)["step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored after train()
    rest = train(mcfg, type(tcfg)(**{**tcfg.__dict__, "resume": True}), lr_hook=CtrlC())
    assert rest["step"] == 8 and not rest["interrupted"]
    assert [r["step"] for r in read_metrics(tcfg.out_dir) if "loss" in r] == list(range(1, 9))


@pytest.mark.slow  # a fresh interpreter imports torch (~10 s on a shared box)
def test_sigterm_from_outside_writes_checkpoint_and_exits_143_for_a_requeue(data_cache, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train_minimal.py"), *cli_args(data_cache, out, max_steps=100000, eval_interval=100000)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(read_metrics(out)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]  # 128 + SIGTERM: a scheduler requeues the job
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1)) and ckpt.read_meta(out)["step"] == steps[-1] >= 3


@pytest.mark.slow  # torch.compile tracing takes ~25 s even for this model; bf16 matmuls are slow on CPU
def test_bf16_and_compile_smoke(tiny_configs):
    # On CPU the inductor backend spends minutes in C++ codegen; aot_eager still runs dynamo's capture of the
    # whole model (joint attention's autograd.Function included) and AOT autograd, which is what can break.
    mcfg, tcfg = tiny_configs(max_steps=3, eval_interval=3, dtype="bfloat16", compile=True, compile_backend="aot_eager")
    res = train(mcfg, tcfg)
    losses = [r["loss"] for r in res["history"] if "loss" in r]
    assert len(losses) == 3 and all(abs(x - 6.24) < 0.5 for x in losses)  # near ln(512) at init, finite
    assert res["val_loss"] is not None and torch.isfinite(torch.tensor(res["val_loss"]))
    torch._dynamo.reset()
