"""Faults: kill -9 at several moments, SIGTERM/SIGINT, a full disk, NaN, a lost DDP rank, and a malicious checkpoint.

Runs that must be killed are real `train_minimal.py` processes on the conftest test model and data slice.
"""

import errno
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DATA, MODEL

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import integrity
from minimal_asymloop.trainer import NAN_ENV, NonFiniteLossError, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
KEYS = ("step", "loss", "lr", "grad_norm", "val_loss")


def _argv(data_cache, out, steps=20, *extra):
    model = [a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    return [sys.executable, str(ROOT / "train_minimal.py"), *model, "--data", DATA["data"], "--bpe-vocab", str(DATA["bpe_vocab"]),
            "--max-data-tokens", str(DATA["max_data_tokens"]), "--val-fraction", str(DATA["val_fraction"]), "--data-cache",
            str(data_cache), "--seq-len", "32", "--global-batch", "8", "--micro-batch", "4", "--max-steps", str(steps),
            "--eval-interval", "4", "--eval-batches", "2", "--device", "cpu", "--dtype", "float32", "--seed", "0", "--lr", "3e-3",
            "--out-dir", str(out), *extra]


def _start(argv, log: Path, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"),
                            env={**ENV, **(env or {})}, cwd=ROOT, **kw)


def _wait_for(cond, proc: subprocess.Popen, log: Path, timeout=240.0):
    """Poll cond() every 20 ms while proc runs; fail with its log if it exits first or time runs out (never hang)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (v := cond()):
            return v
        if proc.poll() is not None:
            pytest.fail(f"process exited ({proc.returncode}) before the awaited moment:\n{_tail(log)}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"timed out waiting:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return "".join(p.read_text()[-2000:] for p in (log.with_suffix(".out"), log.with_suffix(".err")) if p.exists())


def _finish(proc, log, timeout=240):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"did not exit within {timeout}s:\n{_tail(log)}")


def _latest_step(out: Path) -> int | None:
    try:
        return json.loads((out / "latest" / "meta.json").read_text())["step"]
    except (OSError, ValueError):
        return None


def _writing(out: Path, pid: int) -> int | None:
    """Step of a checkpoint process `pid` is writing right now (its temp folder holds the weights), else None."""
    for p in out.glob(f".tmp-ckpt_*-{pid}"):
        if (p / "model.safetensors").exists():
            return int(p.name.split("_")[1].split("-")[0].split(".")[0])
    return None


def _orphan(out: Path) -> int | None:
    """Step of a complete checkpoint folder newer than `latest` (renamed into place, link not moved yet)."""
    latest = _latest_step(out) or 0
    steps = [int(p.name[5:12]) for p in out.glob("ckpt_*") if (p / "meta.json").exists()]
    return max((s for s in steps if s > latest), default=None)


def _curve(out) -> list[dict]:
    return [{k: r[k] for k in KEYS if k in r} for r in read_metrics(out)]


@pytest.mark.slow  # seven training processes, each importing torch: ~40-90 s on a loaded 2-core box
def test_kill9_sigterm_sigint_then_resume_equals_an_uninterrupted_run(data_cache, tmp_path):
    ref_out, run = tmp_path / "ref", tmp_path / "run"
    ref = _start(_argv(data_cache, ref_out, 16, "--quiet"), tmp_path / "ref")  # the uninterrupted run, alongside
    slow = {ckpt.DELAY_ENV: "0.2"}  # each checkpoint write takes >= 1 s: its windows are hit deterministically
    resume = _argv(data_cache, run, 16, "--resume")

    # 1. kill -9 between checkpoints: the run goes on from `latest`, the steps after it are lost and redone
    log = tmp_path / "a"
    p = _start(_argv(data_cache, run, 16), log, slow)
    _wait_for(lambda: _latest_step(run), p, log)
    p.kill(), p.wait()
    k = _latest_step(run)
    assert ckpt.load_model(run)[2]["step"] == k

    # 2. kill -9 while a checkpoint is being written: `latest` still points at the previous, complete one
    log = tmp_path / "b"
    p = _start(resume, log, slow)
    s = _wait_for(lambda: _writing(run, p.pid), p, log)
    p.kill(), p.wait()
    assert s > k and _latest_step(run) == k and ckpt.load_model(run)[2]["step"] == k
    assert f"resumed from {run / f'ckpt_{k:07d}'} at step {k}" in (log.with_suffix(".out")).read_text()

    # 3. kill -9 after the new folder is renamed into place but before `latest` moves: still the previous one
    log = tmp_path / "c"
    p = _start(resume, log, slow)
    s = _wait_for(lambda: _orphan(run), p, log)
    p.kill(), p.wait()
    assert s > k and _latest_step(run) == k and ckpt.load_model(run)[2]["step"] == k

    # 4./5. SIGTERM (preemption) and SIGINT (Ctrl-C), sent while a checkpoint is being written: the write finishes,
    # the next step runs, a checkpoint of it is written and the process exits 128 + the signal (143, 130) with a message,
    # so that a scheduler requeues it
    for sig in (signal.SIGTERM, signal.SIGINT):
        log = tmp_path / sig.name
        p = _start(resume, log, slow)
        s = _wait_for(lambda pid=p.pid: _writing(run, pid), p, log)
        p.send_signal(sig)
        assert _finish(p, log) == 128 + sig, _tail(log)
        assert f"stopped by {sig.name} at step {s + 1}; checkpoint written, continue with --resume" in log.with_suffix(".out").read_text()
        assert _latest_step(run) == s + 1

    log = tmp_path / "f"
    assert _finish(_start(resume, log), log) == 0, _tail(log)
    assert _finish(ref, tmp_path / "ref") == 0, _tail(tmp_path / "ref")
    assert _latest_step(run) == 16 and not list(run.glob(".tmp-*"))  # killed writers' temp folders were cleaned up
    want, got = _curve(ref_out), _curve(run)
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(want) == 20  # 16 steps + 4 evals
    assert got == want  # identical losses, LRs, grad norms and val losses at every step, not just close


@pytest.mark.slow  # two training processes: ~15-30 s
def test_a_full_disk_at_checkpoint_time_is_one_line_and_keeps_the_previous_checkpoint(data_cache, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "first"
    assert _finish(_start(_argv(data_cache, out, 8, "--quiet", "--stop-step", "4"), log), log) == 0, _tail(log)
    assert _latest_step(out) == 4

    def small_files():  # the kernel refuses to grow any file past 20 kB (EFBIG), like a disk that fills up mid-write
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    log = tmp_path / "second"
    p = _start(_argv(data_cache, out, 8, "--quiet", "--resume"), log, preexec_fn=small_files)
    assert _finish(p, log) == 1
    err = log.with_suffix(".err").read_text()
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: could not write checkpoint ckpt_0000008 to {out}: a file size limit was hit; the previous checkpoint ckpt_0000004 "
        f"is intact; raise the limit (ulimit -f) or free space, then continue with --resume")
    assert _latest_step(out) == 4 and ckpt.load_model(out)[2]["step"] == 4 and ckpt.load_state(out)["step"] == 4
    assert not list(out.glob(".tmp-*")) and not (out / "ckpt_0000008").exists()


@pytest.mark.parametrize("code, why", [(errno.ENOSPC, "the disk is full"), (errno.EACCES, "permission denied"),
                                       (errno.EROFS, "the file system is read-only")])
def test_checkpoint_write_error_mid_write_keeps_the_previous_checkpoint(code, why, tiny_configs, monkeypatch):
    real, calls = ckpt.save_file, []

    def fail_second(tensors, path, metadata=None):  # the 2nd checkpoint dies half-way through its weights file
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\0" * 1000)
            raise OSError(code, os.strerror(code))
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", fail_second)
    mcfg, tcfg = tiny_configs(max_steps=8, eval_interval=4)
    with pytest.raises(ckpt.CheckpointError) as e:
        train(mcfg, tcfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"could not write checkpoint ckpt_0000008 to {tcfg.out_dir}: {why}; "
                                              f"the previous checkpoint ckpt_0000004 is intact")
    out = Path(tcfg.out_dir)
    assert _latest_step(out) == 4 and ckpt.load_state(out)["step"] == 4 and not list(out.glob(".tmp-*"))


def test_nan_stops_naming_the_step_or_is_skipped_and_counted(tiny_configs, monkeypatch):
    monkeypatch.setenv(NAN_ENV, "6")
    mcfg, tcfg = tiny_configs(max_steps=10, eval_interval=4)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 6 .*stopped before applying it.*--skip-nonfinite"):
        train(mcfg, tcfg)
    assert _latest_step(Path(tcfg.out_dir)) == 4
    # the stopped run resumes with --skip-nonfinite (allowed to change on resume): NaN steps 6 and 9 are skipped and counted
    monkeypatch.setenv(NAN_ENV, "6,9")
    _, again = tiny_configs(max_steps=10, eval_interval=4, resume=True, skip_nonfinite=True)
    res = train(mcfg, again)
    rows = [r for r in res["history"] if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [math.isnan(r["loss"]) for r in rows] == [False] * 5 + [True, False, False, True, False]
    assert [r.get("nonfinite_skipped", 0) for r in rows] == [0] * 5 + [1, 1, 1, 2, 2] and res["nonfinite_skipped"] == 2
    assert math.isfinite(res["val_loss"])
    state = ckpt.load_state(tcfg.out_dir)
    assert state["nonfinite_skipped"] == 2
    assert int(state["optimizer"]["state"][0]["step"]) == 8  # 10 steps, 2 updates skipped


class _Payload:
    """Unpickling this calls open(marker, "w"): code run by the loader."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _System:
    """Unpickling this calls os.system(command): the classic payload."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def rechecksum(folder: Path) -> Path:
    """Record the current checksums of a checkpoint's files in its manifest.json, as a forger (or a careless tool) would."""
    integrity.write_manifest(folder, integrity.read_manifest(folder))
    return folder


@pytest.mark.parametrize("kind", ["open", "os.system"])
def test_a_checkpoint_whose_unpickling_runs_code_is_refused(kind, tiny_checkpoint, tiny_configs, tmp_path):
    import shutil

    marker = tmp_path / "marker"
    payload = _Payload(marker) if kind == "open" else _System(f"touch {marker}")
    torch.save({"step": 1, "x": payload}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)  # the payload is live: an unsafe loader runs it
    assert marker.exists()
    marker.unlink()

    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, run, symlinks=True)
    torch.save({"step": 30, "x": payload}, run / "latest" / "state.pt")
    # swapped in without its checksum: corrupt, and never unpickled
    with pytest.raises(ckpt.CheckpointError, match=r"is corrupt: state.pt does not match the checksum in manifest.json"):
        ckpt.load_state(run)
    # with meta.json's checksum rewritten to match: refused as code, without torch's advice to load it unsafely
    rechecksum(run / "latest")
    with pytest.raises(ckpt.CheckpointError, match=r"refused to load .*state.pt: it contains pickled code or objects, which are "
                                                   r"never run") as e:
        ckpt.load_state(run)
    assert "weights_only" not in str(e.value) and "corrupt" not in str(e.value)
    mcfg, tcfg = tiny_configs(max_steps=30, eval_interval=15, out_dir=str(run), resume=True)
    with pytest.raises(ckpt.CheckpointError, match="refused to load"):
        train(mcfg, tcfg)  # the user's path: --resume; a refused file is never skipped over by the fallback
    assert ckpt.load_model(run)[2]["step"] == 30  # weights (safetensors) and meta (JSON) never unpickle anything
    assert not marker.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two 2-process DDP runs and a 5 s timeout: ~30-60 s
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_ddp_a_lost_rank_stops_the_other_with_a_clear_message(fault, data_cache, tmp_path):
    out, port, procs = tmp_path / "run", _free_port(), []
    argv = _argv(data_cache, out, 100_000, "--quiet", "--ddp-timeout-s", "5", "--eval-interval", "100000")
    try:
        for rank in (0, 1):
            env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(_start(argv, tmp_path / f"rank{rank}", env))
        _wait_for(lambda: len(read_metrics(out)) >= 3, procs[0], tmp_path / "rank0")  # both ranks are training
        procs[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.time()
        assert _finish(procs[0], tmp_path / "rank0", timeout=120) == 1
        waited = time.time() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = (tmp_path / "rank0.err").read_text()
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 0 lost contact with the other ranks at step ")
    assert f"the last checkpoint is {out / 'latest'}, continue with --resume (--ddp-timeout-s, now 5, bounds the wait)" in last
    assert ("timed out" in last) if fault == "hung" else ("timed out" in last or "connection" in last)
    assert waited < 60  # bounded by the timeout (plus a loaded machine's slack), not forever
