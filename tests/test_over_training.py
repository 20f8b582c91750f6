"""Downstream results over training (the paper's Figure 6): evaluate every kept checkpoint of a run and plot them."""

import json
import shutil

import pytest
import torch

from minimal_asymloop import evaluate
from minimal_asymloop.checkpoint import load_model, read_meta, save_checkpoint


def test_tasks_print_in_table_1_order():
    assert [col for col, _ in evaluate.PAPER_TASKS.values()] == ["OBQA", "WinoGrande", "ARC-c", "ARC-e", "HellaSwag", "SIQA", "PIQA"]


@pytest.fixture
def kept_run(tiny_checkpoint, tmp_path):
    """A run folder with three kept checkpoints (steps 10, 20, 30): the tiny run's weights, nudged differently at each step."""
    model, tok, meta = load_model(tiny_checkpoint)
    meta = {k: v for k, v in read_meta(tiny_checkpoint).items() if k != "path"}
    run = tmp_path / "run"
    run.mkdir()
    for i, step in enumerate((10, 20, 30)):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 0.2 * i)
        path = save_checkpoint(tmp_path / f"s{step}", model, {}, dict(meta, step=step), tok)
        shutil.move(str(path), run / path.name)  # save_checkpoint keeps only linked folders; a kept-every-N run keeps them all
    return run


def run_eval(*args):
    return evaluate.main(["--device", "cpu", *args])


def test_all_checkpoints_perplexity_matches_each_checkpoint_and_plots(kept_run, tmp_path, monkeypatch):
    report = run_eval("--ckpt", str(kept_run), "--all-checkpoints")
    assert [r["step"] for r in report["checkpoints"]] == [10, 20, 30]
    for r in report["checkpoints"]:  # the same number as evaluating that checkpoint alone
        one = run_eval("--ckpt", str(kept_run / f"ckpt_{r['step']:07d}"), "--out", str(tmp_path / "one.json"))
        assert r["val"] == one["val"]
    assert len({r["val"]["ce"] for r in report["checkpoints"]}) == 3
    saved = json.loads((kept_run / "downstream_k3.json").read_text())
    assert saved["checkpoints"] == report["checkpoints"] and (kept_run / "downstream_k3.png").stat().st_size > 10_000
    # a second call with the same settings reuses the JSON: nothing is evaluated again
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a, **k: pytest.fail("re-evaluated a finished checkpoint"))
    assert run_eval("--ckpt", str(kept_run), "--all-checkpoints")["checkpoints"] == report["checkpoints"]


def test_all_checkpoints_needs_kept_checkpoints(tmp_path):
    with pytest.raises(SystemExit, match=r"no checkpoint folders \(ckpt_NNNNNNN\) in .*--keep-every N"):
        run_eval("--ckpt", str(tmp_path), "--all-checkpoints")


@pytest.mark.extra  # CI runs it again after installing the extras
def test_all_checkpoints_with_an_lm_eval_task(kept_run, tmp_path):
    pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install -e ".[eval]"')
    from test_harness import direct_accuracy, write_mc_task  # the offline multiple-choice task of test_harness.py

    tasks = write_mc_task(tmp_path / "tasks")
    report = run_eval("--ckpt", str(kept_run), "--all-checkpoints", "--tasks", "tiny_mc", "--include-path", str(tasks),
                      "--batch-size", "4", "--out", str(tmp_path / "fig6.json"))
    for r in report["checkpoints"]:
        acc = direct_accuracy(kept_run / f"ckpt_{r['step']:07d}")
        assert r["tasks"]["results"]["tiny_mc"]["acc"] == pytest.approx(acc)
        assert r["tasks"]["columns"] == {"tiny_mc": pytest.approx(100 * acc)} and r["tasks"]["mean"] == pytest.approx(100 * acc)
    assert (tmp_path / "fig6.png").exists()
