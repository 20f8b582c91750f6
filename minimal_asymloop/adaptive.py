"""Adaptive per-token depth, measured (ours): compute saved against loss, and exit iterations by hop count.

    lm = sweep(model, idx, targets, taus=TAUS, max_iter=6)          # fixed K = 1..6 and each threshold: iterations, CE
    ch = sweep(model, idx, targets, TAUS, 6, hops=hops)             # chain task: + accuracy and exit iteration by hops
    chain_model(path), chain_batch()                                # a trained chain-task AsymLoop and its test programs

The mechanism (the exit rule and the Local KV reuse) lives in generate.py (`adaptive_states`, `adaptive_logits`);
`python -m minimal_asymloop.bench adaptive` runs both sweeps and docs/generation.md reports them.
"""

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minimal_asymloop.flops import flops_per_token
from minimal_asymloop.generate import adaptive_logits
from minimal_asymloop.paths import REPO, RESULTS

# exit thresholds (KL, nats) swept: 0 is fixed depth max_iter; Huginn's default for its KL rule is 1e-3
TAUS = (0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def flops_at(cfg, mean_iter: float, checks: float, seq_len: int) -> float:
    """Forward FLOPs per token (flops.flops_per_token's convention) at a mean of mean_iter decoder iterations,
    plus `checks` extra applications of the final norm and head (the logit lens read by the exit rule)."""
    f1 = flops_per_token(_at_k(cfg, 1), seq_len)
    per_iter = flops_per_token(_at_k(cfg, 2), seq_len)["total"] - f1["total"]
    return f1["total"] + per_iter * (mean_iter - 1) + f1["head"] * checks


def _at_k(cfg, k):
    from dataclasses import replace

    return replace(cfg, n_iter=k)


def _row(logits, targets, iters, hops=None) -> dict:
    """Scores of one depth setting: CE and accuracy on the scored positions (targets >= 0), mean iterations over
    every position (the compute) and over the scored ones; with hops, accuracy and mean iterations per hop count."""
    logits, scored = logits.float(), targets >= 0
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1).item()
    correct = logits.argmax(-1) == targets
    row = dict(mean_iter=iters.float().mean().item(), mean_iter_scored=iters[scored].float().mean().item(), ce=ce,
               acc=correct[scored].float().mean().item())
    if hops is not None:
        hs = sorted(h for h in hops.unique().tolist() if h > 0)
        row["acc_by_hops"] = {str(h): correct[hops == h].float().mean().item() for h in hs}
        row["iter_by_hops"] = {str(h): iters[hops == h].float().mean().item() for h in hs}
    return row


@torch.no_grad()
def sweep(model, idx, targets, taus=TAUS, max_iter: int | None = None, hops=None) -> dict:
    """Fixed K = 1..max_iter (one forward: the logit lens of each z_k) beside adaptive depth at each threshold.

    Each row: mean_iter (decoder iterations per token, all positions), ce, acc, flops_per_token (the exit rule's
    extra head applications included: one per iteration before the last) and flops_vs_max (/ fixed max_iter's).
    """
    cfg, seq = model.config, idx.size(1)
    max_iter = max_iter or cfg.n_iter
    fixed, adaptive = [], []
    for k, z in enumerate(model.states(idx, max_iter), 1):
        iters = torch.full_like(idx, k)
        fixed.append(dict(k=k, **_row(model.logits(z), targets, iters, hops), flops_per_token=flops_at(cfg, k, 0, seq)))
    for tau in taus:
        logits, iters, _ = adaptive_logits(model, idx, tau, max_iter)
        row = _row(logits, targets, iters, hops)
        checks = row["mean_iter"] - 1 if tau > 0 else 0.0  # tau = 0 never reads the lens before the last iteration
        adaptive.append(dict(tau=tau, **row, flops_per_token=flops_at(cfg, row["mean_iter"], checks, seq)))
    top = fixed[-1]["flops_per_token"]
    for r in fixed + adaptive:
        r["flops_vs_max"] = r["flops_per_token"] / top
    return dict(max_iter=max_iter, trained_n_iter=cfg.n_iter, fixed=fixed, adaptive=adaptive)


# ----------------------------------------------------------------------------- the chain task's trained models

CHAIN_SEEDS = (0, 1, 3)  # the asymloop_k3 seeds that converged (notebooks/results/chain_task.json)


def chain_model(path):
    """The chain task's AsymLoop E=D=1, K=3 (experiments.chain_models()["asymloop_k3"]) with weights from path."""
    from safetensors.torch import load_file

    from minimal_asymloop.experiments import chain as experiments  # the module, not the package: no import circle
    from minimal_asymloop.model import LoopedLM
    from minimal_asymloop.tasks import ChainTask

    model = LoopedLM(experiments.chain_models(ChainTask(**experiments.CHAIN_TASK))["asymloop_k3"])
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def chain_batch(n: int | None = None, seed: int = 1234):
    """(idx, targets, hops) of the held-out programs that experiments.chain_run scores (CHAIN_EVAL of them, seed 1234)."""
    from minimal_asymloop.experiments import chain as experiments  # the module, not the package: no import circle
    from minimal_asymloop.tasks import ChainTask

    task = ChainTask(**experiments.CHAIN_TASK)
    return task.batch(n or experiments.CHAIN_EVAL, torch.Generator().manual_seed(seed))


def mean_of(sweeps: list[dict]) -> dict:
    """Sweeps of equal-sized batches merged: every number the mean over the batches (so a token-weighted mean)."""
    def avg(vals):
        if isinstance(vals[0], dict):
            return {k: avg([v[k] for v in vals]) for k in vals[0]}
        if isinstance(vals[0], list):
            return [avg(list(v)) for v in zip(*vals)]
        return vals[0] if isinstance(vals[0], int) else sum(vals) / len(vals)

    return avg(sweeps)


# ----------------------------------------------------------------------------- python -m minimal_asymloop.bench adaptive


def bench(args):
    """Adaptive per-token depth against fixed K = 1..K_max, side by side: mean decoder iterations per token and
    validation cross-entropy of a trained LM checkpoint, then on the chain task (the committed asymloop_k3 weights,
    one model per seed) accuracy and mean exit iteration by hop count. Measures quality and compute (FLOPs), not time."""
    if args.threads:
        torch.set_num_threads(args.threads)
    taus = args.taus or list(TAUS)
    command = (f"python -m minimal_asymloop.bench adaptive --ckpt {args.ckpt or 'none'} --max-iter {args.max_iter} "
               f"--lm-windows {args.lm_windows} --seeds {' '.join(map(str, args.seeds))} --chain-max-iter {args.chain_max_iter}"
               + (f" --taus {' '.join(map(str, args.taus))}" if args.taus else "") + (f" --out {args.out}" if args.out else ""))
    report = dict(command=command, taus=taus, torch=torch.__version__)

    def show(title, sw, by_hops=False):
        print(f"\n{title} (K_max {sw['max_iter']}, trained K {sw['trained_n_iter']})")
        print(f"{'depth':>14} {'iters/token':>11} {'iters scored':>12} {'CE':>7} {'acc':>6} {'FLOPs vs K_max':>14}"
              + ("  acc by hops         iters by hops" if by_hops else ""))
        for r in sw["fixed"] + sw["adaptive"]:
            name = f"fixed K={r['k']}" if "k" in r else f"tau={r['tau']:g}"
            extra = ""
            if by_hops:
                extra = ("  " + " ".join(f"{a:.3f}" for a in r["acc_by_hops"].values())
                         + "   " + " ".join(f"{i:.2f}" for i in r["iter_by_hops"].values()))
            print(f"{name:>14} {r['mean_iter']:>11.2f} {r['mean_iter_scored']:>12.2f} {r['ce']:>7.4f} {r['acc']:>6.3f} "
                  f"{r['flops_vs_max']:>14.3f}{extra}")

    if args.ckpt and args.ckpt != "none":
        from minimal_asymloop.batches import eval_windows
        from minimal_asymloop.checkpoint import CheckpointError, load_model
        from minimal_asymloop.evaluate import held_out_tokens

        if not Path(args.ckpt).exists() and "/" in args.ckpt and args.ckpt.startswith("out"):
            raise SystemExit(f"error: no checkpoint at {args.ckpt}; make one with  python train_minimal.py  (the tiny "
                             f"AsymLoop K=3, a few minutes on a 2-core CPU), or pass --ckpt PATH, or --ckpt none for the chain task only")
        try:
            model, tokenizer, meta = load_model(args.ckpt)
        except CheckpointError as e:
            raise SystemExit(f"error: {e}") from None
        seq, chunk = meta["train_config"]["seq_len"], 8
        n = -(-args.lm_windows // chunk) * chunk
        tokens = held_out_tokens(meta, tokenizer, None, n * seq + 1, quiet=True)
        starts = eval_windows(tokens, seq, n)
        sweeps = []
        for c in range(0, n, chunk):
            w = torch.from_numpy(np.stack([tokens.window(int(s), seq + 1) for s in starts[c:c + chunk]]))
            sweeps.append(sweep(model, w[:, :-1], w[:, 1:], taus, args.max_iter))
        lm = mean_of(sweeps)
        ckpt = Path(meta["path"]).resolve()
        ckpt = ckpt.relative_to(REPO) if ckpt.is_relative_to(REPO) else ckpt
        report["lm"] = dict(ckpt=str(ckpt), step=meta.get("step"), model=model.config.to_dict(), seq_len=seq,
                            val_tokens=n * seq, **lm)
        show(f"LM {meta['path']} (step {meta.get('step')}), {n} held-out windows of {seq} tokens", lm)

    if args.seeds:
        weights = Path(args.chain_weights or RESULTS / "chain_weights")
        idx, targets, hops = chain_batch()
        runs = []
        for seed in args.seeds:
            path = weights / f"asymloop_k3-s{seed}.safetensors"
            if not path.exists():
                raise SystemExit(f"error: no chain-task weights at {path}; pass --chain-weights DIR or --seeds with "
                                 f"seeds whose weights exist (the committed ones: {', '.join(map(str, CHAIN_SEEDS))})")
            sw = sweep(chain_model(path), idx, targets, taus, args.chain_max_iter, hops=hops)
            runs.append(dict(seed=seed, **sw))
            show(f"chain task, asymloop_k3 seed {seed}, {len(idx)} held-out programs", sw, by_hops=True)
        where = weights.resolve()
        report["chain"] = dict(weights=str(where.relative_to(REPO) if where.is_relative_to(REPO) else where),
                               programs=len(idx), runs=runs)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return report
