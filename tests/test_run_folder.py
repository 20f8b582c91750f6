"""A run folder changes state only by atomic steps, and every byte a resume depends on is verified: the metrics history
travels in each checkpoint (manifest-checked) and comes back on --resume, a fresh start leaves the old run resumable,
and a copy that followed the `latest` link still resumes and saves."""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from test_bad_input import _train_argv
from test_faults import _rows, _straight_and_stopped

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import evaluate, integrity, trainer
from minimal_asymloop.config import ConfigError
from minimal_asymloop.metrics import NonFiniteLossError
from minimal_asymloop.runfolder import RunFolderError
from minimal_asymloop.sources import DataError
from minimal_asymloop.trainer import NAN_ENV, read_metrics, train

HISTORY_DAMAGE = {
    "deleted": lambda p: p.unlink(),
    "emptied": lambda p: p.write_text(""),
    "a null row": lambda p: p.write_text(p.read_text().replace("\n", "\nnull\n", 1)),
    "a number row": lambda p: p.write_text("5\n" + p.read_text()),
    "a string step": lambda p: p.write_text(p.read_text().replace('{"step": 3,', '{"step": "3",', 1)),
}


@pytest.mark.parametrize("damage", list(HISTORY_DAMAGE))
def test_resume_restores_a_deleted_emptied_or_damaged_history_from_the_checkpoint(damage, tiny_configs, tmp_path, capsys):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path)
    path = Path(half.out_dir) / "metrics.jsonl"
    HISTORY_DAMAGE[damage](path)
    capsys.readouterr()
    train(mcfg, replace(half, stop_step=None, resume=True, quiet=False))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(f"note: {path} ") and notes[0].endswith(
        "restored its 10 rows up to step 8 from the checkpoint's copy"), notes  # 8 step rows and 2 evaluation rows
    assert _rows(half.out_dir) == _rows(ref.out_dir)  # every row of the run that never broke, none lost


@pytest.mark.parametrize("row", ["null", "5", '"x"', '[1, 2]', '{"step": "5"}'])
def test_a_metrics_row_that_is_json_but_not_a_row_is_one_line_naming_it(row, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + row + '\n{"step": 2}\n')
    with pytest.raises(RunFolderError, match=r"metrics.jsonl line 2 is not a metrics row, a JSON object with an integer step"):
        read_metrics(tmp_path)


def test_a_fresh_start_that_never_reaches_a_checkpoint_leaves_the_old_run_resumable(tiny_configs, tmp_path, monkeypatch, capsys):
    """A fresh start over a finished run empties metrics.jsonl but `latest` still names the old run until the new run's
    first checkpoint: --resume then continues the old run with its whole history."""
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path)
    old = _rows(half.out_dir)
    monkeypatch.setenv(NAN_ENV, "1")  # the fresh run dies at its first step, before any checkpoint (as a kill would)
    with pytest.raises(NonFiniteLossError, match="No checkpoint of this run was written yet"):
        train(mcfg, replace(half, stop_step=None, seed=7))
    monkeypatch.delenv(NAN_ENV)
    assert ckpt.read_meta(half.out_dir)["step"] == 8  # `latest` is still the old run's
    capsys.readouterr()
    res = train(mcfg, replace(half, stop_step=None, resume=True, quiet=False))
    assert "restored its 10 rows up to step 8 from the checkpoint's copy" in capsys.readouterr().out
    assert res["step"] == 12 and _rows(half.out_dir)[:len(old)] == old and _rows(half.out_dir) == _rows(ref.out_dir)


def test_a_run_folder_copied_with_its_links_followed_resumes_and_saves(tiny_configs, tmp_path, capsys):
    """cp -rL / scp -r turn `latest` and `best` into folders: the resume reads the copy, and its first save puts links
    back, so later runs and `sample` read the newest checkpoint, not the stale copy."""
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path)
    copy = shutil.copytree(half.out_dir, tmp_path / "copy", symlinks=False)  # links followed
    assert (copy / "latest").is_dir() and not (copy / "latest").is_symlink()
    res = train(mcfg, replace(half, out_dir=str(copy), stop_step=None, resume=True))
    assert res["step"] == 12 and _rows(copy) == _rows(ref.out_dir)
    assert (copy / "latest").is_symlink() and (copy / "latest").resolve().name == "ckpt_0000012"
    assert ckpt.load_model(copy)[2]["step"] == 12


def test_the_checkpoint_holds_the_history_up_to_its_step(tiny_checkpoint):
    folder = ckpt.find_checkpoint(tiny_checkpoint)
    rows = [json.loads(line) for line in (folder / ckpt.METRICS).read_text().splitlines()]
    assert rows == read_metrics(tiny_checkpoint) and rows[-1]["step"] == 30


def test_resume_with_a_changed_data_option_is_refused_before_any_data_preparation(tiny_configs, tmp_path):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path, steps=8, stop=4)
    cache = tmp_path / "new_cache"  # the refusal must come before anything is prepared here
    with pytest.raises(ConfigError, match=r"the config differs from the checkpoint's \(val_fraction: 0.2 -> 0.3"):
        train(mcfg, replace(half, stop_step=None, resume=True, val_fraction=0.3, data_cache=str(cache)))
    assert not cache.exists() or not any(cache.iterdir())


def test_evaluate_all_checkpoints_takes_the_newest_resave_and_refuses_a_damaged_meta_in_one_line(tiny_configs, tmp_path, capsys):
    mcfg, ref, half = _straight_and_stopped(tiny_configs, tmp_path, keep_every=4)
    out = Path(half.out_dir)
    shutil.copytree(out / "ckpt_0000008", out / "ckpt_0000008.1")  # the re-save of step 8 after a fallback
    assert [p.name for p in evaluate.kept_checkpoints(out)] == ["ckpt_0000004", "ckpt_0000008.1"]
    (out / "ckpt_0000004" / "meta.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--ckpt", str(out), "--all-checkpoints", "--device", "cpu"])
    assert str(e.value.code).startswith(f"error: checkpoint {out / 'ckpt_0000004'} is corrupt: meta.json does not match the checksum")
    assert "Traceback" not in capsys.readouterr().err


def test_a_validation_loss_past_exps_range_is_logged_with_an_infinite_perplexity(tiny_configs, monkeypatch):
    """--beta2 0 (valid) can diverge to a validation loss above ~709 nats, where math.exp overflows: the run must still
    log it and write its checkpoint."""
    monkeypatch.setattr(trainer, "evaluate_loss", lambda *a, **k: 800.0)
    mcfg, tcfg = tiny_configs(max_steps=2, eval_interval=2, beta2=0.0)
    res = train(mcfg, tcfg)
    assert res["val_loss"] == 800.0 and read_metrics(tcfg.out_dir)[-1]["val_ppl"] == math.inf
    assert ckpt.read_meta(tcfg.out_dir)["val_loss"] == 800.0


@pytest.mark.parametrize("when", ["start-up", "a second Ctrl-C at step 3"])
def test_ctrl_c_at_start_up_or_a_second_one_is_one_line_and_exit_130(when, data_cache, tmp_path, monkeypatch, capsys):
    real = trainer.optimizer_step

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if when == "start-up":
        monkeypatch.setattr(trainer, "data_for_run", interrupt)  # Ctrl-C while the data is prepared
    else:
        monkeypatch.setattr(trainer, "optimizer_step", lambda run, step, flag: interrupt() if step == 2 else real(run, step, flag))
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        train_minimal.main(_train_argv(data_cache, out, "--max-steps", "4"))
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: interrupted by Ctrl-C; " + (
        "no checkpoint was written: start the run again (a data preparation continues where it stopped)" if when == "start-up"
        else "the last checkpoint, ckpt_0000002, is intact: continue with --resume"))


# ----------------------------------------------------------------------------- the data cache, full disks, the lock


def _prepared(data_cache) -> Path:
    return next(p for p in Path(data_cache).iterdir() if (p / "meta.json").exists())


def _cache_copy(data_cache, tmp_path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(data_cache, copy)
    return copy


def _flip(path: Path, at: int, value: int | None = None):
    data = bytearray(path.read_bytes())
    data[at] = data[at] ^ 1 if value is None else value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["a train token bit", "a val token bit", "tokens >= vocab, manifest rewritten", "tokenizer.json"])
def test_a_damaged_data_cache_is_one_line_before_a_step(damage, data_cache, tmp_path, capsys):
    cache = _cache_copy(data_cache, tmp_path)
    folder = _prepared(cache)
    meta = json.loads((folder / "meta.json").read_text())
    if damage == "a train token bit":
        _flip(folder / meta["train_files"][0], 1001)
        want = f"is corrupt: {meta['train_files'][0]} does not match the checksum in manifest.json"
    elif damage == "a val token bit":
        _flip(folder / meta["val_files"][0], 1001)
        want = f"is corrupt: {meta['val_files'][0]} does not match the checksum in manifest.json"
    elif damage == "tokens >= vocab, manifest rewritten":
        _flip(folder / meta["train_files"][0], 1001, 0xFF)  # the high byte of a little-endian uint16: id >= 65280
        integrity.write_manifest(folder, integrity.read_manifest(folder))
        want = "outside its tokenizer's 512 tokens (damaged shards); delete that folder to re-prepare"
    else:
        (folder / "tokenizer.json").write_text("{not json")
        want = "is corrupt: tokenizer.json does not match the checksum in manifest.json"
    with pytest.raises(SystemExit) as e:
        train_minimal.main(_train_argv(cache, tmp_path / "o"))
    assert want in str(e.value.code) and str(e.value.code).startswith("error: prepared data ")
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "o" / "metrics.jsonl").exists()


def test_a_data_cache_prepared_before_manifests_gets_one_and_says_so(data_cache, tmp_path, capsys):
    cache = _cache_copy(data_cache, tmp_path)
    (_prepared(cache) / "manifest.json").unlink()
    from minimal_asymloop.data import load_prepared

    load_prepared(_prepared(cache))
    assert "had no manifest.json (prepared before shards were checksummed); recorded the checksums" in capsys.readouterr().err
    _flip(_prepared(cache) / "tokenizer.json", 10)
    with pytest.raises(DataError, match="tokenizer.json does not match the checksum"):
        load_prepared(_prepared(cache))


def test_a_full_disk_while_preparing_data_names_the_file(tmp_path, capsys):
    from test_faults import _file_size_limit

    argv = _train_argv(tmp_path / "cache", tmp_path / "o")
    with _file_size_limit(100_000), pytest.raises(SystemExit) as e:  # the train shard (~240 kB) does not fit
        train_minimal.main(argv)
    assert str(e.value.code).startswith(f"error: cannot use {tmp_path / 'cache'}/.partial-")
    assert str(e.value.code).endswith("/train_000000.bin: a file size limit was hit; raise the limit (ulimit -f) or free space")


def test_a_full_disk_while_drawing_the_figures_names_the_file(tiny_configs, monkeypatch):
    from matplotlib.figure import Figure

    def full(self, path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    mcfg, tcfg = tiny_configs(max_steps=2, eval_interval=2)
    with pytest.raises(RunFolderError) as e:
        train(mcfg, tcfg)
    assert str(e.value) == (f"could not write {Path(tcfg.out_dir) / 'loss.png'}: the disk is full; the run itself is complete (its "
                            f"checkpoints and metrics.jsonl are intact); free disk space")


def test_a_lock_held_by_an_unrelated_process_names_that_process(tiny_configs, tmp_path):
    import subprocess
    import sys
    import time

    mcfg, tcfg = tiny_configs(max_steps=2)
    out = Path(tcfg.out_dir)
    out.mkdir(parents=True)
    (out / ".lock").write_text(json.dumps(dict(pid=999999, kind="pretraining")) + "\n")  # a stale pid in the file
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(out / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        with pytest.raises(RunFolderError, match=rf"is in use by another run \(pid {holder.pid}\); .*\(kill {holder.pid}\)"):
            train(mcfg, tcfg)
        assert time.time() - t0 < 30
    finally:
        holder.kill()
        holder.wait()


def test_a_format_1_checkpoint_is_refused_until_the_integrity_command_gives_it_a_manifest(tiny_checkpoint, tmp_path, capsys):
    run = shutil.copytree(tiny_checkpoint, tmp_path / "run", symlinks=True)
    for folder in run.glob("ckpt_*"):  # as the code before manifests saved it: meta.json holding the others' sums
        (folder / "manifest.json").unlink()
        (folder / "metrics.jsonl").unlink()
        meta = json.loads((folder / "meta.json").read_text())
        names = ("model.safetensors", "state.pt", "tokenizer.json")
        (folder / "meta.json").write_text(json.dumps({**meta, "format_version": 1,
                                                      "checksums": {n: integrity.file_checksum(folder / n) for n in names}}))
    with pytest.raises(ckpt.CheckpointError, match=r"has no manifest.json: it was saved before meta.json was checksummed"):
        ckpt.load_model(run)
    integrity.main([str(tmp_path)])  # every checkpoint under a folder of runs
    assert "wrote " in capsys.readouterr().out
    assert ckpt.load_model(run)[2]["step"] == 30
    with pytest.raises(SystemExit, match="no checkpoint without a manifest.json"):
        integrity.main([str(tmp_path)])
