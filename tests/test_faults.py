"""Fault injection: one test per failure a hostile user or a failing machine caused, each ending in one clear line or
an exact resume. The random kill -9 trial runs once here; `-m fault_trials` runs many (FAULT_TRIALS, default 10).

Faults the kernel can make for real are made for real: RLIMIT_FSIZE makes a write stop half-way (EFBIG), a folder
where a file should be is EISDIR. A full disk (ENOSPC) and, as root, a permission denial are raised by monkeypatching
the writes and reads they would fail.
"""

import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from test_bad_input import _edit_meta, _edit_text, _nan_weights, flip_tensor_bytes
from test_reliability import ROOT, _argv, _curve, _finish, _start, _tail, _wait_for

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import finetune, integrity, metrics
from minimal_asymloop.runfolder import RunFolderError, hold
from minimal_asymloop.trainer import read_metrics, train

KEYS = ("step", "loss", "lr", "grad_norm", "val_loss")


def _rows(out) -> list[dict]:
    return [{k: r[k] for k in KEYS if k in r} for r in read_metrics(out)]


def _straight_and_stopped(tiny_configs, tmp_path, steps=12, stop=8, **kw):
    """(model cfg, straight run's config, a config stopped at `stop`): the straight one run to the end."""
    mcfg, ref = tiny_configs(max_steps=steps, eval_interval=4, out_dir=str(tmp_path / "ref"), **kw)
    train(mcfg, ref)
    _, half = tiny_configs(max_steps=steps, eval_interval=4, out_dir=str(tmp_path / "run"), stop_step=stop, **kw)
    train(mcfg, half)
    return mcfg, ref, half


# ----------------------------------------------------------------------------- 1. integrity: checksums and the fallback


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.parent


DAMAGE = {
    "flipped weight bytes": (flip_tensor_bytes, "model.safetensors does not match the checksum in manifest.json"),
    "truncated weights": (lambda f: _truncate(f / "model.safetensors"), "model.safetensors does not match the checksum"),
    "truncated state": (lambda f: _truncate(f / "state.pt"), "state.pt does not match the checksum in manifest.json"),
    "NaN weights, checksum rewritten": (_nan_weights, "its weights hold inf/NaN values"),
    "meta.json field of the wrong type, checksum rewritten": (lambda f: _edit_meta(f, model_config="x"),
                                                              "field 'model_config' should be a JSON object"),
    # one character of meta.json: K=3 -> 2 would load another model; the manifest catches it and the resume falls back
    "meta.json n_iter 3 -> 2": (lambda f: _edit_text(f / "meta.json", '"n_iter": 3', '"n_iter": 2'),
                                "meta.json does not match the checksum in manifest.json"),
    "meta.json global_batch 0": (lambda f: _edit_text(f / "meta.json", '"global_batch": 8', '"global_batch": 0'),
                                 "meta.json does not match the checksum in manifest.json"),
    "manifest.json damaged": (lambda f: (f / "manifest.json").write_text("{") and f, "manifest.json is not a valid manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_corrupt_latest_falls_back_to_the_newest_intact_kept_checkpoint_and_resumes_exactly(damage, tiny_configs, tmp_path, capsys):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path, keep_every=4)
    out = Path(half.out_dir)
    assert sorted(p.name for p in out.glob("ckpt_*")) == ["ckpt_0000004", "ckpt_0000008"]
    hurt, why = DAMAGE[damage]
    hurt(out / "ckpt_0000008")
    capsys.readouterr()
    res = train(mcfg, replace(half, stop_step=None, resume=True, quiet=False))
    said = capsys.readouterr().out
    note = next(line for line in said.splitlines() if line.startswith("note: "))
    assert note.startswith(f"note: checkpoint {out / 'ckpt_0000008'} is corrupt") and why in note
    assert note.endswith("; resuming from ckpt_0000004 (step 4), the newest intact checkpoint")
    assert f"resumed from {out / 'ckpt_0000004'} at step 4" in said
    assert res["step"] == 12 and _rows(out) == _rows(ref.out_dir)  # the same numbers as a run that never broke
    # the step-8 save of the resumed run replaced the corrupt one
    assert sorted(p.name for p in out.glob("ckpt_*")) == ["ckpt_0000004", "ckpt_0000008.1", "ckpt_0000012"]
    assert ckpt.load_model(out / "ckpt_0000008.1")[2]["step"] == 8


def test_with_no_intact_checkpoint_resume_stops_in_one_line_naming_the_file(tiny_configs, tmp_path):
    mcfg, tcfg = tiny_configs(max_steps=8, eval_interval=4, stop_step=4)
    train(mcfg, tcfg)
    out = Path(tcfg.out_dir)
    flip_tensor_bytes(out / "ckpt_0000004")
    with pytest.raises(ckpt.CheckpointError) as e:
        train(mcfg, replace(tcfg, stop_step=None, resume=True))
    assert str(e.value) == (f"checkpoint {out / 'ckpt_0000004'} is corrupt: model.safetensors does not match the checksum in manifest.json "
                            f"(its bytes changed after it was written: a disk, copy or transfer error); no intact checkpoint to fall "
                            f"back on in {out} (1 checked: ckpt_0000004)")


def test_every_file_of_a_checkpoint_has_its_checksum_and_a_change_of_one_byte_is_caught(tiny_checkpoint, tmp_path):
    import shutil

    files = integrity.read_manifest(ckpt.find_checkpoint(tiny_checkpoint))
    assert set(files) == {"model.safetensors", "state.pt", "tokenizer.json", "meta.json", "metrics.jsonl"}
    for name in files:
        folder = shutil.copytree(ckpt.find_checkpoint(tiny_checkpoint), tmp_path / name)
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 1  # one bit
        (folder / name).write_bytes(bytes(data))
        with pytest.raises(ckpt.CheckpointError, match=f"is corrupt: {name} does not match the checksum"):
            ckpt.verify(folder, None, [name])


# ----------------------------------------------------------------------------- 2. one run per folder


def test_a_second_run_into_a_held_folder_refuses_at_once_naming_the_holder(tiny_configs, capsys):
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=4, data="/nonexistent/data")  # refused before the data is looked at
    with hold(tcfg.out_dir, "pretraining"):
        with pytest.raises(RunFolderError) as e:
            train(mcfg, tcfg)
    assert str(e.value) == (f"--out-dir {tcfg.out_dir} is in use by another run (pid {os.getpid()}); wait for it to finish or stop it "
                            f"(kill {os.getpid()}), or choose another --out-dir")


def test_the_lock_is_released_on_an_exception_and_a_killed_holder_never_blocks(tiny_configs, tmp_path):
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=4, data="/nonexistent/data")
    with pytest.raises(Exception, match="no data files found"):
        train(mcfg, tcfg)  # fails after taking the lock
    with hold(tcfg.out_dir, "pretraining"):  # released
        pass
    # a holder killed with SIGKILL: its lock file stays, naming its pid, but the OS has dropped the lock
    out = tmp_path / "killed"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from minimal_asymloop.runfolder import hold\n"
                               f"with hold({str(out)!r}, 'pretraining'):\n    print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            with hold(out, "pretraining"):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
    assert json.loads((out / ".lock").read_text())["pid"] == holder.pid  # stale
    _, again = tiny_configs(max_steps=4, eval_interval=4, out_dir=str(out))
    assert train(mcfg, again)["step"] == 4


@pytest.mark.slow  # two training processes at once: ~10-20 s
def test_two_runs_started_at_once_into_one_folder_one_refuses_and_the_metrics_are_one_runs(data_cache, tmp_path):
    out = tmp_path / "run"
    procs = [_start(_argv(data_cache, out, 12, "--quiet", "--seed", str(seed)), tmp_path / f"s{seed}") for seed in (1337, 7)]
    codes = [_finish(p, tmp_path / f"s{seed}") for p, seed in zip(procs, (1337, 7))]
    assert sorted(codes) == [0, 1], [_tail(tmp_path / f"s{s}") for s in (1337, 7)]
    loser = procs[codes.index(1)]
    line = (tmp_path / f"s{(1337, 7)[codes.index(1)]}.err").read_text().strip().splitlines()[-1]
    winner = procs[codes.index(0)]
    assert line.startswith(f"error: --out-dir {out} is in use by another run (pid {winner.pid})"), line
    assert loser.pid != winner.pid
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, 13))  # one run's rows, no duplicates


def test_finetune_refuses_a_pretraining_folder_and_leaves_it_intact(tiny_checkpoint, tmp_path):
    import shutil

    from test_bad_input import _ft_argv

    run = shutil.copytree(tiny_checkpoint, tmp_path / "run", symlinks=True)
    before = (run / "metrics.jsonl").read_text(), os.readlink(run / "latest")
    with pytest.raises(SystemExit) as e:
        finetune.main(_ft_argv(tmp_path, tiny_checkpoint, run))
    assert e.value.code == (f"error: --out-dir {run} holds a pretraining run; fine-tuning there would overwrite its metrics.jsonl and "
                            f"checkpoints; fine-tune into a new --out-dir")
    assert ((run / "metrics.jsonl").read_text(), os.readlink(run / "latest")) == before
    assert ckpt.newest_intact(run)[1]["step"] == 30  # still resumable


# ----------------------------------------------------------------------------- 3. metrics that survive faults


@contextmanager
def _file_size_limit(limit: int):
    """The kernel refuses to grow any file of this process past `limit` bytes (EFBIG; Python ignores SIGXFSZ)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


def _all_lines_whole(path: Path) -> bool:
    text = path.read_text()
    return text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


def test_a_metrics_append_cut_short_by_the_kernel_leaves_no_partial_line(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=40, eval_interval=100)  # no checkpoint before metrics.jsonl passes 1.5 kB
    with _file_size_limit(1500), pytest.raises(RunFolderError) as e:
        train(mcfg, tcfg)
    path = Path(tcfg.out_dir) / "metrics.jsonl"
    assert str(e.value) == (f"could not append to {path}: a file size limit was hit; no earlier checkpoint exists, so there is nothing "
                            f"to resume; raise the limit (ulimit -f) or free space, then start the run again")
    assert 1000 < path.stat().st_size <= 1500 and _all_lines_whole(path)


def test_a_full_disk_while_logging_is_one_line_like_a_full_disk_while_checkpointing(tiny_configs, data_cache, tmp_path, monkeypatch):
    from test_bad_input import _train_argv

    out = tmp_path / "run"
    train_minimal.main(_train_argv(data_cache, out, "--max-steps", "8", "--eval-interval", "4", "--stop-step", "4"))
    real, calls = os.write, []

    def half_then_full(fd, data):  # the disk fills half-way through the 2nd row after the resume
        calls.append(len(data) if data.startswith(b'{"step"') else 0)
        if sum(map(bool, calls)) == 2 and calls[-1]:
            real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(metrics.os, "write", half_then_full)
    with pytest.raises(SystemExit) as e:
        train_minimal.main(_train_argv(data_cache, out, "--max-steps", "8", "--eval-interval", "4", "--resume"))
    assert e.value.code == (f"error: could not append to {out / 'metrics.jsonl'}: the disk is full; the previous checkpoint ckpt_0000004 "
                            f"is intact; free disk space, then continue with --resume")
    assert _all_lines_whole(out / "metrics.jsonl")


def test_resume_drops_a_trailing_partial_metrics_line_with_a_note_and_is_exact(tiny_configs, tmp_path, capsys):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path)
    path = Path(half.out_dir) / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 9, "tokens": 2304, "lo')  # what a write cut short leaves
    capsys.readouterr()
    train(mcfg, replace(half, stop_step=None, resume=True, quiet=False))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {path} ended in a partial line (31 characters, from a write that did not finish); dropped it"]
    assert _rows(half.out_dir) == _rows(ref.out_dir)


def test_a_bad_metrics_line_in_the_middle_is_one_line_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(RunFolderError, match=r"metrics.jsonl line 2 is not JSON \('\{\"st'\); remove that line to use the file"):
        read_metrics(tmp_path)


# ----------------------------------------------------------------------------- checkpoint writes that fail


def test_a_state_write_cut_short_by_the_kernel_says_so_not_torchs_internals(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=4)
    with _file_size_limit(350_000), pytest.raises(ckpt.CheckpointError) as e:  # the weights (225 kB) fit, state.pt (477 kB) not
        train(mcfg, tcfg)
    assert str(e.value) == (f"could not write checkpoint ckpt_0000004 to {tcfg.out_dir}: a file size limit was hit; no earlier "
                            f"checkpoint exists, so there is nothing to resume; raise the limit (ulimit -f) or free space, then "
                            f"start the run again")


def test_a_full_disk_in_the_middle_of_state_pt_says_the_disk_is_full_and_the_resume_is_exact(tiny_configs, tmp_path, monkeypatch):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path, stop=4)
    real_open = open

    class FillsUp:  # the file system runs out of space after 100 kB of state.pt
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(ckpt, "open", lambda p, mode="r": FillsUp(real_open(p, mode)), raising=False)
    with pytest.raises(ckpt.CheckpointError) as e:
        train(mcfg, replace(half, stop_step=None, resume=True))
    assert str(e.value) == (f"could not write checkpoint ckpt_0000008 to {half.out_dir}: the disk is full; the previous checkpoint "
                            f"ckpt_0000004 is intact; free disk space, then continue with --resume")
    monkeypatch.undo()  # space freed
    train(mcfg, replace(half, stop_step=None, resume=True))
    assert _rows(half.out_dir) == _rows(ref.out_dir)


def test_a_failed_first_checkpoint_does_not_promise_a_resume(tiny_configs, monkeypatch):
    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full)
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=4)
    with pytest.raises(ckpt.CheckpointError, match="no earlier checkpoint exists, so there is nothing to resume; free disk space, "
                                                   "then start the run again$"):
        train(mcfg, tcfg)


# ----------------------------------------------------------------------------- unreadable files


@contextmanager
def _denied(target: Path, monkeypatch):
    """Reading `target` (a file, or anything under a folder) raises EACCES, as a chmod 000 does for a non-root user."""
    import builtins
    import pathlib

    def check(p):
        p = Path(p)
        if p == target or target in p.parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))

    real_open, real_stat, real_read = builtins.open, pathlib.Path.stat, pathlib.Path.read_text
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: (check(p), real_open(p, *a, **k))[1])
    monkeypatch.setattr(pathlib.Path, "stat", lambda self, **k: (check(self) if target in self.parents else None, real_stat(self, **k))[1])
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: (check(self), real_read(self, *a, **k))[1])
    yield
    monkeypatch.undo()


@pytest.mark.parametrize("what", ["folder", "meta.json", "model.safetensors", "state.pt"])
def test_an_unreadable_checkpoint_is_one_line_with_the_right_cause(what, tiny_checkpoint, monkeypatch):
    folder = ckpt.find_checkpoint(tiny_checkpoint)
    target = folder if what == "folder" else folder / what
    with _denied(target, monkeypatch):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load_model(folder) if what != "state.pt" else ckpt.load_state(folder)
    msg = str(e.value)
    assert msg.startswith(f"cannot read checkpoint file {target if what != 'folder' else folder / 'meta.json'}: permission denied; "
                          f"fix the permissions (chmod/chown) or choose another path"), msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: the monkeypatched test above covers it")
def test_an_unreadable_checkpoint_file_for_real(tiny_checkpoint, tmp_path):
    import shutil

    folder = shutil.copytree(ckpt.find_checkpoint(tiny_checkpoint), tmp_path / "k")
    (folder / "model.safetensors").chmod(0)
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors: permission denied"):
        ckpt.load_model(folder)


# ----------------------------------------------------------------------------- --micro-batch on resume


def test_resuming_with_another_micro_batch_continues_the_run_to_float_rounding(tiny_configs, tmp_path):
    """The promise (docs/reliability.md): the same data, schedule and steps; losses equal to float rounding, since a
    micro-batch of another size sums the batch's gradients in another order. The same --micro-batch is exact."""
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path, steps=16, micro_batch=4)
    train(mcfg, replace(half, stop_step=None, resume=True, micro_batch=2))
    want, got = _rows(ref.out_dir), _rows(half.out_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] and [r.get("lr") for r in got] == [r.get("lr") for r in want]
    assert got[:10] == want[:10]  # up to the checkpoint (8 steps and 2 evals): the same run
    rel = max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want) for k in ("loss", "grad_norm", "val_loss") if k in w)
    assert 0 < rel < 1e-4, rel  # not bit-exact, and far below any difference a change of setting makes


# ----------------------------------------------------------------------------- random kill -9 trials


def _kill_at_random(argv, log: Path, out: Path, rng: random.Random, slow: dict) -> bool:
    """Start a run, wait until it trains, kill -9 at a random moment within 3 s; True if a checkpoint write was under way."""
    t0 = time.time()
    p = _start(argv, log, slow)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_mtime > t0, p, log)  # it trains
    time.sleep(rng.uniform(0.0, 3.0))
    writing = bool(list(out.glob(f".tmp-ckpt_*-{p.pid}")))
    p.kill()
    p.wait()
    return writing


def _kill_trial(data_cache, tmp_path: Path, seed: int, kills: int) -> dict:
    rng, out = random.Random(seed), tmp_path / f"trial{seed}"
    slow = {ckpt.DELAY_ENV: "0.2"}  # each checkpoint write takes >= 1 s: a fair share of kills land in one
    argv, writing = _argv(data_cache, out, 16), 0
    for i in range(kills):  # killed before its first checkpoint, a run starts again from scratch
        resume = ["--resume"] if (out / "latest").exists() else []
        writing += _kill_at_random(argv + resume, tmp_path / f"t{seed}-{i}", out, rng, slow)
    train_minimal.main(argv[2:] + ["--quiet"] + (["--resume"] if (out / "latest").exists() else []))  # finish in-process
    return dict(curve=_curve(out), writing=writing)


@pytest.fixture(scope="module")
def straight_curve(data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    train_minimal.main(_argv(data_cache, out, 16)[2:] + ["--quiet"])
    return _curve(out)


def test_a_random_kill9_then_resume_equals_a_straight_run(data_cache, tmp_path, straight_curve):
    got = _kill_trial(data_cache, tmp_path, seed=0, kills=1)
    assert len(straight_curve) == 20 and got["curve"] == straight_curve  # every loss, LR, grad norm, val loss: equal


@pytest.mark.fault_trials
def test_many_random_kill9_trials_each_resume_equals_a_straight_run(data_cache, tmp_path, straight_curve):
    n = int(os.environ.get("FAULT_TRIALS", "10"))
    writing = 0
    for seed in range(1, n + 1):
        got = _kill_trial(data_cache, tmp_path, seed, kills=3)
        assert got["curve"] == straight_curve, f"trial {seed}"
        writing += got["writing"]
    print(f"\n{n} trials, {3 * n} kill -9s ({writing} during a checkpoint write): every resume equal to the straight run")
