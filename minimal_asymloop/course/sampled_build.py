"""Notebook 05's build steps and live measurements: Huginn's depth sampler and truncated backprop through the loop,
each the reader writes and each checked against the package (depth.DepthSampler, LoopedLM.states(backprop_depth=n)).

The references here are what `course.build.yours_or_reference` falls back to; each check raises AssertionError on a
wrong version, in one line that says what differs."""

import math
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from minimal_asymloop.course.sampled_depth import KIND_COLORS
from minimal_asymloop.depth import SIGMA, DepthSampler
from minimal_asymloop.system import peak_new_bytes

DRAWS = 2000  # draws per setting in check_draw


def draw(mean: float, cap: int, g: torch.Generator) -> int:
    """The reference: one K from Huginn's log-normal Poisson, parametrized so that E[K] = mean before the cap."""
    mu = math.log(mean - 1) - SIGMA**2 / 2  # the rate's mean is mean - 1; K = 1 + Poisson(rate)
    rate = torch.zeros(1).log_normal_(mu, SIGMA, generator=g)
    return min(1 + int(torch.poisson(rate, generator=g)), cap)


def huginn_draw(mean: float, cap: int, g: torch.Generator) -> int:
    """The wrong version for this package's `mean`: Huginn's own convention, where `mean` is the rate's mean, so
    E[K] is one more (recpre/model_dynamic.py, randomized_iteration_sampler)."""
    rate = torch.zeros(1).log_normal_(math.log(mean) - SIGMA**2 / 2, SIGMA, generator=g)
    return min(1 + int(torch.poisson(rate, generator=g)), cap)


def draws(f, mean: float = 3.0, cap: int = 8, seed: int = 0, n: int = DRAWS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [f(mean, cap, g) for _ in range(n)]


def check_draw(f):
    """f(mean, cap, generator) -> K must draw what DepthSampler("lognormal_poisson") draws from the same seed, every time."""
    for mean, cap, seed in ((3.0, 8, 0), (3.024, 8, 1), (5.0, 12, 2)):
        ref = DepthSampler("lognormal_poisson", mean=mean, cap=cap, seed=seed)
        want, got = [ref.draw() for _ in range(DRAWS)], draws(f, mean, cap, seed)
        assert all(isinstance(k, int) for k in got), f"it returned {got[0]!r}, not an int K"
        wrong = sum(a != b for a, b in zip(got, want))
        assert wrong == 0, (f"mean={mean}, cap={cap}: {wrong:,} of {DRAWS:,} draws differ from DepthSampler's "
                            f"(mean K yours {sum(got) / DRAWS:.2f}, the package's {sum(want) / DRAWS:.2f})")


def fig_sampler(samples: list[int], mean: float = 3.0, cap: int = 8, who: str = "my_draw") -> Figure:
    """P(K) of four samplers with mean parameter 3 (fixed, uniform 1..5, ours, and Huginn's mu: the log-normal Poisson
    whose rate, not K, has mean 3), and the draws of `who` (the reader's, or the reference's until the reader's line
    exists) as a histogram on our sampler's bars."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ks, w = range(1, cap + 1), 0.21
    huginn = DepthSampler("lognormal_poisson", mean=mean + 1, cap=cap)  # Huginn's mu at `mean` is ours at mean + 1
    samplers = {"fixed K = 3": (DepthSampler("fixed", 3), {}), "uniform over 1..5": (DepthSampler("uniform", lo=1, hi=5), {}),
                f"ours: log-normal Poisson, mean {mean:g}, cap {cap}": (DepthSampler("lognormal_poisson", mean=mean, cap=cap), {}),
                f"Huginn's mu, mean {mean:g} (E[K] {huginn.expected():.2f})": (huginn, dict(hatch="//", fill=False))}
    for j, (name, (s, style)) in enumerate(samplers.items()):  # each sampler in its colour of every notebook 05 figure
        p = s.pmf()
        color = KIND_COLORS[s.kind]
        ax.bar([k + (j - 1.5) * w for k in ks], [p.get(k, 0) for k in ks], width=w, label=name, alpha=0.85,
               **({"color": color} if not style else dict(style, edgecolor=color)))
    ax.plot([k + 0.5 * w for k in ks], [samples.count(k) / len(samples) for k in ks], "k_", ms=8, mew=2,
            label=f"{who}: {len(samples):,} draws (share per K), on our bars")
    ax.set(xlabel="K drawn for one optimizer step", ylabel="probability", xticks=list(ks),
           title="Four ways to draw K, each with mean parameter 3")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def states(model, idx, K: int, n: int):
    """The reference: z_K of AsymLoop with a graph through the last n of K iterations only."""
    h = model.embed(idx)
    for blk in model.encoder:
        h = blk(h, model.rope)
    kv = model.global_kv(h)  # with a graph: the encoder learns through what every iteration reads
    return _loop(model, h, kv, K, n)


def _loop(model, z, kv, K: int, n: int):
    """K decoder iterations from z_0 = z, the first K - n without a graph."""
    for k in range(K):
        with torch.no_grad() if k < K - n else nullcontext():
            for blk, kv_l in zip(model.decoder, kv):
                z = blk(z, model.rope, kv_l)
    return z


def states_kv_cut(model, idx, K: int, n: int):
    """The wrong version: everything before the last n iterations without a graph, the encoder and Global KV included."""
    with torch.no_grad():
        h = model.embed(idx)
        for blk in model.encoder:
            h = blk(h, model.rope)
        kv = model.global_kv(h)
    return _loop(model, h, kv, K, n)


def grads(model, z_fn, idx, targets) -> dict[str, torch.Tensor | None]:
    """{parameter name: its gradient (None: none reached it)} of the cross-entropy of z_fn()'s logits."""
    model.zero_grad(set_to_none=True)
    logits = model.logits(z_fn())
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1).backward()
    out = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def check_states(f, model, idx, targets):
    """f(model, idx, K, n) -> z_K must give every parameter the gradient LoopedLM.states(backprop_depth=n) gives, bit for
    bit, at (K, n) = (4, 4), (4, 1) and (6, 2)."""
    for K, n in ((4, 4), (4, 1), (6, 2)):
        want = grads(model, lambda K=K, n=n: model.states(idx, K, backprop_depth=n)[-1], idx, targets)
        got = grads(model, lambda K=K, n=n: f(model, idx, K, n), idx, targets)
        none = [k for k in want if (got[k] is None) != (want[k] is None)]
        assert not none, f"K={K}, n={n}: {len(none)} parameters ({none[0]}, ...) get a gradient in one version only"
        diff = [k for k in want if want[k] is not None and not torch.equal(got[k], want[k])]
        assert not diff, f"K={K}, n={n}: {len(diff)} gradients ({diff[0]}, ...) differ from the package's"


PARTS = {"embedding": ("embed.",), "encoder": ("encoder.", "enc_norm."), "decoder's Global KV projections": ("_glob",),
         "decoder, the rest": ("decoder.",)}  # the first match names a parameter's part


def grad_norms(g: dict) -> dict[str, float]:
    """The gradient's norm over each part's parameters (PARTS; 0 where none reached them). The Global KV
    projections (wk_glob, wv_glob, k_glob_norm) live in the decoder's layers but act once, on the encoder's output."""
    part = {k: next((p for p, keys in PARTS.items() if any(key in k for key in keys)), None) for k in g}
    return {p: math.sqrt(sum(float(v.pow(2).sum()) for k, v in g.items() if part[k] == p and v is not None)) for p in PARTS}


def step_bytes(model, idx, targets, K: int, n: int | None = None) -> int:
    """The peak new memory (bytes of tensors, system.peak_new_bytes) of one training step's forward and backward at K
    iterations with a graph through the last n (None: all)."""
    def step():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets, n_iter=K, return_logits=False, backprop_depth=n)
        loss.backward()

    out = peak_new_bytes(step)
    model.zero_grad(set_to_none=True)
    return out


def by_backprop_depth(model, idx, targets, K: int = 8) -> dict[str, list[float]]:
    """At K iterations: for n = 1..K, one training step's peak new memory (step_bytes) and the cosine between the
    truncated gradient and the full one (all parameters flattened)."""

    def flat(n):
        g = grads(model, lambda: model.states(idx, K, backprop_depth=n)[-1], idx, targets)
        return torch.cat([v.flatten() if v is not None else torch.zeros(p.numel())
                          for v, p in zip(g.values(), model.parameters())])

    full = flat(K)
    out = dict(n=list(range(1, K + 1)), peak_bytes=[], cosine=[])
    for n in out["n"]:
        out["peak_bytes"].append(step_bytes(model, idx, targets, K, n))
        out["cosine"].append(float(torch.nn.functional.cosine_similarity(flat(n), full, dim=0)))
    model.zero_grad(set_to_none=True)
    return out


def fig_backprop_depth(m: dict, K: int, fixed3_bytes: int) -> Figure:
    """Two panels against n: one training step's peak new memory, and the cosine to the full gradient."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.3))
    a.plot(m["n"], [x / 2**20 for x in m["peak_bytes"]], "o-")
    a.axhline(fixed3_bytes / 2**20, ls="--", c="0.5")
    a.text(1, fixed3_bytes / 2**20, " fixed K = 3, full backprop", va="bottom", fontsize=8, color="0.35")
    a.set(xlabel=f"n: iterations with a graph (of K = {K})", ylabel="peak step memory (MiB)",
          title=f"K = {K}: every iteration with a graph adds memory", xticks=m["n"])
    b.plot(m["n"], m["cosine"], "o-", c="C2")
    b.set(xlabel=f"n: iterations with a graph (of K = {K})", ylabel=f"cosine to the full gradient at K = {K}",
          title="The truncated gradient points elsewhere", xticks=m["n"])
    fig.tight_layout()
    plt.close(fig)
    return fig
