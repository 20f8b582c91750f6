"""The LM experiments of notebooks 01 and 03: matched effective depth and context access (Global KV).

All LM runs share one tiny setting (ours, sized for a CPU): the stdlib corpus with a 1024-token BPE, d_model 64,
L = 4 (E = D = 2), 4 heads, d_ff 256, seq 128, batch 32, 200 steps (0.82M tokens, about 2 tokens per parameter),
uniform LR, QKNorm on in EVERY model (as in the paper's context-access study), so architectures differ only in what
the paper varies. Every arm runs at seeds 0, 1, 2, compared within a seed (same init seed, same data order).
"""

import time

import numpy as np
import torch

from minimal_asymloop.batches import eval_windows
from minimal_asymloop.config import TrainConfig
from minimal_asymloop.data import prepare
from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.common import CONTEXTS, RUNS, committed_rows, describe_budget, finished, train_lm
from minimal_asymloop.model import ModelConfig
from minimal_asymloop.paths import DATA_CACHE
from minimal_asymloop.probes import global_attention_share, logit_lens, state_norms
from minimal_asymloop.sources import source_identity

# (ours) the tiny LM setting of every experiment
# (ours) sized so that 200 steps of 32 x 128 tokens give >= 2 tokens per parameter (0.41M params, 0.82M tokens)
LM = dict(n_layer=4, d_model=64, n_head=4, d_ff=256, vocab_size=1024, max_seq_len=128, qk_norm=True)
TRAIN = dict(data="stdlib", tokenizer="bpe", bpe_vocab=1024, data_cache=DATA_CACHE, seq_len=128, global_batch=32,
             lr=3e-3, eval_batches=16, quiet=True, device="cpu", dtype="float32",
             alrs=False)  # uniform LR unless an experiment passes ALRS explicitly (the trainer turns it on for asymloop)
MAX_TEST_K = 8  # test-time depth: evaluate up to this K


def lm_config(arch: str, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, **{**LM, **kw})


def train_config(steps: int, seed: int, out_dir, **kw) -> TrainConfig:
    return TrainConfig(**{**TRAIN, "max_steps": steps, "eval_interval": steps, "seed": seed, "out_dir": str(out_dir), **kw})


def probe_batch(n: int = 32, seq_len: int = TRAIN["seq_len"], seed_offset: int = 0):
    """Fixed (idx, targets) windows spread over the stdlib val split, for the probes."""
    data = prepare("stdlib", "bpe", TRAIN["bpe_vocab"], cache_dir=DATA_CACHE, quiet=True)
    starts = eval_windows(data.val, seq_len, n + seed_offset)[seed_offset:]
    w = torch.from_numpy(np.stack([data.val.window(int(s), seq_len + 1) for s in starts]))
    return w[:, :-1], w[:, 1:]


def probes(model, idx, targets) -> dict:
    """Logit lens / test-time depth up to MAX_TEST_K, state change, and Global-KV attention share."""
    cfg = model.config
    out = {}
    if cfg.arch != "dense":
        out["lens_loss"] = logit_lens(model, idx, targets, MAX_TEST_K)  # index k-1: head on z_k
        out["state"] = state_norms(model, idx, MAX_TEST_K)  # norm: k = 0..8; step, relative: k = 1..8
    if cfg.arch == "asymloop" and cfg.context == "global_kv" and cfg.local_kv:
        out["global_share"] = global_attention_share(model, idx, cfg.n_iter).tolist()  # (K, D)
    return out


def run_lm(name: str, model_cfg: ModelConfig, seed: int, steps: int, batch, lr_hook=None, done=None) -> dict | None:
    """Train (or reuse) one run and probe it; None when CACHED_ONLY and the run has not finished yet.
    `done`: committed rows by (name, seed), reused as they are when their architecture fields match."""
    row = (done or {}).get((name, seed))
    fields = dict(arch=model_cfg.arch, n_iter=model_cfg.n_iter, context=model_cfg.context, local_kv=model_cfg.local_kv)
    if row and all(row.get(k) == v for k, v in fields.items()):
        print(f"  {name:>18} seed {seed}: val loss {row['val_loss']:.4f}  (committed result)", flush=True)
        return row
    out_dir = RUNS / f"{name}-s{seed}"
    train_cfg = train_config(steps, seed, out_dir)
    if common.CACHED_ONLY and not finished(model_cfg, train_cfg):
        print(f"  {name:>18} seed {seed}: not trained yet (--cached-only)", flush=True)
        return None
    t0 = time.time()
    result, model = train_lm(model_cfg, train_cfg, lr_hook, reuse=True)
    row = dict(name=name, seed=seed, arch=model_cfg.arch, n_iter=model_cfg.n_iter, context=model_cfg.context,
               local_kv=model_cfg.local_kv, effective_depth=model_cfg.effective_depth, val_loss=result["val_loss"],
               seconds=result.get("seconds", time.time() - t0),
               train_loss=[(r["step"], r["loss"]) for r in result["history"] if "loss" in r],
               **describe_budget(model_cfg, train_cfg), **probes(model, *batch))
    print(f"  {name:>18} seed {seed}: val loss {row['val_loss']:.4f}  ({row['seconds']:.0f}s)", flush=True)
    return row


def run_arms(models: dict, seeds, steps: int, setting: dict) -> dict:
    """Every (arm, seed) in the order given (seed-major within each group); the runs and the arms still missing.
    Runs committed at the same setting (matched_depth's and global_kv's results) are reused, not trained again."""
    batch = probe_batch()
    runs, missing = [], []
    done = committed_rows(setting, "matched_depth", "global_kv")
    for group in models:  # groups run one after another, so the cheap arms finish first
        for seed in seeds:
            for name, cfg in group.items():
                row = run_lm(name, cfg, seed, steps, batch, done=done)
                (runs.append(row) if row else missing.append(dict(name=name, seed=seed)))
    return dict(runs=runs, missing=missing)


def lm_setting(steps: int, seeds) -> dict:
    cfg = lm_config("dense")
    return dict(model=LM, train={k: v for k, v in TRAIN.items() if k != "data_cache"}, steps=steps, seeds=list(seeds),
                budget=describe_budget(cfg, train_config(steps, 0, RUNS)),  # dense's params; each run records its own
                data_identity=source_identity("stdlib", None))  # this Python's stdlib: another Python version is other data


# ----------------------------------------------------------------------------- the experiments


def matched_depth(quick=False):
    """Matched effective depth, uniform LR, QKNorm on everywhere: dense L=4 vs AsymLoop K=1 (depth 4),
    Full Loop K=2 vs AsymLoop K=3 (depth 8), Full Loop K=3 vs AsymLoop K=5 (depth 12), per seed."""
    steps, seeds = (30, common.SEEDS[:1]) if quick else (common.STEPS, common.SEEDS)
    setting = lm_setting(steps, seeds)
    return dict(setting=setting, **run_arms(MATCHED_DEPTH, seeds, steps, setting))


# the matched pairs, one group per depth, cheapest first (each group runs for every seed before the next)
MATCHED_DEPTH = [{"dense": lm_config("dense"), "asymloop_k1": lm_config("asymloop", n_iter=1)},
                 {"full_loop_k2": lm_config("full_loop", n_iter=2), "asymloop_k3": lm_config("asymloop", n_iter=3)},
                 {"full_loop_k3": lm_config("full_loop", n_iter=3), "asymloop_k5": lm_config("asymloop", n_iter=5)}]


def global_kv(quick=False):
    """Context access at K = 1, 3, 5 (AsymLoop, uniform LR): without Global KV, additive injection, without
    Local KV; the Global KV twins are matched_depth's asymloop_k1/k3/k5 runs (same configs and seeds, reused
    from out/experiments/). Cheap and most needed first: no_global at K=3 (the Global KV gain G(3)), additive and
    no_local at K=3 (the paper's K=3 table), then K=5, then K=1. At K=1 no_global and additive need no runs of their
    own: with E + D = L, both are Dense (same blocks, same init from the same seed; see tests/test_model.py)."""
    steps, seeds = (30, common.SEEDS[:1]) if quick else (common.STEPS, common.SEEDS)
    arm = lambda variant, k: {f"asymloop_k{k}_{variant}": lm_config("asymloop", n_iter=k, **CONTEXTS[variant])}
    twins = {f"asymloop_k{k}": lm_config("asymloop", n_iter=k) for k in (1, 3, 5)}
    groups = [twins, arm("no_global", 3), {**arm("additive", 3), **arm("no_local", 3)}, arm("no_global", 5),
              {**arm("additive", 5), **arm("no_local", 5)}, arm("no_local", 1)]
    setting = lm_setting(steps, seeds)
    return dict(setting=setting, **run_arms(groups, seeds, steps, setting))
