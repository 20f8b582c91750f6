"""Evaluation without optional extras: held-out perplexity through the evaluate command.

All offline, on conftest's `tiny_checkpoint` (a 30-step run on a slice of the stdlib corpus). The
lm-eval adapter and the task path are in test_harness.py (the optional `eval` extra).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minimal_asymloop import evaluate
from minimal_asymloop.batches import eval_windows
from minimal_asymloop.checkpoint import load_model
from minimal_asymloop.trainer import read_metrics

# ----------------------------------------------------------------------------- on a checkpoint trained in the test


# this checkout importable; one thread, as conftest sets for this process (tiny models only lose from more)
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}


def run_eval(ckpt, tmp_path, *args):
    return evaluate.main(["--ckpt", str(ckpt), "--device", "cpu", "--out", str(tmp_path / "eval.json"), *args])


def test_perplexity_command_matches_trainers_final_val_loss(tiny_checkpoint, tmp_path, capsys):
    report = run_eval(tiny_checkpoint, tmp_path)
    final = [r["val_loss"] for r in read_metrics(tiny_checkpoint) if "val_loss" in r][-1]
    assert report["val"]["ce"] == pytest.approx(final, abs=1e-6)
    assert report["val"]["ppl"] == pytest.approx(math.exp(final), rel=1e-6)
    assert json.loads((tmp_path / "eval.json").read_text())["val"] == report["val"]
    assert f"cross-entropy {final:.4f} nats/token" in capsys.readouterr().out


def test_perplexity_matches_with_gradient_accumulation(tiny_configs, tmp_path):
    """A run with micro-batches smaller than its global batch: the command still scores the trainer's windows."""
    from minimal_asymloop.trainer import train

    mcfg, tcfg = tiny_configs(micro_batch=4, max_steps=10, eval_interval=10)
    result = train(mcfg, tcfg)
    report = run_eval(tcfg.out_dir, tmp_path)
    assert report["val"]["ce"] == pytest.approx(result["val_loss"], abs=1e-6)


def test_n_iter_evaluates_at_another_depth(tiny_checkpoint, tmp_path):
    """--n-iter 5 gives the CE of model(x, n_iter=5) on the same windows, computed here without evaluate_loss."""
    report = run_eval(tiny_checkpoint, tmp_path, "--n-iter", "5")
    model, tok, meta = load_model(tiny_checkpoint)
    val = evaluate.held_out_tokens(meta, tok, None, None)
    starts = eval_windows(val, 32, 2 * 8)
    w = torch.from_numpy(np.stack([val.window(int(s), 33) for s in starts]))
    with torch.no_grad():
        ce = sum(model(w[b:b + 8, :-1], w[b:b + 8, 1:], n_iter=5)[1].item() for b in (0, 8)) / 2
    assert report["n_iter"] == 5 and report["trained_n_iter"] == 3
    assert report["val"]["ce"] == pytest.approx(ce, abs=1e-5)
    assert abs(ce - meta["val_loss"]) > 1e-4
    with pytest.raises(SystemExit, match="K must be >= 1"):
        run_eval(tiny_checkpoint, tmp_path, "--n-iter", "0")


def test_held_out_documents_of_a_source_tokenize_like_the_prepared_split(tiny_checkpoint):
    """--data streams a source's held-out documents with the checkpoint's tokenizer; for the run's own
    source that is the prepared val split, token for token."""
    _, tok, meta = load_model(tiny_checkpoint)
    prepared = evaluate.held_out_tokens(meta, tok, None, None)
    streamed = evaluate.held_out_tokens(meta, tok, "stdlib", 3000)
    assert len(streamed) >= 3000 and len(prepared) > len(streamed)
    assert (streamed.window(0, 3000) == prepared.window(0, 3000)).all()


def test_data_option_scores_other_text(tiny_checkpoint, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    src = Path(json.__file__).parent
    for i, f in enumerate(sorted(src.glob("*.py"))):  # one document per file; by hash about 20% are held out
        (docs / f"{i}.txt").write_text(f.read_text())
    report = run_eval(tiny_checkpoint, tmp_path, "--data", str(docs), "--eval-batches", "1")
    assert report["data"] == str(docs) and report["val"]["tokens"] == 8 * 32
    assert 0 < report["val"]["ce"] < 10
    with pytest.raises(SystemExit, match="no data files found"):
        run_eval(tiny_checkpoint, tmp_path, "--data", str(tmp_path / "missing"))


def test_without_lm_eval_the_command_says_how_to_install(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(SystemExit, match=r'needs lm-eval: .*pip install -e "\.\[eval\]"'):
        run_eval(tiny_checkpoint, tmp_path, "--tasks", "paper")
    code = "import sys; sys.modules['lm_eval'] = None; import minimal_asymloop.evaluate, minimal_asymloop.model; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=SUBPROCESS_ENV)
    assert p.stdout.strip() == "ok", p.stderr


def test_paper_table_layout_and_unweighted_mean():
    res = {"piqa": {"acc": 0.60, "acc_norm": 0.62}, "social_iqa": {"acc": 0.40}, "arc_easy": {"acc": 0.50, "acc_norm": 0.44}}
    table, mean, cols = evaluate.paper_table(res, ["piqa", "siqa", "arc_easy"], "acc_norm", "asymloop K=3")
    assert cols == {"PIQA": pytest.approx(62), "SIQA†": pytest.approx(40), "ARC-e": pytest.approx(44)}
    assert table.splitlines()[0] == "| Model | PIQA | SIQA† | ARC-e | Avg. |"
    assert table.splitlines()[2] == "| asymloop K=3 | 62.00 | 40.00 | 44.00 | 48.67 |"
    assert mean == pytest.approx((62 + 40 + 44) / 3)
    assert evaluate.paper_table(res, ["piqa", "siqa"], "acc", "m")[1] == pytest.approx(50.0)
