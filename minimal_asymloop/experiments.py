"""Longer experiments behind the notebooks, precomputed on a CPU into small JSON files.

    python -m minimal_asymloop.experiments all            # every experiment (CPU-hours; the notebooks print each cost)
    python -m minimal_asymloop.experiments matched_depth  # one of: matched_depth, global_kv, chain_task, alrs
    python -m minimal_asymloop.experiments --list

Results go to notebooks/results/<name>.json, which the notebooks plot. All LM runs share one tiny setting
(ours, sized for a CPU): the stdlib corpus with a 1024-token BPE, d_model 64, L = 4 (E = D = 2), 4 heads,
d_ff 256, seq 128, batch 32, 200 steps (0.82M tokens, about 2 tokens per parameter), uniform LR, QKNorm on in
EVERY model (as in the paper's context-access study), so architectures differ only in what the paper varies.
Every arm runs at seeds 0, 1, 2, compared within a seed (same init seed, same data order).

chain_task trains small models on a synthetic task that needs depth (tasks.ChainTask) until converged or a step limit; alrs is
the ALRS study of notebook 02, each with a setting of its own (below).

Runs committed in notebooks/results/*.json at the same setting are reused as they are, so a fresh clone trains only
what is missing (an added arm, a new seed); --fresh trains everything again. Runs finished locally are cached in
out/experiments/ as well, so an interrupted command continues where it stopped; --cached-only writes the JSON from
the finished runs alone and lists the missing arms. Every JSON records the command and each run's `seconds` (1 thread
on a shared 2-core machine, so they depend on the load); the notebooks print the totals.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from minimal_asymloop.checkpoint import load_model, read_meta
from minimal_asymloop.config import TrainConfig
from minimal_asymloop.data import eval_windows, prepare
from minimal_asymloop.flops import count_params
from minimal_asymloop.metrics import read_metrics
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.paths import DATA_CACHE, OUT, REPO, RESULTS  # noqa: F401 (REPO re-exported for the notebooks)
from minimal_asymloop.probes import global_attention_share, logit_lens, state_norms
from minimal_asymloop.sources import source_identity
from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, train_on_task
from minimal_asymloop.trainer import train

RUNS = OUT / "experiments"

# (ours) the tiny LM setting of every experiment
# (ours) sized so that 200 steps of 32 x 128 tokens give >= 2 tokens per parameter (0.41M params, 0.82M tokens)
LM = dict(n_layer=4, d_model=64, n_head=4, d_ff=256, vocab_size=1024, max_seq_len=128, qk_norm=True)
TRAIN = dict(data="stdlib", tokenizer="bpe", bpe_vocab=1024, data_cache=DATA_CACHE, seq_len=128, global_batch=32,
             lr=3e-3, eval_batches=16, quiet=True, device="cpu", dtype="float32",
             alrs=False)  # uniform LR unless an experiment passes ALRS explicitly (the trainer turns it on for asymloop)
STEPS = 200
STEPS_SET = None  # --steps, when given: it overrides every experiment's own default (the ALRS study's ALRS_STEPS too)
SEEDS = (0, 1, 2)  # every arm at >= 3 seeds, compared within seed (same init seed, same data order)
SEEDS_SET = False  # --seeds given: it overrides every experiment's own default (chain_task's CHAIN_SEEDS too)
CACHED_ONLY = False  # --cached-only: build the JSON from finished runs only, listing the arms not yet trained
FRESH = False  # --fresh: train again even the runs committed in notebooks/results/ at the same setting
MAX_TEST_K = 8  # test-time depth: evaluate up to this K


def lm_config(arch: str, **kw) -> ModelConfig:
    return ModelConfig(arch=arch, **{**LM, **kw})


def train_config(steps: int, seed: int, out_dir, **kw) -> TrainConfig:
    return TrainConfig(**{**TRAIN, "max_steps": steps, "eval_interval": steps, "seed": seed, "out_dir": str(out_dir), **kw})


def train_lm(model_cfg: ModelConfig, train_cfg: TrainConfig, lr_hook=None, reuse: bool = False):
    """Train with the package's trainer; return (result dict, trained model in eval mode).

    reuse=True (ours): if out_dir already holds the finished run of exactly these configs, load it instead
    of training again, so an interrupted `experiments` command continues where it stopped. The LR hook is
    not part of the check: give runs with and without one different out_dirs.
    """
    if reuse and (Path(train_cfg.out_dir) / "latest").exists():
        meta = read_meta(train_cfg.out_dir)
        if (meta["step"] == train_cfg.total_steps() and _same(meta["model_config"], model_cfg.to_dict())
                and _same(meta["train_config"], asdict(train_cfg))):
            model, _, _ = load_model(train_cfg.out_dir)
            history = read_metrics(train_cfg.out_dir)
            seconds = sum(r.get("step_s", 0.0) for r in history)  # training time of the original run (steps only)
            return dict(val_loss=meta["val_loss"], history=history, seconds=seconds, reused=True), model
    result = train(model_cfg, train_cfg, lr_hook=lr_hook)
    model, _, _ = load_model(train_cfg.out_dir)
    return result, model


def _same(stored: dict, now: dict) -> bool:
    """A stored config equals the current one on every stored key (fields added to the dataclass later are new)."""
    return all(now.get(k) == v for k, v in stored.items() if k not in ("quiet", "resume"))


def probe_batch(n: int = 32, seq_len: int = TRAIN["seq_len"], seed_offset: int = 0):
    """Fixed (idx, targets) windows spread over the stdlib val split, for the probes."""
    data = prepare("stdlib", "bpe", TRAIN["bpe_vocab"], cache_dir=DATA_CACHE, quiet=True)
    starts = eval_windows(data.val, seq_len, n + seed_offset)[seed_offset:]
    w = torch.from_numpy(np.stack([data.val.window(int(s), seq_len + 1) for s in starts]))
    return w[:, :-1], w[:, 1:]


def describe_budget(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    tokens = train_cfg.total_steps() * train_cfg.global_batch * train_cfg.seq_len
    params = count_params(model_cfg)
    return dict(params=params, tokens=tokens, tokens_per_param=tokens / params)


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


def committed(name: str, setting: dict, ignore=()) -> dict | None:
    """notebooks/results/<name>.json when it was made at exactly `setting` (keys in `ignore` aside), else None.

    The committed results travel with the repository while out/experiments/ does not, so a fresh clone that adds
    an arm reuses the committed runs instead of training them all again (--fresh: train everything)."""
    path = RESULTS / f"{name}.json"
    if FRESH or not path.exists():
        return None
    old = json.loads(path.read_text())
    plain = lambda d: {k: v for k, v in json.loads(json.dumps(d, default=float)).items() if k not in ignore}
    return old if plain(old.get("setting", {})) == plain(setting) else None


def committed_rows(setting: dict, *names: str) -> dict:
    """{(run name, seed): row} of the committed LM runs made at `setting`, from the results files `names`."""
    rows = {}
    for name in names:
        old = committed(name, setting, ignore=("seeds",))  # rows are per seed: another seed list reuses the common ones
        rows.update({(r["name"], r["seed"]): r for r in (old or {}).get("runs", [])})
    return rows


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
    if CACHED_ONLY and not _finished(model_cfg, train_cfg):
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


def _finished(model_cfg: ModelConfig, train_cfg: TrainConfig) -> bool:
    if not (Path(train_cfg.out_dir) / "latest").exists():
        return False
    meta = read_meta(train_cfg.out_dir)
    return (meta["step"] == train_cfg.total_steps() and _same(meta["model_config"], model_cfg.to_dict())
            and _same(meta["train_config"], asdict(train_cfg)))


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
    steps, seeds = (30, SEEDS[:1]) if quick else (STEPS, SEEDS)
    setting = lm_setting(steps, seeds)
    return dict(setting=setting, **run_arms(MATCHED_DEPTH, seeds, steps, setting))


# the matched pairs, one group per depth, cheapest first (each group runs for every seed before the next)
MATCHED_DEPTH = [{"dense": lm_config("dense"), "asymloop_k1": lm_config("asymloop", n_iter=1)},
                 {"full_loop_k2": lm_config("full_loop", n_iter=2), "asymloop_k3": lm_config("asymloop", n_iter=3)},
                 {"full_loop_k3": lm_config("full_loop", n_iter=3), "asymloop_k5": lm_config("asymloop", n_iter=5)}]


# context access variants (the paper's Section 5 ablations); Global KV itself is matched_depth's asymloop_k{K}
CONTEXTS = {"no_global": dict(context="none"),  # without Global KV: Local KV only, z_0 = H
            "additive": dict(context="additive"),  # no Global KV; z_0 = 0, z_k = Dec(z_{k-1} + H)
            "no_local": dict(local_kv=False)}  # without Local KV: decoder queries attend to Global KV only


def global_kv(quick=False):
    """Context access at K = 1, 3, 5 (AsymLoop, uniform LR): without Global KV, additive injection, without
    Local KV; the Global KV twins are matched_depth's asymloop_k1/k3/k5 runs (same configs and seeds, reused
    from out/experiments/). Cheap and most needed first: no_global at K=3 (the Global KV gain G(3)), additive and
    no_local at K=3 (the paper's K=3 table), then K=5, then K=1. At K=1 no_global and additive need no runs of their
    own: with E + D = L, both are Dense (same blocks, same init from the same seed; see tests/test_model.py)."""
    steps, seeds = (30, SEEDS[:1]) if quick else (STEPS, SEEDS)
    arm = lambda variant, k: {f"asymloop_k{k}_{variant}": lm_config("asymloop", n_iter=k, **CONTEXTS[variant])}
    twins = {f"asymloop_k{k}": lm_config("asymloop", n_iter=k) for k in (1, 3, 5)}
    groups = [twins, arm("no_global", 3), {**arm("additive", 3), **arm("no_local", 3)}, arm("no_global", 5),
              {**arm("additive", 5), **arm("no_local", 5)}, arm("no_local", 1)]
    setting = lm_setting(steps, seeds)
    return dict(setting=setting, **run_arms(groups, seeds, steps, setting))


def chain_task(quick=False):
    """Depth on a task that needs it: binding chains of 1-3 hops, Dense L=1..4, AsymLoop (E=1, D=1) K=1..5 and
    Full Loop (L=2) K=2 trained until converged, 5 seeds; accuracy by hops at the trained K and at test-time K+1..K+3."""
    task = ChainTask(**CHAIN_TASK)
    steps, seeds = (40, SEEDS[:1]) if quick else (CHAIN_STEPS, SEEDS if SEEDS_SET else CHAIN_SEEDS)
    setting = chain_setting(steps)
    old = None if quick else committed("chain_task", setting, ignore=("seeds",))
    done = {(r["name"], r["seed"]): r for r in (old or {}).get("runs", [])}
    runs = [done.get((name, seed)) or chain_run(name, cfg, task, setting, seed, cache=not quick)
            for seed in seeds for name, cfg in chain_models(task).items()]  # seed-major: every arm at seed 0 first
    for r in runs:  # the training budget each run used (steps differ: a converged run stops early)
        r["tokens"] = r["steps"] * CHAIN_BATCH * task.seq_len
        r["tokens_per_param"] = r["tokens"] / r["params"]
    return dict(setting=dict(setting, seeds=list(seeds)), runs=runs)


def chain_setting(steps: int) -> dict:
    return dict(task=CHAIN_TASK, model=CHAIN_MODEL, max_steps=steps, batch=CHAIN_BATCH, lr=CHAIN_LR,
                check_every=CHAIN_CHECK, converged=CHAIN_CONVERGED, eval_programs=CHAIN_EVAL)


def chain_models(task: ChainTask) -> dict:
    """Effective depth 1-6: Dense L = 1..4, AsymLoop E = D = 1 at K = 1..5 (depth 1 + K), Full Loop L = 2 at K = 2."""
    base = dict(CHAIN_MODEL, vocab_size=task.vocab_size, max_seq_len=task.seq_len)
    models = {f"dense_l{n}": ModelConfig(arch="dense", n_layer=n, **base) for n in range(1, 5)}
    models.update({f"asymloop_k{k}": ModelConfig(arch="asymloop", n_layer=2, n_iter=k, **base) for k in range(1, 6)})
    models["full_loop_k2"] = ModelConfig(arch="full_loop", n_layer=2, n_iter=2, **base)
    # context access at matched effective depth 4 (beside asymloop_k3, full_loop_k2 and dense_l4): the paper's ablations
    models.update({f"asymloop_k3_{v}": ModelConfig(arch="asymloop", n_layer=2, n_iter=3, **base, **CONTEXTS[v])
                   for v in CONTEXTS})
    return models


def chain_run(name: str, cfg: ModelConfig, task: ChainTask, setting: dict, seed: int, cache: bool = True) -> dict:
    """Train one model on fresh programs until every hop count is at CHAIN_CONVERGED accuracy on held-out programs
    (checked every CHAIN_CHECK steps) or max_steps; cached in out/experiments/chain/ by setting, name and seed."""
    path = RUNS / "chain" / f"{name}-s{seed}.json"
    if cache and path.exists() and json.loads(path.read_text())["setting"] == setting:
        return json.loads(path.read_text())["run"]
    torch.manual_seed(seed)
    model = LoopedLM(cfg)
    curve = []  # (step, {hops: accuracy}) on the same held-out programs at every check

    def check(step, m):
        acc = accuracy_by_hops(m, task, n=CHAIN_EVAL)
        curve.append((step, acc))
        return min(acc.values()) >= CHAIN_CONVERGED

    t0 = time.time()
    losses = train_on_task(model, task, steps=setting["max_steps"], batch_size=CHAIN_BATCH, lr=CHAIN_LR, seed=seed,
                           check_every=CHAIN_CHECK, check=check)
    seconds = time.time() - t0
    looped = cfg.arch != "dense"
    test_ks = range(1, cfg.n_iter + 4) if looped else [cfg.n_iter]  # test-time depth up to K + 3 (and below K)
    acc = {k: accuracy_by_hops(model, task, n=CHAIN_EVAL, n_iter=k if looped else None) for k in test_ks}
    run = dict(name=name, seed=seed, arch=cfg.arch, n_layer=cfg.n_layer, n_iter=cfg.n_iter,
               effective_depth=cfg.effective_depth, params=count_params(cfg), steps=len(losses),
               converged=min(curve[-1][1].values()) >= CHAIN_CONVERGED if curve else False, seconds=seconds,
               loss=[(i, losses[i]) for i in range(0, len(losses), 50)],
               curve=[(step, {str(h): a for h, a in a_.items()}) for step, a_ in curve],
               acc_by_test_k={str(k): {str(h): a for h, a in v.items()} for k, v in acc.items()})
    print(f"  {name:>14} seed {seed}: {run['steps']} steps, converged {run['converged']}, acc by hops "
          f"{ {h: round(a, 2) for h, a in acc[cfg.n_iter].items()} } ({seconds:.0f}s)", flush=True)
    if cache:  # (a --quick run is not cached: it would overwrite a real run of the same name and seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), str(path.with_suffix(".safetensors")))  # the trained weights, for probing
        write_json(path, dict(setting=setting, run=run))
    return run


# (ours) programs of 8 statements over 8 variables and 4 values, chains of 1-3 hops: a straightforward circuit needs
# about h blocks in sequence for h hops (one to bring each statement's left-hand side to its right-hand side, then one
# lookup per extra hop), so Dense L = 1..4 and AsymLoop K = 1..5 span depths below and above that. Chains of up to 4
# hops were tried first: Dense L=4 stayed below 0.85 on 2 hops after 4,000 steps (a pilot at seed 0)
CHAIN_TASK = dict(n_stmt=8, max_hops=3, n_vars=8, n_values=4)
CHAIN_MODEL = dict(d_model=64, n_head=4, d_ff=128, qk_norm=True)
CHAIN_SEEDS = (0, 1, 2, 3, 4)  # (ours) 5: whether a run converges in time varies from seed to seed
CHAIN_STEPS = 6000  # the most steps per run; a converged run stops at its first check >= CHAIN_CONVERGED
CHAIN_BATCH = 32  # fresh programs per step
CHAIN_LR = 3e-3
CHAIN_CHECK = 250  # steps between accuracy checks on held-out programs
CHAIN_CONVERGED = 0.99  # every hop count at least this accurate
CHAIN_EVAL = 256  # held-out programs per check (one fixed generator seed, apart from the training streams)


# ----------------------------------------------------------------------------- ALRS, fairly (base-LR sweep + controls)

# (ours) the LM setting of the ALRS study, sized so that 3 seeds x (2 arms x 3 base LRs + 3 controls) runs of >= 2 tokens
# per parameter fit about an hour of one shared CPU core: AsymLoop K=3, d_model 64 (so every matrix has >= 64 eigenvalues,
# enough to fit), L = 4 (E = D = 2), d_ff 128, a 512-token BPE, batch 16 x seq 128, QKNorm on; 246,560 parameters
ALRS_LM = dict(n_layer=4, d_model=64, n_head=4, d_ff=128, vocab_size=512, max_seq_len=128, qk_norm=True)
ALRS_TRAIN = dict(data="stdlib", tokenizer="bpe", bpe_vocab=512, data_cache=DATA_CACHE, seq_len=128, global_batch=16,
                  eval_batches=16, quiet=True, device="cpu", dtype="float32")
# (ours) the paper's schedule (allocate every 100 steps, 50-step ramps, freeze after 20% of training) scaled to a
# 250-step run: allocations at steps 0, 10, ..., 50, each reached by a 5-step ramp, then frozen
ALRS_SCHEDULE = dict(alrs_every=10, alrs_ramp=5, alrs_phase=0.2)
ALRS_STEPS = 250  # (ours) 16 x 128 x 250 = 512K tokens: 2.08 tokens/param at this setting
# base-LR grids (ours): ALRS multiplies the base LR by 1-5, so its grid sits one octave lower; an arm whose best LR
# lands on the edge of its grid gets one more LR beyond that edge before the controls run
ALRS_LRS = {"uniform": (2.5e-3, 5e-3, 1e-2), "alrs": (1.25e-3, 2.5e-3, 5e-3)}
SPECTRA = ("decoder.0.mlp.up.weight", "encoder.0.attn.wq.weight")  # matrices whose eigenvalues are stored


def alrs_records(rows: list[dict]) -> list[dict]:
    """The allocations logged in a run's metrics, as {step, alpha, multiplier}."""
    return [dict(step=r["alrs_step"], alpha=r["alrs_alpha"], multiplier=r["alrs_multiplier"]) for r in rows if "alrs_multiplier" in r]


class PinnedTop:
    """Control (ours): uniform LR for every matrix except embedding and head, which get ALRS's top multiplier,
    reached by ALRS's ramp from step 0 and then kept; the one thing ALRS does that needs no spectrum."""

    per_matrix = True

    def __init__(self, hi: float, ramp_len: int):
        self.hi, self.ramp_len = hi, ramp_len

    def on_step(self, step, model, optimizer):
        from minimal_asymloop import alrs

        mult = alrs.ramp(1.0, self.hi, step, 0, self.ramp_len)
        for group in optimizer.param_groups:
            if group.get("name") in alrs.TOP_NAMES:
                group["lr_mult"] = mult
        return dict(pinned_top=self.hi) if step == 0 else None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        pass


def alrs_arm(arm: str, lr: float, seed: int, steps: int) -> dict:
    """One run of the ALRS study: arm is uniform, alrs (ww fit), alrs_hill (hill_median fit), alrs_unpinned
    (embedding and head allocated like every other matrix) or uniform_top (uniform LR with embedding and head at the
    top multiplier). Cached in out/experiments/ by arm, LR and seed."""
    from minimal_asymloop import alrs

    cfg = ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM)
    on = arm != "uniform"
    extra = dict(alrs=on, **ALRS_SCHEDULE, alrs_fit="hill_median" if arm == "alrs_hill" else "ww") if on else dict(alrs=False)
    out_dir = RUNS / f"alrs_study-{arm}-lr{lr:.3g}-s{seed}"
    train_cfg = TrainConfig(**{**ALRS_TRAIN, **extra, "lr": lr, "max_steps": steps, "eval_interval": steps, "seed": seed,
                               "out_dir": str(out_dir)})
    hook = None
    if arm == "uniform_top":  # uniform LR, except what ALRS pins: embedding and head at its top multiplier
        hook = PinnedTop(train_cfg.alrs_hi, ALRS_SCHEDULE["alrs_ramp"])
    if arm == "alrs_unpinned":  # the trainer's hook pins embedding and head; this one does not (the out_dir name says so)
        t = train_cfg
        hook = alrs.ALRS(steps, t.alrs_fit, t.alrs_lo, t.alrs_hi, t.alrs_every, t.alrs_phase, t.alrs_ramp, top=())
    result, model = train_lm(cfg, train_cfg, hook, reuse=True)
    history = result["history"]
    records = alrs_records(history)
    final = records[-1]["multiplier"] if records else {}
    sizes = {n: w.numel() for n, w in alrs.tuned_matrices(model).items()}
    row = dict(arm=arm, lr=lr, seed=seed, val_loss=result["val_loss"], seconds=result["seconds"],
               train_loss=[(r["step"], r["loss"]) for r in history if "loss" in r and r["step"] % 5 == 0],
               **describe_budget(cfg, train_cfg), **alrs.stable_rank_summary(model))
    if final:
        row.update(final_multiplier=final, group_multiplier=alrs.group_means(final), ratios=alrs.decoder_encoder_ratios(final),
                   mean_multiplier=float(np.mean(list(final.values()))),
                   param_weighted_multiplier=float(sum(final[n] * sizes[n] for n in final) / sum(sizes[n] for n in final)),
                   alrs_records=records, alloc_seconds=sum(r.get("alrs_seconds", 0.0) for r in history))
    print(f"  {arm:>14} lr {lr:.3g} seed {seed}: val loss {row['val_loss']:.4f}  ({row['seconds']:.0f}s)", flush=True)
    return row


def best_lr(runs: list[dict], arm: str, seeds, grid=None) -> float | None:
    """The arm's base LR with the lowest mean val loss over `seeds`, among the LRs of `grid` (None: any) that have every seed."""
    by_lr: dict[float, dict] = {}
    for r in runs:
        if r["arm"] == arm and (grid is None or r["lr"] in grid):
            by_lr.setdefault(r["lr"], {})[r["seed"]] = r["val_loss"]
    full = {lr: np.mean([v[s] for s in seeds]) for lr, v in by_lr.items() if all(s in v for s in seeds)}
    return min(full, key=full.get) if full else None


def alrs_experiment(quick=False):
    """AsymLoop K=3, uniform LR vs ALRS: base-LR sweep for each, then controls at the best LRs, >= 3 seeds each."""

    steps, seeds = (30, SEEDS[:1]) if quick else (STEPS_SET or ALRS_STEPS, SEEDS)
    lrs = {arm: grid[1:2] if quick else grid for arm, grid in ALRS_LRS.items()}
    runs: list[dict] = []
    state: dict = {}  # best LRs, spectra, the scaled-uniform LR: filled in as the queue gets there
    t_start = time.time()
    # runs committed at this setting are reused (the grids may have grown at an edge, and runs are per seed)
    old = None if quick else committed("alrs", setting_of(steps, seeds, lrs), ignore=("lr_grids", "seeds", "regenerate"))
    if old:
        runs += old["runs"]
        lrs = {arm: tuple(grid) for arm, grid in old["setting"]["lr_grids"].items()}

    def result(partial=False):
        best = {arm: best_lr(runs, arm, seeds, lrs[arm]) for arm in ("uniform", "alrs")}  # the sweep's LRs with every seed
        return dict(setting=setting_of(steps, seeds, lrs), best_lr=best, **state, runs=runs, partial=partial,
                    seconds=time.time() - t_start)

    def run(arm, lr, seed):
        if not any((r["arm"], r["lr"], r["seed"]) == (arm, lr, seed) for r in runs):
            runs.append(alrs_arm(arm, lr, seed, steps))
            if not quick:  # a partial result after every run, so finished groups can be used before the rest is done
                write_json(RESULTS / "alrs.json", result(partial=True))

    # The order (ours) puts first what a cut-short queue most needs: (a) every LR of both grids at the first seed (plus
    # one LR beyond an edge that wins), then the other seeds at each arm's best LR of the first seed, so the arms can be
    # compared at their own best over every seed; (b) the uniform LR scaled by ALRS's mean multiplier, then embedding/head
    # unpinned; (a) every LR at every seed, nearest each arm's best first; (b) the hill_median fit.
    first = seeds[:1]
    for arm in ("uniform", "alrs"):
        for lr in lrs[arm]:
            run(arm, lr, first[0])
    for arm in ("uniform", "alrs"):  # a best LR on the grid's edge: one more LR beyond it
        best, grid = best_lr(runs, arm, first, lrs[arm]), sorted(lrs[arm])
        if not quick and best in (grid[0], grid[-1]):
            lrs[arm] = tuple(sorted((*grid, best / 2 if best == grid[0] else best * 2)))
            run(arm, lrs[arm][0] if best == grid[0] else lrs[arm][-1], first[0])
    best0 = {arm: best_lr(runs, arm, first, lrs[arm]) for arm in ("uniform", "alrs")}
    state["best_lr_first_seed"] = best0
    for seed in seeds[1:]:
        for arm in ("uniform", "alrs"):
            run(arm, best0[arm], seed)
    reuse_spectra = old and old.get("best_lr_first_seed") == best0 and "spectra" in old
    state["spectra"] = old["spectra"] if reuse_spectra else alrs_spectra(best0, first[0])
    mean_mult = float(np.mean([r["mean_multiplier"] for r in runs if r["arm"] == "alrs" and r["lr"] == best0["alrs"]]))
    state.update(mean_multiplier=mean_mult, scaled_uniform_lr=float(f"{best0['alrs'] * mean_mult:.3g}"))
    for seed in seeds:
        run("uniform", state["scaled_uniform_lr"], seed)
    for seed in seeds:
        run("alrs_unpinned", best0["alrs"], seed)
    rest = sorted(((arm, lr) for arm in ("uniform", "alrs") for lr in lrs[arm]), key=lambda a: abs(np.log(a[1] / best0[a[0]])))
    for arm, lr in rest:  # both arms' LRs, nearest to each arm's best first
        for seed in seeds:
            run(arm, lr, seed)
    for seed in seeds:
        run("alrs_hill", best0["alrs"], seed)
    for seed in seeds:  # is the gain ALRS's spectra, or only its pinned embedding/head LR?
        run("uniform_top", best0["uniform"], seed)
    return result()


def setting_of(steps: int, seeds, lrs: dict) -> dict:
    """The ALRS study's setting, as recorded in its JSON."""
    cfg = ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM)
    budget = describe_budget(cfg, TrainConfig(**{**ALRS_TRAIN, "max_steps": steps}))
    return dict(model=dict(ALRS_LM, arch="asymloop", n_iter=3, n_enc=cfg.n_enc),
                train={k: v for k, v in ALRS_TRAIN.items() if k != "data_cache"}, steps=steps, seeds=list(seeds),
                schedule=ALRS_SCHEDULE, lr_grids=lrs, budget=dict(budget, steps=steps),
                data_identity=source_identity("stdlib", None),
                regenerate=f"python -m minimal_asymloop.experiments alrs --seeds {' '.join(map(str, seeds))} --steps {steps}")


def alrs_spectra(best: dict, seed: int) -> dict:
    """Alphas (both fits), two matrices' eigenvalues and the stable rank at init and after training at each arm's best LR."""
    from minimal_asymloop import alrs

    cfg = ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM)
    torch.manual_seed(seed)
    models = {"init": LoopedLM(cfg)}
    for arm in ("uniform", "alrs"):
        models[arm], _, _ = load_model(RUNS / f"alrs_study-{arm}-lr{best[arm]:.3g}-s{seed}")
    out = {}
    for tag, model in models.items():
        mats = alrs.tuned_matrices(model)
        out[tag] = dict(alpha_ww={n: alrs.ww_alpha(w) for n, w in mats.items()},
                        alpha_hill={n: alrs.hill_median_alpha(alrs.eigenvalues(w)) for n, w in mats.items()},
                        eigenvalues={n: alrs.eigenvalues(mats[n]).tolist() for n in SPECTRA},
                        stable_rank=alrs.stable_rank_summary(model), best_lr=best.get(tag))
    return out


def write_json(path: Path, obj: dict):
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    os.replace(tmp, path)


EXPERIMENTS = {"matched_depth": matched_depth, "global_kv": global_kv, "chain_task": chain_task, "alrs": alrs_experiment}


def main(argv=None):
    global SEEDS, SEEDS_SET, STEPS, STEPS_SET, CACHED_ONLY, FRESH
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"experiments to run: all or any of {', '.join(EXPERIMENTS)}")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--quick", action="store_true", help="a few steps each, to check the pipeline (results NOT for the notebooks)")
    p.add_argument("--seeds", type=int, nargs="+", help=f"seeds to run (default {' '.join(map(str, SEEDS))}; chain_task: "
                   f"{' '.join(map(str, CHAIN_SEEDS))})")
    p.add_argument("--steps", type=int, help=f"LM experiments: training steps per run (default {STEPS})")
    p.add_argument("--cached-only", action="store_true", help="train nothing: write the JSON from the runs finished so far "
                   "(out/experiments/), listing the missing arms under 'missing'")
    p.add_argument("--fresh", action="store_true", help="train again even the runs committed in notebooks/results/ "
                   "(by default a run committed at the same setting is reused)")
    p.add_argument("--threads", type=int, help="torch CPU threads (the committed results ran with 1, on a shared machine)")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON results (default notebooks/results)")
    args = p.parse_args(argv)
    if args.list or not args.names:
        for name, fn in EXPERIMENTS.items():
            print(f"{name:>14}  {fn.__doc__.splitlines()[0]}")
        return
    names = list(EXPERIMENTS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        sys.exit(f"unknown experiment(s) {unknown}; choose all or any of {', '.join(EXPERIMENTS)}")
    SEEDS, STEPS, STEPS_SET, CACHED_ONLY = tuple(args.seeds or SEEDS), args.steps or STEPS, args.steps, args.cached_only
    FRESH, SEEDS_SET = args.fresh, bool(args.seeds)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"{name}:", flush=True)
        t0 = time.time()
        result = EXPERIMENTS[name](quick=args.quick)
        result.update(experiment=name, command=f"python -m minimal_asymloop.experiments {name}" + (" --quick" if args.quick else "")
                      + (f" --threads {args.threads}" if args.threads else ""),
                      torch=torch.__version__, threads=torch.get_num_threads(), seconds=time.time() - t0,
                      cached_only=CACHED_ONLY)  # True: `seconds` is the probing time; each run's `seconds` is its training
        path = out / f"{name}{'_quick' if args.quick else ''}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        os.replace(tmp, path)  # atomic
        print(f"  wrote {path} ({result['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
