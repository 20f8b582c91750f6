"""The data a training run reads: its prepared data for the budget (data_for_run), its batches (BatchSampler, the same
for any number of ranks), and the fixed evaluation windows with the validation loss over them (evaluate_loss)."""

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from minimal_asymloop.data import SHARD_TOKENS, Tokens, prepare
from minimal_asymloop.loss import compute_loss
from minimal_asymloop.sources import DataError, fineweb_for_budget
from minimal_asymloop.system import autocast_context, rank_and_world


def data_for_run(model_cfg, cfg, local_rank: int, quiet: bool):
    """A training run's data (cfg: a TrainConfig). Prepare it on local rank 0 (before any collective: it can outlast a
    timeout); other ranks wait for it.
    Says once, at the start, which FineWeb-Edu sample a large budget needs and how many epochs a budget repeats the data."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    budget = cfg.total_steps() * cfg.global_batch * cfg.seq_len
    source, max_tokens = cfg.data, cfg.max_data_tokens
    if max_tokens is None and source.startswith("fineweb-edu"):
        source, note = fineweb_for_budget(source, budget)
        if note:
            say(note)
        # a streamed source is read up to the budget, rounded up to whole shards so short runs share a cache (ours)
        max_tokens = math.ceil(budget / SHARD_TOKENS) * SHARD_TOKENS
    kw = dict(source=source, tokenizer=cfg.tokenizer, bpe_vocab=cfg.bpe_vocab or model_cfg.vocab_size, cache_dir=cfg.data_cache,
              max_tokens=max_tokens, val_fraction=cfg.val_fraction, workers=cfg.data_workers)
    if local_rank == 0:
        data = prepare(**kw, quiet=quiet)
    else:
        while True:  # torchrun stops this rank if rank 0 fails
            try:
                data = prepare(**kw, quiet=True, build=False)
                break
            except FileNotFoundError:
                time.sleep(2)
    windows, needed = (len(data.train) - 1) // cfg.seq_len, cfg.total_steps() * cfg.global_batch
    if needed > windows:
        say(f"note: data repeats: {needed / windows:.2f} epochs (the budget is {needed:,} sequences of {cfg.seq_len} tokens; the train "
            f"split of {source} holds {windows:,}, {len(data.train):,} tokens), reshuffled each epoch")
    return data


class BatchSampler:
    """Deterministic batches: the global batch at `step` is a pure function of (seed, step).

    The train split is cut into non-overlapping windows of seq_len+1 tokens, visited in a seeded
    random order that is reshuffled each epoch (ours). Rank r of W takes rows
    [r·B/W, (r+1)·B/W) of every global batch, so DDP sees exactly the single-process batch.
    """

    def __init__(self, tokens: Tokens, seq_len: int, global_batch: int, seed: int):
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"train split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}; "
                            f"use more data or a shorter --seq-len")
        if self.n_windows < global_batch:  # a batch would repeat windows: almost surely the wrong data (ours)
            raise DataError(f"train split has {len(tokens)} tokens = {self.n_windows} windows of seq_len+1={seq_len + 1}, fewer than "
                            f"one batch of {global_batch} sequences; use more data or a smaller --global-batch / --seq-len")
        self._perms, self._ids = {}, (None, None)  # epoch -> its window order; (step, its window ids)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # a batch spans at most 2 epochs
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        """(global_batch,) window indices for this step, computed once per step (every micro-batch reads them)."""
        if self._ids[0] != step:
            epoch, pos = np.divmod(step * self.global_batch + np.arange(self.global_batch), self.n_windows)
            ids = np.empty(self.global_batch, dtype=np.int64)
            for e in np.unique(epoch):
                ids[epoch == e] = self._perm(int(e))[pos[epoch == e]]
            self._ids = (step, ids)
        return self._ids[1]

    def windows(self, step: int, rows: slice) -> np.ndarray:
        """(len(rows), seq_len + 1) int64 token windows: rows of the global batch at `step`."""
        return np.stack([self.tokens.window(int(i) * self.seq_len, self.seq_len + 1) for i in self.window_ids(step)[rows]])

    def batch(self, step: int, rows: slice):
        """(x, y) int64 arrays of shape (len(rows), seq_len) for rows of the global batch at `step`."""
        w = self.windows(step, rows)
        return w[:, :-1], w[:, 1:]

    def batch_on(self, step: int, rows: slice, device):
        """batch() as tensors on `device`, in one copy; on CUDA from pinned memory, without blocking the host."""
        w = to_device(self.windows(step, rows), device)  # (B, T+1)
        return w[:, :-1], w[:, 1:]


def to_device(a: np.ndarray, device) -> torch.Tensor:
    """A host array as a tensor on `device`. A CUDA copy from pageable memory makes the host wait for it; from pinned
    memory it is queued behind the GPU's work and the host goes on to prepare the next batch."""
    t = torch.from_numpy(a)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def eval_windows(tokens: Tokens, seq_len: int, count: int) -> np.ndarray:
    """Fixed start offsets for evaluation: `count` windows spread evenly over the split."""
    check_eval_windows(tokens, seq_len, count)
    return np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)


def check_eval_windows(tokens: Tokens, seq_len: int, count: int, option: str = "--eval-batches"):
    """Refuse more evaluation windows than the split has start positions: every further one repeats a window, and a
    huge count would only allocate and run for hours."""
    if len(tokens) < seq_len + 1:
        raise DataError(f"val split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}; raise val_fraction or use more data")
    if count > len(tokens) - seq_len:
        raise DataError(f"{option} asks for {count:,} evaluation windows of {seq_len + 1} tokens ({count * (seq_len + 1) * 8 / 1e9:.1f} GB "
                        f"of int64 tokens), but the val split of {len(tokens):,} tokens has only {len(tokens) - seq_len:,} distinct "
                        f"windows; lower {option}")


@torch.no_grad()
def evaluate_loss(model, tokens: Tokens, seq_len: int, batch_size: int, n_batches: int, device="cpu",
                  dtype: torch.dtype = torch.float32, micro_batch: int | None = None) -> float:
    """Mean cross-entropy (nats/token) over n_batches x batch_size fixed windows spread evenly over `tokens`.

    The windows depend only on (tokens, seq_len, batch_size, n_batches); they are run in chunks of
    micro_batch, and under DDP each rank takes every world_size-th chunk and the sums are all-reduced.
    """
    rank, world = rank_and_world()
    starts = eval_windows(tokens, seq_len, n_batches * batch_size)
    chunk = micro_batch or batch_size
    acc = torch.float32 if torch.device(device).type == "mps" else torch.float64  # MPS has no float64
    totals = torch.zeros(2, device=device, dtype=acc)  # (sum of per-window losses, windows)
    was_training = model.training
    model.eval()
    for c in range(rank, math.ceil(len(starts) / chunk), world):
        w = np.stack([tokens.window(int(s), seq_len + 1) for s in starts[c * chunk:(c + 1) * chunk]])
        w = torch.from_numpy(w).to(device)  # (B, T+1)
        with autocast_context(device, dtype):
            _, ce, _ = compute_loss(model, w[:, :-1], w[:, 1:])
        totals += torch.stack([ce.to(acc) * len(w), torch.tensor(float(len(w)), device=device, dtype=acc)])
    model.train(was_training)
    if world > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()
