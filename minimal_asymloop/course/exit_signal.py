"""Notebook 04: the exit rule's signal on a real model, KL(p_{k-1} || p_k) of the logit lens per iteration, by group."""

import numpy as np
import torch
from matplotlib.figure import Figure

from minimal_asymloop.course.adaptive import beaten_by_fixed
from minimal_asymloop.generate import iteration_kl

GROUP_COLORS = {"1-hop answers": "C2", "2-hop answers": "C0", "3-hop answers": "C3", "no target": "0.5"}


@torch.no_grad()
def kl_by_group(model, idx, targets, hops, max_iter: int = 6) -> dict[str, np.ndarray]:
    """{group: (n_positions, max_iter - 1) array of KL(p_{k-1} || p_k), k = 2..max_iter} from one plain forward at
    `max_iter` (every token runs every iteration: no exits, no frozen keys). Groups: answers by hop count, and the
    positions with no training target."""
    logp = [torch.log_softmax(model.logits(z).float(), -1) for z in model.states(idx, n_iter=max_iter)]
    kl = torch.stack([iteration_kl(a, b) for a, b in zip(logp, logp[1:])], -1)  # (B, T, K-1)
    groups = {f"{h}-hop answers": (targets >= 0) & (hops == h) for h in (1, 2, 3)}
    groups["no target"] = targets < 0
    return {g: kl[m].cpu().numpy() for g, m in groups.items()}


def median_at(kl: dict[str, np.ndarray], k: int = 2) -> dict[str, float]:
    """{group: median KL(p_{k-1} || p_k) at iteration k}."""
    return {g: float(np.median(v[:, k - 2])) for g, v in kl.items()}


def settled_share(kl: dict[str, np.ndarray], tau: float) -> dict[str, list[float]]:
    """{group: share of its positions whose KL is below tau, at k = 2..max_iter}: who the rule would stop there."""
    return {g: (v < tau).mean(0).tolist() for g, v in kl.items()}


def summary(kl: dict[str, np.ndarray], tau: float) -> str:
    """One line per group: its positions, median KL at k = 2, and the share below tau at each k."""
    share = settled_share(kl, tau)
    return "\n".join(f"{g:>14} ({len(v):,}): median KL at k=2 {np.median(v[:, 0]):.1e}; share below tau={tau:g} at k = 2.."
                     f"{v.shape[1] + 1}: " + " ".join(f"{x:.2f}" for x in share[g]) for g, v in kl.items())


def plot_kl_by_group(kl: dict[str, np.ndarray], tau: float) -> Figure:
    """Median KL(p_{k-1} || p_k) per iteration k (lines) with the middle half of positions (band), one colour per
    group, on a log axis, and the threshold tau (dashed): a group stops where its positions cross below the line."""
    fig = Figure(figsize=(9.5, 3.8))
    ax = fig.subplots()
    for g, v in kl.items():
        k = np.arange(2, v.shape[1] + 2)
        lo, med, hi = np.percentile(np.maximum(v, 1e-9), [25, 50, 75], axis=0)
        ax.plot(k, med, "o-", color=GROUP_COLORS[g], label=f"{g} ({len(v):,})")
        ax.fill_between(k, lo, hi, color=GROUP_COLORS[g], alpha=0.15)
    ax.axhline(tau, color="black", ls="--", lw=1, label=f"τ = {tau:g}")
    ax.set(yscale="log", xlabel="iteration k", ylabel=r"KL$(p_{k-1}\,\|\,p_k)$, nats", xticks=k,
           title="The exit signal on a trained model: median (line), middle half of positions (band)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: covers no band
    fig.tight_layout()
    return fig


def beaten(run: dict, n: int) -> dict:
    """Notebook 04's build step, the reference: {τ > 0: the cheapest fixed K as accurate as τ, within one standard error
    of the difference, for no more counted FLOPs (None: no fixed K)}, for one chain seed's sweep `run` with `n` scored
    answers. The package's general form, for any cost and metric, is `course.adaptive.beaten_by_fixed`."""
    return beaten_by_fixed(run, "flops_vs_max", "acc", n)


def exact(run: dict, n: int) -> dict:
    """A wrong version of `beaten`: "as accurate" compared exactly, without the standard error."""
    return {r["tau"]: min([f["k"] for f in run["fixed"] if f["acc"] >= r["acc"] and f["flops_vs_max"] <= r["flops_vs_max"]],
                          default=None) for r in run["adaptive"] if r["tau"] > 0}


def beaten_check(runs: list[dict], n: int):
    """A check for `beaten`: raises AssertionError, naming the seed, where a version's verdicts differ from the
    reference's on any of `runs`."""
    def check(f):
        for run in runs:
            got, want = f(run, n), beaten(run, n)
            assert got == want, f"seed {run['seed']}: got {got}, expected {want}"
    return check
