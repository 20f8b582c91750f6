"""Longer experiments behind the notebooks, precomputed on a CPU into small JSON files.

    python -m minimal_asymloop.experiments all            # every experiment (CPU-hours; the notebooks print each cost)
    python -m minimal_asymloop.experiments matched_depth  # one of: matched_depth, global_kv, chain_task, chain_context, alrs,
                                                          # depth_demo, sampled_depth
    python -m minimal_asymloop.experiments --list

Results go to notebooks/results/<name>.json, which the notebooks plot. All LM runs share one tiny setting
(ours, sized for a CPU): the stdlib corpus with a 1024-token BPE, d_model 64, L = 4 (E = D = 2), 4 heads,
d_ff 256, seq 128, batch 32, 200 steps (0.82M tokens, about 2 tokens per parameter), uniform LR, QKNorm on in
EVERY model (as in the paper's context-access study), so architectures differ only in what the paper varies.
Every arm runs at seeds 0, 1, 2, compared within a seed (same init seed, same data order).

chain_task trains small models on a synthetic task that needs depth (tasks.ChainTask) until converged or a step limit, and
chain_context compares context access on it at matched depth; depth_demo is notebook 00's K = 1 against K = 3 on
that task at a short budget; alrs is the ALRS study of notebook 06; sampled_depth compares fixed K = 3 with sampled K
(--depth-sampler) on the tiny LM and the chain task; each has a setting of its own. One module per family: lm.py
(matched_depth, global_kv), chain.py (chain_task, chain_context), depth_demo.py, alrs_study.py (alrs), sampled_depth.py,
common.py (run settings, reuse of finished and committed runs).

Runs committed in notebooks/results/*.json at the same setting are reused as they are, so a fresh clone trains only
what is missing (an added arm, a new seed); --fresh trains everything again. Runs finished locally are cached in
out/experiments/ as well, so an interrupted command continues where it stopped; --cached-only writes the JSON from
the finished runs alone and lists the missing arms. Every JSON records the command and each run's `seconds` (1 thread
on a shared 2-core machine, so they depend on the load); the notebooks print the totals.
"""

# ruff: noqa: F401 (the package re-exports each module's public names: ex.lm_config, ex.chain_task, ...)

import argparse
import sys
import time
from pathlib import Path

import torch

from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.alrs_study import (
    ALRS_LM,
    ALRS_LRS,
    ALRS_SCHEDULE,
    ALRS_STEPS,
    ALRS_TRAIN,
    SPECTRA,
    PinnedTop,
    alrs_arm,
    alrs_experiment,
    alrs_records,
    alrs_spectra,
    arm_setup,
    best_lr,
    setting_of,
)
from minimal_asymloop.experiments.chain import (
    CHAIN_BATCH,
    CHAIN_CHECK,
    CHAIN_CONVERGED,
    CHAIN_EVAL,
    CHAIN_LR,
    CHAIN_MODEL,
    CHAIN_SEEDS,
    CHAIN_STEPS,
    CHAIN_TASK,
    CONTEXT_ARMS,
    ChainTask,
    chain_context,
    chain_grid,
    chain_models,
    chain_run,
    chain_setting,
    chain_task,
)
from minimal_asymloop.experiments.common import CONTEXTS, RUNS, committed, committed_rows, describe_budget, finished, train_lm, write_json
from minimal_asymloop.experiments.depth_demo import (
    DEMO_CHECK,
    DEMO_FRESH,
    DEMO_STEPS,
    DEMO_TASK,
    demo_config,
    demo_model,
    demo_train,
    depth_demo,
)
from minimal_asymloop.experiments.lm import (
    LM,
    MATCHED_DEPTH,
    MAX_TEST_K,
    TRAIN,
    global_kv,
    lm_config,
    lm_setting,
    matched_depth,
    probe_batch,
    probes,
    run_arms,
    run_lm,
    train_config,
)
from minimal_asymloop.experiments.sampled_depth import sampled_depth
from minimal_asymloop.paths import REPO, RESULTS

EXPERIMENTS = {"matched_depth": matched_depth, "global_kv": global_kv, "chain_task": chain_task, "chain_context": chain_context,
                "alrs": alrs_experiment, "depth_demo": depth_demo, "sampled_depth": sampled_depth}
SETTINGS = ("STEPS", "STEPS_SET", "SEEDS", "SEEDS_SET", "CACHED_ONLY", "FRESH")  # the run settings main() sets


def __getattr__(name):
    """ex.SEEDS and the other run settings read common's current value (main() sets them there)."""
    if name in SETTINGS:
        return getattr(common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minimal_asymloop.experiments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"experiments to run: all or any of {', '.join(EXPERIMENTS)}")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--quick", action="store_true", help="a few steps each, to check the pipeline (results NOT for the notebooks)")
    p.add_argument("--seeds", type=int, nargs="+", help=f"seeds to run (default {' '.join(map(str, common.SEEDS))}; chain_task: "
                   f"{' '.join(map(str, CHAIN_SEEDS))})")
    p.add_argument("--steps", type=int, help=f"LM experiments: training steps per run (default {common.STEPS})")
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
    common.SEEDS, common.STEPS, common.STEPS_SET = tuple(args.seeds or common.SEEDS), args.steps or common.STEPS, args.steps
    common.CACHED_ONLY, common.FRESH, common.SEEDS_SET = args.cached_only, args.fresh, bool(args.seeds)
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
                      cached_only=common.CACHED_ONLY)  # True: `seconds` is the probing time; each run's `seconds` is its training
        path = out / f"{name}{'_quick' if args.quick else ''}.json"
        write_json(path, result)
        print(f"  wrote {path} ({result['seconds']:.0f}s)", flush=True)
