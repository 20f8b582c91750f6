"""Metrics: every logged figure goes to out_dir/metrics.jsonl (and to Weights & Biases when asked), and the
plots drawn from it after a run (loss.png, srank.png). Plots are bare matplotlib Figures: no pyplot state.
The training steps' rows are made here too (log_steps): each queued step's stats read from the device at once, a
non-finite step stopped or skipped, an fp16 overflow counted."""

import errno
import json
import math
import os
import time
from pathlib import Path

import torch

from minimal_asymloop.flops import train_flops_per_token
from minimal_asymloop.runfolder import RunFolderError, after_write_failure, why_and_fix
from minimal_asymloop.system import rank_and_world


def perplexity(loss: float) -> float:
    """exp(loss), inf past float range (a diverged run's loss above ~709 nats would overflow math.exp)."""
    return math.exp(loss) if loss < 700 else math.inf


def log_metrics(out_dir, row: dict, wandb_run=None):
    """Append one JSON object to out_dir/metrics.jsonl (rank 0 only), and the same row to wandb_run if given.
    Every logged figure goes through here."""
    if rank_and_world()[0] != 0:
        return
    append_line(Path(out_dir) / "metrics.jsonl", json.dumps(row) + "\n")
    if wandb_run is not None:
        wandb_run.log(row)  # as nanoGPT does: wandb's own step counter; plot against the row's "step"


def append_line(path: Path, line: str):
    """Append `line` whole or not at all: one write to an O_APPEND file; a write cut short (a full disk) is truncated
    away, and the error is one line saying what is intact and what to do."""
    data = line.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise _append_failure(path, e) from None
    try:
        start, done = os.fstat(fd).st_size, 0
        try:
            while done < len(data):
                n = os.write(fd, data[done:])
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as e:
            if os.fstat(fd).st_size != start:  # never leave a partial line (truncating frees space: it works on a full disk)
                os.ftruncate(fd, start)
            raise _append_failure(path, e) from None
    finally:
        os.close(fd)


def _append_failure(path: Path, e: OSError) -> RunFolderError:
    why, fix = why_and_fix(e)
    return RunFolderError(f"could not append to {path}: {why}; {after_write_failure(path.parent, fix)}")


def read_metrics(out_dir, on_partial=None) -> list[dict]:
    """The rows of out_dir/metrics.jsonl. A last line cut short (a write interrupted by a crash or a full disk) is
    dropped, and `on_partial(text)` called with it; a bad line elsewhere is an error naming it."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append(row)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the last write did not finish
                if on_partial is not None:
                    on_partial(line)
                break
            raise RunFolderError(f"{path} line {i + 1} is not JSON ({line[:60]!r}); remove that line to use the file") from None
        if not isinstance(row, dict) or type(row.get("step", 0)) is not int:
            raise RunFolderError(f"{path} line {i + 1} is not a metrics row, a JSON object with an integer step ({line[:60]!r}); "
                                 f"remove that line to use the file")
    return rows


def trim_metrics(out_dir, last_step: int, say=print):
    """On resume: drop rows logged after the checkpoint (they will be recomputed) and a partial last line (said in one
    line), atomically."""
    notes = []
    rows = [r for r in read_metrics(out_dir, notes.append) if r.get("step", 0) <= last_step]
    if notes:
        say(f"note: {Path(out_dir) / 'metrics.jsonl'} ended in a partial line ({len(notes[0])} characters, from a write that did not "
            f"finish); dropped it")
    tmp = Path(out_dir) / "metrics.jsonl.tmp"
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, Path(out_dir) / "metrics.jsonl")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _append_failure(Path(out_dir) / "metrics.jsonl", e) from None


def restore_metrics(out_dir, copy: Path, last_step: int, say=print):
    """On resume: make out_dir/metrics.jsonl the checkpoint's own copy of it (verified by its manifest), which holds every
    row up to the checkpoint. A file that was deleted, emptied (a fresh start that never reached a checkpoint), edited or
    damaged is restored from the copy, said in one line; rows logged after the checkpoint are dropped (they will be
    recomputed). A checkpoint without a copy (fine-tuning's older saves): trim_metrics."""
    path = Path(out_dir) / "metrics.jsonl"
    if not copy.exists():
        return trim_metrics(out_dir, last_step, say)
    saved = copy.read_bytes()
    try:
        now = path.read_bytes()
    except FileNotFoundError:
        now = None
    if now is not None and now.startswith(saved):
        rest = now[len(saved):]
        if rest and not rest.endswith(b"\n"):
            partial = rest.rsplit(b"\n", 1)[-1]
            say(f"note: {path} ended in a partial line ({len(partial.decode(errors='replace'))} characters, from a write that did not "
                f"finish); dropped it")
    else:
        why = ("is missing" if now is None else "is empty" if not now.strip() else
               "differs from the checkpoint's copy (edited, damaged, or restarted by a fresh run that never reached a checkpoint)")
        n = saved.count(b"\n")
        say(f"note: {path} {why}; restored its {n} rows up to step {last_step} from the checkpoint's copy")
    tmp = path.with_name("metrics.jsonl.tmp")
    try:
        tmp.write_bytes(saved)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _append_failure(path, e) from None


def save_figure(fig, path: Path):
    """fig as a PNG at path; a failed write is one line with the path (the figures come after the run's last checkpoint)."""
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as e:
        why, fix = why_and_fix(e)
        raise RunFolderError(f"could not write {path}: {why}; the run itself is complete (its checkpoints and metrics.jsonl are "
                             f"intact); {fix}") from None


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
    save_figure(fig, path)
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
    save_figure(fig, path)
    return path


# ----------------------------------------------------------------------------- the training steps' rows


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became inf/NaN; the run stopped before applying that update."""


def log_steps(run) -> bool:
    """Read the queued steps' stats from the device (the one host sync of a logging interval) and log a row for each:
    a non-finite step stops the run or is counted as skipped here (skip_or_stop). Returns whether some rank asked to stop."""
    cfg, tokens_per_step = run.cfg, run.cfg.global_batch * run.cfg.seq_len
    values = torch.stack([stats for _, _, stats, _, _ in run.pending]).tolist()
    dt = (time.time() - run.t_log) / len(run.pending)  # step time: the interval's mean
    if run.peak_flops:  # MFU from the interval's mean training FLOPs, over the K its steps drew (depth.py)
        ks = [e["n_iter"] for *_, e, _ in run.pending]
        flops = train_flops_per_token(run.model_cfg, cfg.seq_len, {k: ks.count(k) / len(ks) for k in set(ks)}, cfg.backprop_depth)
    stop = False
    for (step, lr, _, extra, scale), (loss_val, gn, stop_flag, *aux) in zip(run.pending, values):  # aux: MoE aux losses, entropies
        stop = stop or stop_flag > 0
        if math.isfinite(loss_val) and math.isfinite(gn):
            run.skipped_in_row = 0
        elif math.isfinite(loss_val) and scale is not None and scale >= 1:
            overflow_skip(run, step, scale)  # fp16 gradients overflowed at this scale: skipped, the scaler lowered it (ours: scale >= 1)
        else:
            skip_or_stop(run, step, loss_val, gn)  # its update was not applied (the LR schedule and data order moved on)
        row = dict(step=step + 1, tokens=(step + 1) * tokens_per_step, loss=loss_val, lr=lr, grad_norm=gn, tok_per_s=tokens_per_step / dt,
                   step_s=dt)
        row.update(zip(run.stat_names, aux))
        if run.skipped:
            row["nonfinite_skipped"] = run.skipped
        if scale is not None:
            row.update(loss_scale=scale, overflow_skipped=run.overflow_skipped)
        if run.peak_flops:
            row["mfu"] = flops * tokens_per_step / dt / (run.peak_flops * run.world)
        row.update(extra or {})
        log_metrics(run.out_dir, row, run.wandb)
    run.bar.update(len(run.pending))
    run.bar.set_postfix(loss=f"{values[-1][0]:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
    run.pending = []
    return stop


def overflow_skip(run, step: int, scale: float):
    """fp16: the gradients overflowed at this loss scale. The scaler skipped the update and halved the scale; counted and
    said, apart from --skip-nonfinite's count. Below scale 1 an overflow is the gradient's own: skip_or_stop handles it."""
    run.overflow_skipped += 1
    run.say(f"step {step + 1}: fp16 gradients overflowed at loss scale {scale:g}; step skipped, scale halved "
            f"({run.overflow_skipped} overflow steps so far)")


def last_good_checkpoint(run) -> str:
    """Which checkpoint a stopped run leaves: `latest`, unless this run has written none yet (a fresh start's `latest`, if
    any, is an older run's)."""
    if (run.saves or run.cfg.resume) and (run.out_dir / "latest").exists():
        return f"The last good checkpoint is {run.out_dir / 'latest'}"
    return "No checkpoint of this run was written yet, so there is nothing to resume"


def skip_or_stop(run, step: int, loss_val: float, gn: float):
    """A non-finite loss or gradient: stop (the default), or skip the update (--skip-nonfinite, up to max_skips in a row)."""
    what = "loss" if not math.isfinite(loss_val) else "gradient norm"
    latest = last_good_checkpoint(run)
    if not run.cfg.skip_nonfinite:
        fix = ("a first step that diverges is a setting: check --lr, --init-std, --norm-eps and --rope-theta"
               if step == 0 else "try a lower --lr or --dtype float32, or --skip-nonfinite")
        raise NonFiniteLossError(f"non-finite {what} at step {step + 1} (loss {loss_val}, grad norm {gn}); stopped before applying it. "
                                 f"{latest}; {fix}")
    run.skipped, run.skipped_in_row = run.skipped + 1, run.skipped_in_row + 1
    if run.skipped_in_row > run.cfg.max_skips:
        raise NonFiniteLossError(f"non-finite {what} at {run.skipped_in_row} steps in a row, up to step {step + 1}: the run has diverged, "
                                 f"skipping will not recover it (--max-skips {run.cfg.max_skips}). "
                                 f"{latest}; try a lower --lr or --dtype float32")
    run.say(f"step {step + 1}: non-finite loss {loss_val} / grad norm {gn}; step skipped ({run.skipped} skipped so far)")
