"""A run folder changes state only by atomic steps, and every byte a resume depends on is verified: the metrics history
travels in each checkpoint (manifest-checked) and comes back on --resume, a fresh start leaves the old run resumable,
and a copy that followed the `latest` link still resumes and saves."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from test_faults import _rows, _straight_and_stopped

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.metrics import NonFiniteLossError
from minimal_asymloop.runfolder import RunFolderError
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
