"""Train once, run at any depth (ours, issue 29): AsymLoop trained at fixed K = 3 against the same model trained with
K drawn per step (Huginn's log-normal Poisson, and uniform 1..5), at the same expected K = 3 and so the same expected
training FLOPs, on the chain task and on the tiny LM; each model then run at test-time K = 1..8 and with the adaptive
exit rule (adaptive.sweep). Within-seed comparison: the same init seed and the same data order for every recipe.

A third part starts from trained models instead of from scratch: each committed chain model (trained at fixed K = 3
to convergence, notebooks/results/chain_weights/asymloop_k3-s<seed>) gets FINETUNE_STEPS more steps with each recipe,
the same programs in the same order for every recipe (notebook 05's live cell, at more steps and every recipe).

Each run is cached in out/experiments/sampled_depth/<task>-<recipe>-s<seed>.json (LM runs also keep their out_dir),
so an interrupted command continues where it stopped; --cached-only writes the JSON from finished runs and lists the rest.
"""

import json
import time
from dataclasses import asdict

import torch

from minimal_asymloop import adaptive
from minimal_asymloop.depth import DepthSampler
from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.chain import CHAIN_BATCH, CHAIN_LR, CHAIN_MODEL, CHAIN_TASK, ChainTask
from minimal_asymloop.experiments.common import RUNS, describe_budget, train_lm, write_json
from minimal_asymloop.experiments.lm import lm_config, probe_batch, train_config
from minimal_asymloop.flops import count_params, train_flops_per_token
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.paths import RESULTS
from minimal_asymloop.system import peak_new_bytes
from minimal_asymloop.tasks import train_on_task

# the recipes: TrainConfig depth fields. (ours) depth_mean 3.024 puts E[K] at 3.000 once the cap of 8 folds the tail in
RECIPES = {"fixed_k3": dict(depth_sampler="fixed"),
           "lognormal_k3": dict(depth_sampler="lognormal_poisson", depth_mean=3.024, depth_cap=8),
           "uniform_k1_5": dict(depth_sampler="uniform", depth_min=1, depth_max=5)}
TEST_K = 8  # test-time depth: K = 1..8
# (ours) budgets cut to fit a shared 2-core machine: the chain task's runs stop at a fixed step (no early stop, so every
# recipe spends the same expected FLOPs), the LM's at 200 steps, as in the other LM experiments (--steps overrides it)
CHAIN_STEPS = 1000
LM_STEPS = 200
SEEDS = (0, 1, 2)
# (ours) the fine-tune part starts from the chain models whose weights are committed: chain_context's AsymLoop K = 3,
# seeds 0, 1 and 3, each trained at fixed K = 3 until it converged (5,000, 750 and 5,000 steps)
FINETUNE_STEPS = 300
FINETUNE_SEEDS = (0, 1, 3)
OUT = RUNS / "sampled_depth"


def sampler(recipe: str, seed: int) -> DepthSampler:
    r = RECIPES[recipe]
    return DepthSampler(r["depth_sampler"], 3, r.get("depth_min", 1), r.get("depth_max"), r.get("depth_mean"),
                        r.get("depth_cap"), seed)


def chain_run(recipe: str, seed: int, steps: int, cache: bool = True) -> dict:
    """AsymLoop E = D = 1, K = 3 (the chain task's model) trained for `steps` with this recipe's K, then swept."""
    path = OUT / f"chain-{recipe}-s{seed}.json"
    setting = dict(task=CHAIN_TASK, model=CHAIN_MODEL, steps=steps, batch=CHAIN_BATCH, lr=CHAIN_LR, recipe=RECIPES[recipe])
    if cache and path.exists() and json.loads(path.read_text())["setting"] == setting:
        return json.loads(path.read_text())["run"]
    task = ChainTask(**CHAIN_TASK)
    cfg = ModelConfig(arch="asymloop", n_layer=2, n_iter=3, vocab_size=task.vocab_size, max_seq_len=task.seq_len, **CHAIN_MODEL)
    torch.manual_seed(seed)
    run = dict(train_and_sweep(LoopedLM(cfg), "chain", recipe, seed, steps, loss_every=50), params=count_params(cfg))
    print(f"  chain {recipe:>13} seed {seed}: mean K {run['mean_k']:.3f}, acc by hops at K=3 "
          f"{ {h: round(a, 2) for h, a in run['sweep']['fixed'][2]['acc_by_hops'].items()} } ({run['seconds']:.0f}s)", flush=True)
    return stored(path, setting, run) if cache else run


def finetune_run(recipe: str, seed: int, steps: int, cache: bool = True) -> dict:
    """The committed chain model of `seed` (converged at fixed K = 3) given `steps` more steps with this recipe's K
    (data and sampler seeded by `seed`: every recipe sees the same programs), then swept like chain_run's models."""
    path = OUT / f"finetune-{recipe}-s{seed}.json"
    weights = RESULTS / "chain_weights" / f"asymloop_k3-s{seed}.safetensors"
    setting = dict(start=weights.name, steps=steps, batch=CHAIN_BATCH, lr=CHAIN_LR, recipe=RECIPES[recipe])
    if cache and path.exists() and json.loads(path.read_text())["setting"] == setting:
        return json.loads(path.read_text())["run"]
    run = train_and_sweep(adaptive.chain_model(weights), "finetune", recipe, seed, steps, loss_every=25)
    print(f"  finetune {recipe:>13} seed {seed}: mean K {run['mean_k']:.3f}, 3-hop acc at K=1..8 "
          f"{[round(r['acc_by_hops']['3'], 3) for r in run['sweep']['fixed']]} ({run['seconds']:.0f}s)", flush=True)
    return stored(path, setting, run) if cache else run


def stored(path, setting: dict, run: dict) -> dict:
    """Write one run with its setting to `path` (a rerun with the same setting reads it instead of training) and return it."""
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(path, dict(setting=setting, run=run))
    return run


def train_and_sweep(model, task_name: str, recipe: str, seed: int, steps: int, loss_every: int) -> dict:
    """Train a chain model for `steps` with this recipe's K (recorded per step), then sweep it at test-time K = 1..TEST_K
    and under the exit rule (adaptive.sweep) on the held-out programs."""
    task, depths, ks = ChainTask(**CHAIN_TASK), sampler(recipe, seed), []
    draw = depths.draw
    depths.draw = lambda: ks.append(draw()) or ks[-1]  # record each step's K
    t0 = time.time()
    losses = train_on_task(model, task, steps=steps, batch_size=CHAIN_BATCH, lr=CHAIN_LR, seed=seed, depth=depths)
    seconds = time.time() - t0
    idx, targets, hops = adaptive.chain_batch()
    tokens = steps * CHAIN_BATCH * task.seq_len
    return dict(task=task_name, recipe=recipe, seed=seed, steps=steps, seconds=seconds, s_per_token=seconds / tokens,
                tokens=tokens, k_drawn=ks, mean_k=sum(ks) / len(ks),
                train_flops=sum(train_flops_per_token(model.config, task.seq_len, {k: 1.0}) for k in ks) * CHAIN_BATCH * task.seq_len,
                loss=[(i, losses[i]) for i in range(0, len(losses), loss_every)],
                sweep=adaptive.sweep(model.eval(), idx, targets, max_iter=TEST_K, hops=hops))


def lm_run(recipe: str, seed: int, steps: int, batch) -> dict | None:
    """The tiny LM's AsymLoop K = 3 (lm.LM, uniform LR) trained with this recipe's K, then swept on the probe windows."""
    model_cfg = lm_config("asymloop", n_iter=3)
    train_cfg = train_config(steps, seed, OUT / f"lm-{recipe}-s{seed}", **RECIPES[recipe])
    path, setting = OUT / f"lm-{recipe}-s{seed}.json", dict(model=model_cfg.to_dict(), train=asdict(train_cfg))
    if path.exists() and json.loads(path.read_text())["setting"] == setting and common.finished(model_cfg, train_cfg):
        return json.loads(path.read_text())["run"]
    if common.CACHED_ONLY and not common.finished(model_cfg, train_cfg):
        return None
    result, model = train_lm(model_cfg, train_cfg, reuse=True)
    ks = [r["n_iter"] for r in result["history"] if "n_iter" in r]
    step_s = [r["step_s"] for r in result["history"] if "step_s" in r]
    tokens = steps * train_cfg.global_batch * train_cfg.seq_len
    run = dict(task="lm", recipe=recipe, seed=seed, steps=steps, val_loss=result["val_loss"], seconds=sum(step_s),
               s_per_token=sum(step_s) / tokens, k_drawn=ks, mean_k=sum(ks) / len(ks), **describe_budget(model_cfg, train_cfg),
               train_flops=sum(train_flops_per_token(model_cfg, train_cfg.seq_len, {k: 1.0}) for k in ks)
               * train_cfg.global_batch * train_cfg.seq_len,
               train_loss=[(r["step"], r["loss"]) for r in result["history"] if "loss" in r],
               sweep=adaptive.sweep(model.eval(), *batch, max_iter=TEST_K))
    print(f"  lm {recipe:>13} seed {seed}: val loss {run['val_loss']:.4f} at K=3, mean K {run['mean_k']:.3f} "
          f"({run['seconds']:.0f}s)", flush=True)
    write_json(path, dict(setting=setting, run=run))  # the sweep too: a rerun reads it instead of probing again
    return run


def peak_memory(k: int, batch: int = 32, seq: int = 128) -> int:
    """Peak bytes of the tensors one LM training forward + backward creates at K = k (system.peak_new_bytes, CPU)."""
    torch.manual_seed(0)
    model = LoopedLM(lm_config("asymloop", n_iter=3))
    idx = torch.randint(0, model.config.vocab_size, (batch, seq))

    def step():
        _, loss = model(idx, idx, n_iter=k, return_logits=False)
        loss.backward()
    return peak_new_bytes(step)


def common_peaks(quick: bool) -> dict[int, int]:
    """{K: peak bytes} at K = 3 and each recipe's largest K, cached in OUT/memory.json."""
    path, ks = OUT / "memory.json", sorted({3, *(sampler(name, 0).largest() for name in RECIPES)})
    cached = {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() and not quick else {}
    peaks = {k: cached[k] if k in cached else peak_memory(k) for k in ks}
    if not quick:
        OUT.mkdir(parents=True, exist_ok=True)
        write_json(path, peaks)
    return peaks


def sampled_depth(quick=False):
    """Train once, run at any depth: fixed K=3 vs K sampled per step (log-normal Poisson, uniform 1..5) at the same E[K],
    chain task and tiny LM, 3 seeds; loss/accuracy at test-time K = 1..8, adaptive exit frontier, time and memory."""
    seeds = common.SEEDS[:1] if quick else (common.SEEDS if common.SEEDS_SET else SEEDS)
    chain_steps = 30 if quick else CHAIN_STEPS
    lm_steps = 20 if quick else (common.STEPS_SET or LM_STEPS)
    batch = probe_batch()
    runs, missing = [], []
    for group in (["fixed_k3", "lognormal_k3"], ["uniform_k1_5"]):  # Huginn's sampler against fixed K first, every seed
        for seed in seeds:  # seed-major: a partial result holds whole seeds
            for recipe in group:
                if common.CACHED_ONLY and not (OUT / f"chain-{recipe}-s{seed}.json").exists():
                    missing.append(dict(task="chain", recipe=recipe, seed=seed))
                else:
                    runs.append(chain_run(recipe, seed, chain_steps, cache=not quick))
            for recipe in group:
                row = lm_run(recipe, seed, lm_steps, batch)
                (runs.append(row) if row else missing.append(dict(task="lm", recipe=recipe, seed=seed)))
    finetune_steps = 20 if quick else FINETUNE_STEPS
    for seed in FINETUNE_SEEDS[:1] if quick else FINETUNE_SEEDS:
        for recipe in RECIPES:
            if common.CACHED_ONLY and not (OUT / f"finetune-{recipe}-s{seed}.json").exists():
                missing.append(dict(task="finetune", recipe=recipe, seed=seed))
            else:
                runs.append(finetune_run(recipe, seed, finetune_steps, cache=not quick))
    peaks = common_peaks(quick)
    memory = {name: dict(largest_k=sampler(name, 0).largest(), expected_k=sampler(name, 0).expected(), peak_bytes_at_k3=peaks[3],
                         peak_bytes_at_largest_k=peaks[sampler(name, 0).largest()]) for name in RECIPES}
    setting = dict(recipes=RECIPES, test_k=TEST_K, seeds=list(seeds), chain=dict(task=CHAIN_TASK, model=CHAIN_MODEL,
                   steps=chain_steps, batch=CHAIN_BATCH, lr=CHAIN_LR),
                   finetune=dict(start="chain_weights/asymloop_k3-s<seed> (converged at fixed K = 3)", steps=finetune_steps,
                                 seeds=list(FINETUNE_SEEDS[:1] if quick else FINETUNE_SEEDS), batch=CHAIN_BATCH, lr=CHAIN_LR),
                   lm=dict(steps=lm_steps, model="lm.LM, asymloop K=3"),
                   memory="system.peak_new_bytes of one LM forward+backward, batch 32 x 128, CPU fp32")
    return dict(setting=setting, runs=runs, missing=missing, memory=memory)
