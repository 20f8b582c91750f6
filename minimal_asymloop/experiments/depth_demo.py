"""Looping helps, in a minute (notebook 00's closing demo): one AsymLoop (E = D = 1), one random draw of initial weights and the
same programs, trained at K = 1 and at K = 3 on binding chains (tasks.ChainTask) for a budget that fits a live notebook
cell; accuracy by hop count on held-out programs every DEMO_CHECK steps, 5 seeds.

Each run is cached in out/experiments/depth_demo/k<K>-s<seed>.json, keyed by its setting.
"""

import json
import time

import torch

from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.common import RUNS, write_json
from minimal_asymloop.flops import count_params
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, train_on_task

# (ours) chains of up to 3 hops: a statement h hops deep needs about h blocks in sequence (tasks.py), so K = 1
# (effective depth 2) falls one block short on 3 hops and K = 3 (depth 4) has one to spare
DEMO_TASK = dict(n_stmt=8, max_hops=3, n_vars=8, n_values=4)
DEMO_MODEL = dict(d_model=64, n_head=4, d_ff=128, qk_norm=True)
DEMO_KS = (1, 3)
DEMO_SEEDS = (0, 1, 2, 3, 4)
DEMO_STEPS = 1000  # every run trains this long (no early stop), so K = 1 and K = 3 get the same budget
DEMO_BATCH = 32
DEMO_LR = 3e-3
DEMO_CHECK = 100  # steps between accuracy checks
DEMO_EVAL = 256  # held-out programs per check (one fixed generator seed, apart from the training streams)


def demo_config(n_iter: int, task: ChainTask | None = None) -> ModelConfig:
    """The demo's AsymLoop, E = D = 1, at K = n_iter: its parameters do not depend on K."""
    task = task or ChainTask(**DEMO_TASK)
    return ModelConfig(arch="asymloop", n_layer=2, n_iter=n_iter, vocab_size=task.vocab_size, max_seq_len=task.seq_len,
                       **DEMO_MODEL)


def demo_model(n_iter: int, seed: int = 0) -> LoopedLM:
    """The demo model at K = n_iter, initialised from the seed: one random draw at every K (K changes no parameter
    shape); only the blocks' output projections are scaled by 1/sqrt(2·effective depth), as LoopedLM initialises them."""
    torch.manual_seed(seed)
    return LoopedLM(demo_config(n_iter))


def demo_train(n_iter: int, seed: int = 0, steps: int = DEMO_STEPS, lr: float = DEMO_LR, batch: int = DEMO_BATCH):
    """Train the demo model at K = n_iter from the seed's initial weights; return (run dict, trained model)."""
    task = ChainTask(**DEMO_TASK)
    model = demo_model(n_iter, seed)
    curve = [(0, accuracy_by_hops(model, task, n=DEMO_EVAL))]  # (step, {hops: accuracy}) on the same held-out programs

    def check(step, m):
        curve.append((step, accuracy_by_hops(m, task, n=DEMO_EVAL)))
        return False  # no early stop: both K train for the whole budget

    t0, c0 = time.time(), time.process_time()
    train_on_task(model, task, steps=steps, batch_size=batch, lr=lr, seed=seed, check_every=min(DEMO_CHECK, steps), check=check)
    run = dict(n_iter=n_iter, seed=seed, steps=steps, params=count_params(model.config), seconds=time.time() - t0,
               cpu_seconds=time.process_time() - c0, curve=[(s, {str(h): a for h, a in acc.items()}) for s, acc in curve])
    return run, model


def demo_setting(steps: int) -> dict:
    return dict(task=DEMO_TASK, model=DEMO_MODEL, steps=steps, batch=DEMO_BATCH, lr=DEMO_LR, check_every=DEMO_CHECK,
                eval_programs=DEMO_EVAL)


def depth_demo(quick=False):
    """Looping helps: AsymLoop (E = D = 1) at K = 1 and K = 3, the same random init and data, binding chains of
    1-3 hops, a fixed budget that fits a live notebook cell, 5 seeds; accuracy by hops during training."""
    steps, seeds = (40, common.SEEDS[:1]) if quick else (DEMO_STEPS, common.SEEDS if common.SEEDS_SET else DEMO_SEEDS)
    setting = demo_setting(steps)
    runs = []
    for seed in seeds:
        for k in DEMO_KS:
            path = RUNS / "depth_demo" / f"k{k}-s{seed}.json"
            if not quick and path.exists() and json.loads(path.read_text())["setting"] == setting:
                runs.append(json.loads(path.read_text())["run"])
                continue
            run, _ = demo_train(k, seed, steps)
            final = run["curve"][-1][1]
            print(f"  K={k} seed {seed}: accuracy by hops {({h: round(a, 2) for h, a in final.items()})} "
                  f"({run['seconds']:.0f} s, {run['cpu_seconds']:.0f} CPU s)", flush=True)
            if not quick:  # a --quick run is not cached: it would overwrite a real run of the same K and seed
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, dict(setting=setting, run=run))
            runs.append(run)
    return dict(setting=dict(setting, seeds=list(seeds)), runs=runs)
