"""Adaptive per-token depth, measured (ours): compute saved against loss, and exit iterations by hop count.

    lm = sweep(model, idx, targets, taus=TAUS, max_iter=6)          # fixed K = 1..6 and each threshold: iterations, CE
    ch = sweep(model, idx, targets, TAUS, 6, hops=hops)             # chain task: + accuracy and exit iteration by hops
    chain_model(path), chain_batch()                                # a trained chain-task AsymLoop and its test programs

The mechanism (the exit rule and the Local KV reuse) lives in generate.py (`adaptive_states`, `adaptive_logits`);
`python -m minimal_asymloop.bench adaptive` runs both sweeps and docs/generation.md reports them.
"""

import torch
import torch.nn.functional as F

from minimal_asymloop.flops import flops_per_token
from minimal_asymloop.generate import adaptive_logits

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

    from minimal_asymloop import experiments
    from minimal_asymloop.model import LoopedLM
    from minimal_asymloop.tasks import ChainTask

    model = LoopedLM(experiments.chain_models(ChainTask(**experiments.CHAIN_TASK))["asymloop_k3"])
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def chain_batch(n: int | None = None, seed: int = 1234):
    """(idx, targets, hops) of the held-out programs that experiments.chain_run scores (CHAIN_EVAL of them, seed 1234)."""
    from minimal_asymloop import experiments
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
