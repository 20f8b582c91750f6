"""Looping helps, in a minute (notebook 00's closing demo): the chain_task experiment's AsymLoop (E = D = 1) at K = 1
and at K = 3, trained on binding chains (tasks.ChainTask) with chain_task's exact recipe (its 6,000-step LR schedule,
its batches, its early stop once every hop count is at 0.99) but cut at a budget that fits a live notebook cell.

Each run is cached in out/experiments/depth_demo/k<K>-s<seed>.json (K = 1 from K = 3's initial weights:
k1-init3-s<seed>.json), keyed by its setting.
"""

import json
import time

import torch

from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.chain import CHAIN_BATCH, CHAIN_CONVERGED, CHAIN_EVAL, CHAIN_LR, CHAIN_MODEL, CHAIN_STEPS, CHAIN_TASK
from minimal_asymloop.experiments.common import RUNS, write_json
from minimal_asymloop.flops import count_params
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, train_on_task

DEMO_TASK = CHAIN_TASK  # chains of 1-3 hops over 8 statements (experiments.chain)
DEMO_KS = (1, 3)
DEMO_SEEDS = (0, 1, 2, 3, 4)
DEMO_STEPS = 1000  # (ours) the budget: a run stops here, or earlier once converged
DEMO_CHECK = 125  # steps between checks of the early stop (chain_task checks every 250: a check changes no weight)
DEMO_FRESH = 4321  # (ours) generator seed of the programs the final score uses: not the early stop's (seed 1234)
DEMO_FRESH_N = 1024


def demo_config(n_iter: int, task: ChainTask | None = None) -> ModelConfig:
    """chain_task's AsymLoop, E = D = 1, at K = n_iter: its parameters do not depend on K."""
    task = task or ChainTask(**DEMO_TASK)
    return ModelConfig(arch="asymloop", n_layer=2, n_iter=n_iter, vocab_size=task.vocab_size, max_seq_len=task.seq_len,
                       **CHAIN_MODEL)


def demo_model(n_iter: int, seed: int = 0, init_iter: int | None = None) -> LoopedLM:
    """The demo model at K = n_iter, initialised as chain_run initialises it: one random draw at every K, except that
    LoopedLM scales the blocks' output projections by 1/sqrt(2·effective depth), so K = 1 and K = 3 start a factor
    sqrt(2) apart there. init_iter: start from the K = init_iter model's weights instead (the same parameters at
    every K), so that K alone differs."""
    torch.manual_seed(seed)
    model = LoopedLM(demo_config(n_iter))
    if init_iter is not None and init_iter != n_iter:
        torch.manual_seed(seed)
        model.load_state_dict(LoopedLM(demo_config(init_iter)).state_dict())
    return model


def demo_train(n_iter: int, seed: int = 0, steps: int = DEMO_STEPS, init_iter: int | None = None):
    """Train the demo model at K = n_iter (from the K = init_iter model's weights, if given) with chain_task's recipe
    (LR schedule over CHAIN_STEPS) until converged or `steps`; return (run dict, trained model). The run's final
    score uses fresh programs (DEMO_FRESH)."""
    task = ChainTask(**DEMO_TASK)
    model = demo_model(n_iter, seed, init_iter)
    curve = [(0, accuracy_by_hops(model, task, n=CHAIN_EVAL))]  # (step, {hops: accuracy}) on the early stop's programs

    def check(step, m):
        curve.append((step, accuracy_by_hops(m, task, n=CHAIN_EVAL)))
        return min(curve[-1][1].values()) >= CHAIN_CONVERGED or step >= steps

    t0, c0 = time.time(), time.process_time()
    losses = train_on_task(model, task, steps=CHAIN_STEPS, batch_size=CHAIN_BATCH, lr=CHAIN_LR, seed=seed,
                           check_every=min(DEMO_CHECK, steps), check=check)
    seconds, cpu = time.time() - t0, time.process_time() - c0
    converged = min(curve[-1][1].values()) >= CHAIN_CONVERGED
    fresh = accuracy_by_hops(model, task, n=DEMO_FRESH_N, seed=DEMO_FRESH)
    run = dict(n_iter=n_iter, seed=seed, init_iter=init_iter or n_iter, steps=len(losses), converged_at=len(losses) if converged else None,
               params=count_params(model.config), seconds=seconds, cpu_seconds=cpu,
               curve=[(s, {str(h): a for h, a in acc.items()}) for s, acc in curve],
               fresh={str(h): a for h, a in fresh.items()})
    return run, model


def demo_setting(steps: int) -> dict:
    return dict(task=DEMO_TASK, model=CHAIN_MODEL, steps=steps, schedule_steps=CHAIN_STEPS, batch=CHAIN_BATCH, lr=CHAIN_LR,
                check_every=DEMO_CHECK, converged=CHAIN_CONVERGED, eval_programs=CHAIN_EVAL,
                fresh_programs=DEMO_FRESH_N, fresh_seed=DEMO_FRESH)


def depth_demo(quick=False):
    """Looping helps: AsymLoop (E = D = 1) at K = 1 and K = 3, chain_task's recipe cut at DEMO_STEPS steps, 5 seeds;
    accuracy by hops during training, steps to converge, and the final score on fresh programs. `same_init`: K = 1
    trained from K = 3's initial weights (demo_model's init_iter), so that K alone differs from the K = 3 run."""
    steps, seeds = (40, common.SEEDS[:1]) if quick else (DEMO_STEPS, common.SEEDS if common.SEEDS_SET else DEMO_SEEDS)
    setting = demo_setting(steps)
    runs, same_init = [], []
    for seed in seeds:
        for k, init in [(k, k) for k in DEMO_KS] + [(1, 3)]:
            name = f"k{k}-s{seed}" if init == k else f"k{k}-init{init}-s{seed}"
            path = RUNS / "depth_demo" / f"{name}.json"
            if not quick and path.exists() and json.loads(path.read_text())["setting"] == setting:
                run = json.loads(path.read_text())["run"]
            else:
                run, _ = demo_train(k, seed, steps, init_iter=init)
                print(f"  {name}: {run['steps']} steps, converged at {run['converged_at']}, fresh accuracy "
                      f"{ {h: round(a, 3) for h, a in run['fresh'].items()} } ({run['seconds']:.0f} s, "
                      f"{run['cpu_seconds']:.0f} CPU s)", flush=True)
                if not quick:  # a --quick run is not cached: it would overwrite a real run of the same K and seed
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_json(path, dict(setting=setting, run=run))
            (runs if init == k else same_init).append(run)
    return dict(setting=dict(setting, seeds=list(seeds)), runs=runs, same_init=same_init)
