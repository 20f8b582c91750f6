"""Metrics: every logged figure goes to out_dir/metrics.jsonl (and to Weights & Biases when asked), and the
plots drawn from it after a run (loss.png, srank.png). Plots are bare matplotlib Figures: no pyplot state."""

import json
import os
from pathlib import Path

from minimal_asymloop.system import rank_and_world


def log_metrics(out_dir, row: dict, wandb_run=None):
    """Append one JSON object to out_dir/metrics.jsonl (rank 0 only), and the same row to wandb_run if given.
    Every logged figure goes through here."""
    if rank_and_world()[0] != 0:
        return
    with open(Path(out_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if wandb_run is not None:
        wandb_run.log(row)  # as nanoGPT does: wandb's own step counter; plot against the row's "step"


def read_metrics(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def trim_metrics(out_dir, last_step: int):
    """On resume: drop rows logged after the checkpoint (they will be recomputed), atomically."""
    rows = [r for r in read_metrics(out_dir) if r.get("step", 0) <= last_step]
    tmp = Path(out_dir) / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, Path(out_dir) / "metrics.jsonl")


def plot_metrics(out_dir, unigram_entropy: float | None = None) -> Path:
    """Loss curve PNG (train and val cross-entropy vs step) next to metrics.jsonl."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot state, the caller's backend is left alone

    rows = read_metrics(out_dir)
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if tr:
        ax.plot(*zip(*tr), lw=0.8, alpha=0.7, label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    if unigram_entropy:
        ax.axhline(unigram_entropy, ls="--", c="gray", label=f"val unigram entropy {unigram_entropy:.2f}")
    ax.set(title=f"Loss curve: {Path(out_dir).name}", xlabel="optimizer step", ylabel="cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(out_dir) / "loss.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_stable_rank(out_dir) -> Path | None:
    """srank.png next to loss.png: the normalized stable rank of each matrix group at every evaluation (the paper's
    Figure 4), or None when no evaluation logged one."""
    from matplotlib.figure import Figure

    rows = [r for r in read_metrics(out_dir) if "val_loss" in r]
    keys = sorted({k for r in rows for k in r if k.startswith("srank ")})
    if not keys:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot(*zip(*pts), "o-", label=k.removeprefix("srank "))
    ax.set(title=f"Normalized stable rank: {Path(out_dir).name}", xlabel="optimizer step",
           ylabel=r"$\|W\|_F^2 / (\|W\|_2^2 \cdot \min(m, n))$, group mean")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(out_dir) / "srank.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
