"""Notebook 04's figures and tables: adaptive per-token depth read from notebooks/results/adaptive.json
(`python -m minimal_asymloop.bench adaptive`), so that its cells show the rule and the result, not the plotting; and the
references for the reader's build in section 2 (`Frozen`, `adaptive_loop`, with `check_frozen` and `check_loop`)."""

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

MARKERS = ("o", "s", "^")  # one per chain seed
HOP_COLORS = {"1": "C0", "2": "C2", "3": "C3"}
# offsets (points) that keep the LM figure's τ labels apart
TAU_OFFSETS = {1e-4: (4, 7), 1e-3: (4, -13), 3e-3: (-52, 5), 1e-2: (6, -12), 3e-2: (6, -13), 0.1: (6, 5)}


def name(row: dict) -> str:
    """A sweep row's label: fixed depth `K=k` or the threshold `tau=τ`."""
    return f"K={row['k']}" if "k" in row else f"tau={row['tau']:g}"


def at_tau(rows: list[dict], tau: float) -> dict:
    """The adaptive row at threshold `tau`."""
    found = [r for r in rows if r["tau"] == tau]
    if not found:
        raise ValueError(f"no adaptive row at tau={tau:g}; the sweep has {[r['tau'] for r in rows]}")
    return found[0]


def exit_gap(run: dict, tau: float) -> float:
    """3-hop minus 1-hop mean exit iteration of a chain run's answers at `tau`."""
    it = at_tau(run["adaptive"], tau)["iter_by_hops"]
    return it["3"] - it["1"]


def se_diff(p: float, q: float, n: int) -> float:
    """The binomial standard error of the difference of two accuracies p and q, each on n answers."""
    return ((p * (1 - p) + q * (1 - q)) / n) ** 0.5


def as_good(a: dict, b: dict, metric: str, n: int | None = None) -> bool:
    """Is sweep row `a` at least as good as row `b` in `metric`? Accuracy ("acc") on `n` scored answers allows one
    binomial standard error of the difference, sqrt((p_a(1-p_a) + p_b(1-p_b)) / n); CE ("ce") has no stored
    per-token losses, hence no standard error, and is compared exactly."""
    if metric == "acc":
        tol = 0.0 if n is None else se_diff(a["acc"], b["acc"], n)
        return a["acc"] >= b["acc"] - tol
    if metric == "ce":
        return a["ce"] <= b["ce"]
    raise ValueError(f"metric must be 'acc' or 'ce', got {metric!r}")


def cheaper_and_as_good(adaptive: list[dict], ref: dict, metric: str, n: int | None = None) -> list[float]:
    """Thresholds τ > 0 as good as `ref` in `metric` (see `as_good`) for fewer FLOPs than `ref`."""
    return [r["tau"] for r in adaptive if r["tau"] > 0 and as_good(r, ref, metric, n)
            and r["flops_vs_max"] < ref["flops_vs_max"]]


def beaten_by_fixed(sweep: dict, x: str = "mean_iter", metric: str = "ce", n: int | None = None) -> dict:
    """{τ: the smallest fixed K as good as τ in `metric` (see `as_good`) for no more `x` (None: no fixed depth)}, τ > 0.
    `sweep` is the LM's or one chain seed's dict with "fixed" and "adaptive" rows."""
    out = {}
    for r in sweep["adaptive"]:
        if r["tau"] > 0:
            ks = [f["k"] for f in sweep["fixed"] if as_good(f, r, metric, n) and f[x] <= r[x]]
            out[r["tau"]] = min(ks) if ks else None
    return out


def mix_acc(fixed: list[dict], x: float, key: str = "flops_vs_max") -> float:
    """The best accuracy at cost `x` (in `key`) of a per-sequence mix of fixed depths: a share of the sequences runs at
    one fixed K and the rest at another, so cost and accuracy both move linearly between the two. One fixed K is a mix
    too. The best pair may skip a depth; notebook 05's frontier (`sampled_depth._frontier`) joins adjacent depths only,
    the same line wherever no fixed K falls below the line joining its neighbours."""
    pts = [(f[key], f["acc"]) for f in fixed]
    best = [a for c, a in pts if c <= x]
    best += [a1 + (a2 - a1) * (x - c1) / (c2 - c1) for c1, a1 in pts for c2, a2 in pts if c1 < x <= c2]
    return max(best, default=0.0)


def beaten_by_mix(sweep: dict, n: int, key: str = "flops_vs_max") -> dict[float, bool]:
    """{τ: is a mix of fixed depths (`mix_acc`) as accurate (see `as_good`) at τ's cost}, τ > 0."""
    return {r["tau"]: as_good({"acc": mix_acc(sweep["fixed"], r[key], key)}, r, "acc", n)
            for r in sweep["adaptive"] if r["tau"] > 0}


def plot_lm(lm: dict) -> Figure:
    """Held-out CE against iterations per token and against FLOPs: fixed K = 1..K_max and the adaptive rule."""
    fig = Figure(figsize=(10, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    ad = [r for r in lm["adaptive"] if r["tau"] > 0]
    for ax, x, label in [(axes[0], "mean_iter", "decoder iterations per token"),
                         (axes[1], "flops_vs_max", f"forward FLOPs per token (/ fixed K={lm['max_iter']})")]:
        ax.plot([r[x] for r in lm["fixed"]], [r["ce"] for r in lm["fixed"]], "o-", color="k",
                label=f"fixed K = 1..{lm['max_iter']}")
        ax.plot([r[x] for r in ad], [r["ce"] for r in ad], "s--", color="C1", label="adaptive, τ > 0")
        seen = []  # thresholds that land on (nearly) the same point share one label
        for r in ad:
            pt = (round(r[x], 1), round(r["ce"], 2))
            if pt in seen:
                continue
            same = [f"{q['tau']:g}" for q in ad if (round(q[x], 1), round(q["ce"], 2)) == pt]
            seen.append(pt)
            ax.annotate("τ=" + ", ".join(same), (r[x], r["ce"]), textcoords="offset points", fontsize=8,
                        xytext=TAU_OFFSETS.get(r["tau"], (5, 6)))
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out cross-entropy (nats/token)")
    axes[0].legend(loc="upper right")
    fig.suptitle(f"Tiny LM (trained at K={lm['trained_n_iter']}, step {lm['step']}): "
                 "the rule beats K_max, not the trained depth")
    fig.tight_layout()
    return fig


def plot_chain(runs: list[dict]) -> Figure:
    """Answers' mean exit iteration by hop count (colour) against τ, one marker per seed, beside the rule's minimum
    of 2 iterations."""
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for run, m in zip(runs, MARKERS):
        ad = [r for r in run["adaptive"] if r["tau"] > 0]
        for h, color in HOP_COLORS.items():
            ax.plot([r["tau"] for r in ad], [r["iter_by_hops"][h] for r in ad], m, ls="-", lw=0.8, color=color,
                    alpha=0.8, label=f"{h}-hop answers" if run is runs[0] else None)
        ax.plot([], [], m, color="0.4", ls="none", label=f"seed {run['seed']}")
    ax.axhline(2, ls=":", c="gray")
    ax.set(xscale="log", xlabel="exit threshold τ (KL, nats)", ylabel="mean exit iteration of the answers",
           title="Answers with more hops stop later; every answer runs at least 2")
    ax.text(ax.get_xlim()[0] * 1.3, 2.03, "the rule's minimum (2)", color="0.4", fontsize=8)  # on the log axis
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def lm_table(lm: dict) -> str:
    """The LM sweep, one line per fixed depth and threshold."""
    lines = [f"{'depth':>11} {'iters/token':>11} {'CE':>7} {'FLOPs vs K=' + str(lm['max_iter']):>12}"]
    lines += [f"{name(r):>11} {r['mean_iter']:>11.2f} {r['ce']:>7.4f} {r['flops_vs_max']:>12.3f}"
              for r in lm["fixed"] + lm["adaptive"]]
    return "\n".join(lines)


def chain_table(runs: list[dict]) -> str:
    """Every chain seed's sweep: iterations per token, accuracy and mean exit iteration by hop count."""
    lines = [f"{'seed':>4} {'depth':>10} {'iters/token':>11} {'acc 1/2/3 hops':>20} {'exit iteration 1/2/3 hops':>26}"]
    for run in runs:
        for r in run["fixed"] + run["adaptive"]:
            acc = " ".join(f"{a:.3f}" for a in r["acc_by_hops"].values())
            it = " ".join(f"{a:.2f}" for a in r["iter_by_hops"].values())
            lines.append(f"{run['seed']:>4} {name(r):>10} {r['mean_iter']:>11.2f} {acc:>20} {it:>26}")
    return "\n".join(lines)


def plot_exit_grid(exit_iter, hops, max_iter: int, tau: float, tokens: list[str] | None = None) -> Figure:
    """One program's tokens (columns) × decoder iterations (rows): green where the token ran that iteration, grey
    where it had stopped, labelled with the iteration whose Local KV it shows later tokens there. `hops` (T,) is the
    answer's hop count at answer positions and 0 elsewhere; exit_iter (T,) the iterations each token ran; `tokens`
    (T,) the program's characters (chain_chars), written under each column."""
    exit_iter, hops = np.asarray(exit_iter), np.asarray(hops)
    t = len(exit_iter)
    k = np.arange(1, max_iter + 1)[:, None]
    fig = Figure(figsize=(min(14, 0.42 * t + 2), 3.8))
    ax = fig.subplots()
    ax.imshow((k <= exit_iter[None]).astype(float), cmap=ListedColormap(["#DDDDDD", "#55A868"]), aspect="auto",
              origin="lower", extent=(-0.5, t - 0.5, 0.5, max_iter + 0.5), vmin=0, vmax=1)
    for pos in range(t):
        for it in range(exit_iter[pos] + 1, max_iter + 1):
            ax.text(pos, it, str(exit_iter[pos]), ha="center", va="center", fontsize=9, color="#444444")
    chars = tokens or [""] * t
    ax.set_xticks(range(t), [f"{c}\n{h}h" if h else c for c, h in zip(chars, hops)], fontsize=9)
    ax.set(xlabel="the program, one token per column (answers: the hop count under them)", ylabel="decoder iteration",
           yticks=range(1, max_iter + 1),
           title=f"Where each token stops (τ = {tau:g}): green = ran; grey = stopped, "
                 "showing later tokens the Local KV of the iteration written in it")
    fig.tight_layout()
    return fig


def chain_chars(ids) -> list[str]:
    """The characters of one chain-task program (a row of chain_batch's idx), one per position."""
    from minimal_asymloop.experiments.chain import CHAIN_TASK
    from minimal_asymloop.tasks import ChainTask

    task = ChainTask(**CHAIN_TASK)
    return [task.decode([i]) for i in ids.tolist()]


# the schematic's tokens: the KL of successive logit lenses, KL(p_{k-1} || p_k), after iterations k = 2, 3, ... (made up)
SCHEMATIC_KL = ([0.03], [2.1, 0.8, 0.3], [0.9, 0.05], [0.02], [1.5, 0.4, 0.06])


def plot_exit_mechanism(kl=SCHEMATIC_KL, tau: float = 0.1, max_iter: int = 4) -> Figure:
    """The exit rule drawn (a schematic with made-up KL values): left, tokens (columns) × decoder iterations (rows),
    each token running until KL(p_{k-1} || p_k) < τ or K_max, then showing later tokens its frozen Local KV, with the
    arrows of one query reading that row, above the Global KV made once; right, each token's KL falling towards τ."""
    settled = [next((k for k, v in enumerate(row, 2) if v < tau), None) for row in kl]
    exits = [k or max_iter for k in settled]
    fig = Figure(figsize=(12.5, 5))
    grid, curve = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1.55, 1]))
    t = len(kl)
    grid.add_patch(_box((t - 1) / 2, 0, "#C9DDF0", width=t - 0.12))
    grid.text((t - 1) / 2, 0, "Global KV: made once from the encoder output, read unchanged at every iteration",
              ha="center", va="center", fontsize=9)
    for pos, (row, j) in enumerate(zip(kl, exits)):
        for k in range(1, max_iter + 1):
            ran = k <= j
            grid.add_patch(_box(pos, k, "#55A868" if ran else "#EEEEEE"))
            text = (f"$z_{k}$, $K^L_{k}$" + ("" if k == 1 else f"\nKL {row[k - 2]:g}")) if ran else f"$K^L_{j}$ (frozen)"
            grid.text(pos, k, text, ha="center", va="center", fontsize=8.5, color="k" if ran else "0.3")
        grid.plot([pos - 0.44, pos + 0.44], [j + 0.43] * 2, c="C3", lw=3)  # the exit
    q = t - 1  # the last token's query at the top iteration reads every earlier token's Local KV there
    for pos in range(q):
        grid.annotate("", (pos, max_iter + 0.5), (q - 0.2, max_iter + 0.5), arrowprops=dict(
            arrowstyle="->", color="C0", lw=1.2, connectionstyle=f"arc3,rad={0.1 + 0.04 * (q - pos)}"))
    grid.text((q - 1) / 2, max_iter + 1.25, f"token {q + 1}'s query at iteration {max_iter} reads each earlier "
              f"token's Local KV: frozen ones give their exit iteration's", ha="center", fontsize=8, color="C0")
    ticks = [f"token {p + 1}\nexit after {j}" + ("" if s else "\n(K_max)") for p, (j, s) in enumerate(zip(exits, settled))]
    grid.set(xlim=(-0.6, t - 0.4), ylim=(-0.5, max_iter + 1.5), xticks=range(t), xticklabels=ticks, yticks=range(1, max_iter + 1),
             ylabel="decoder iteration k", title=f"Each token stops at its own iteration (red bar; τ = {tau:g}, K_max = {max_iter})")
    grid.spines[["top", "right"]].set_visible(False)
    for pos, (row, j) in enumerate(zip(kl, exits)):
        curve.plot(range(2, 2 + len(row)), row, "o-", color=f"C{pos}", label=f"token {pos + 1}: stops after {j}")
    curve.axhline(tau, ls="--", c="k", lw=1)
    curve.text(2.05, tau * 1.15, f"τ = {tau:g}: stop below", ha="left", va="bottom", fontsize=8)
    curve.set(yscale="log", xticks=range(2, max_iter + 1), xlabel="iteration k",
              ylabel=r"KL($p_{k-1}\,\|\,p_k$) (nats)", title="The exit signal: successive logit lenses settle")
    curve.legend(fontsize=8, loc="upper right")
    curve.grid(alpha=0.3)
    fig.suptitle("The adaptive loop (schematic, made-up KL values)", fontsize=11)
    fig.tight_layout()
    return fig


def _box(x, y, color, width=0.88):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x - width / 2, y - 0.36), width, 0.72, boxstyle="round,pad=0.02", fc=color, ec="0.5", lw=0.8)


# ---- the reader's build (section 2): references that course.build.yours_or_reference falls back on ----

class Frozen:
    """What one decoder layer's attention appends in one iteration: stopped tokens (`stopped`, (B, T)) get this layer's
    (keys, values) rows from the iteration before (`prev`), by induction their exit iteration's; `prev=None` (the first
    iteration, or the wrong no-reuse version) leaves every row as computed. The notebook's reference for its `Frozen`."""

    def __init__(self, prev, stopped):
        self.prev, self.stopped = prev, stopped

    def append(self, k, v):  # (B, H, T, hd) each
        if self.prev is not None:
            m = self.stopped[:, None, :, None]  # (B, 1, T, 1)
            k, v = torch.where(m, self.prev[0], k), torch.where(m, self.prev[1], v)
        self.kv = (k, v)
        return k, v


@torch.no_grad()
def adaptive_loop(model, idx, tau, max_iter, reuse=True, frozen=None):
    """(logits, exit_iter) of the adaptive loop on an E/D AsymLoop with a Global KV, written out as in notebook 04:
    the reference for its `my_adaptive_logits`. `frozen`: the cache class per layer and iteration (default `Frozen`);
    `reuse=False` is the wrong version that recomputes a stopped token's keys from its frozen state."""
    frozen = frozen or Frozen
    h = model.embed(idx)
    for blk in model.encoder:
        h = blk(h, model.rope)
    kv_glob = model.global_kv(h)
    z, logp, local = h, None, [None] * len(model.decoder)
    running = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    exit_iter = torch.full(idx.shape, max_iter, device=idx.device)
    for k in range(1, max_iter + 1):
        y = z
        for i, blk in enumerate(model.decoder):
            cache = frozen(local[i] if reuse else None, ~running)
            y = blk(y, model.rope, kv_glob[i], cache)
            local[i] = cache.kv
        z = torch.where(running[..., None], y, z)
        new = torch.log_softmax(model.logits(z).float(), -1)
        if logp is not None:
            kl = (logp.exp() * (logp - new)).sum(-1).clamp_min(0)  # KL(p_{k-1} || p_k), >= 0 despite rounding
            stop = running & (kl < tau)
            exit_iter[stop], running = k, running & ~stop
        logp = new
    return model.logits(z), exit_iter


def _same_as_package(loop, model, idx, taus=(0.0, 0.1), max_iter=6):
    from minimal_asymloop.generate import adaptive_logits

    for tau in taus:
        ref, ref_exit, _ = adaptive_logits(model, idx, tau, max_iter=max_iter)
        logits, exits = loop(model, idx, tau, max_iter)
        differ = (torch.as_tensor(exits, device=ref_exit.device) != ref_exit).sum().item()
        assert differ == 0, f"tau={tau:g}: {differ:,} of {ref_exit.numel():,} exit iterations differ from the package's"
        assert torch.equal(logits, ref), f"tau={tau:g}: the logits differ from the package's"


def check_frozen(frozen_cls, model, idx):
    """Raises unless the reference loop run with `frozen_cls` gives the package's logits and exits, bit for bit."""
    _same_as_package(lambda m, x, tau, k: adaptive_loop(m, x, tau, k, frozen=frozen_cls), model, idx)


def check_loop(loop, model, idx):
    """Raises unless `loop(model, idx, tau, max_iter)` gives the package's logits and exits at τ = 0 and 0.1."""
    _same_as_package(loop, model, idx)


def paired_exit_gap(exit_iter, targets, hops, a: int, b: int) -> tuple[float, float, int]:
    """Per program (row), the mean exit iteration of its `a`-hop answers minus that of its `b`-hop answers:
    (mean over the programs that have both, its standard error, how many). Programs are independent draws; answers
    within one program are not, so the standard error is taken over programs."""
    ex, ans = torch.as_tensor(exit_iter).float(), torch.as_tensor(targets) >= 0

    def mean_of(h):
        m = ans & (torch.as_tensor(hops) == h)
        return (ex * m).sum(1) / m.sum(1).clamp_min(1), m.any(1)

    (ma, ha), (mb, hb) = mean_of(a), mean_of(b)
    d = (ma - mb)[ha & hb]
    if len(d) < 2:
        raise ValueError(f"fewer than 2 programs have both {a}-hop and {b}-hop answers")
    return d.mean().item(), (d.std() / len(d) ** 0.5).item(), len(d)


def answer_exits(exit_iter, hops, targets, tokens) -> str:
    """One program's answers as 'column character (hops): exit iteration', for the text under the exit grid."""
    return "; ".join(f"col {t} {tokens[t]} ({int(hops[t])}-hop): {int(exit_iter[t])}"
                     for t in range(len(tokens)) if targets[t] >= 0)


# ---- sections 3 and 4 across the seeds: one figure each; the full per-seed text goes to the appendix ----

def seed_gaps(runs: list[dict], batch, tau: float = 0.03, max_iter: int = 6, device: str = "cpu") -> dict:
    """{seed: {a: paired_exit_gap(a-hop minus 1-hop)} for a = 2, 3}, recomputed from each seed's committed model on
    `batch` (idx, targets, hops) at `tau`: adaptive.json stores means, not the per-program exits a standard error needs."""
    from minimal_asymloop.adaptive import chain_model
    from minimal_asymloop.generate import adaptive_logits
    from minimal_asymloop.paths import RESULTS

    idx, tg, hp = batch
    out = {}
    for run in runs:
        m = chain_model(RESULTS / "chain_weights" / f"asymloop_k3-s{run['seed']}.safetensors").to(device)
        ex = adaptive_logits(m, idx.to(device), tau, max_iter=max_iter)[1].cpu()
        out[run["seed"]] = {a: paired_exit_gap(ex, tg, hp, a, 1) for a in (2, 3)}
    return out


def plot_exit_gaps(runs: list[dict], gaps: dict, tau: float = 0.03) -> Figure:
    """Left: per seed, 2-hop and 3-hop answers' exit iteration minus 1-hop ones' (same program, ± one s.e.); a fixed K
    runs every answer alike (0). Right: 3-hop accuracy of the rule at `tau` beside fixed K = 2 and 3, per seed."""
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.2]))
    for j, (run, m) in enumerate(zip(runs, MARKERS)):
        g = gaps[run["seed"]]
        for x, a in enumerate((2, 3)):
            left.errorbar(x + 0.08 * (j - 1), g[a][0], yerr=g[a][1], fmt=m, color=HOP_COLORS[str(a)], ms=7, capsize=3)
        fx, r = {f["k"]: f for f in run["fixed"]}, at_tau(run["adaptive"], tau)
        ys = [fx[2]["acc_by_hops"]["3"], fx[3]["acc_by_hops"]["3"], r["acc_by_hops"]["3"]]
        right.plot([0, 1], ys[:2], m + "-", color="0.3", lw=0.8, ms=7, label=f"seed {run['seed']}")
        right.plot([2], ys[2:], m, color="C1", ms=7)  # the rule: no depth of its own, so not joined to the fixed K
    left.axhline(0, ls="--", c="0.5", lw=1)
    left.text(1.3, 0.04, "fixed K: every answer\nruns K iterations (0)", ha="right", color="0.4", fontsize=8)
    left.set(xticks=[0, 1], xticklabels=["2-hop minus 1-hop", "3-hop minus 1-hop"], xlim=(-0.5, 1.5),
             ylabel="exit iteration difference\n(same program, ± 1 s.e.)", title=f"Exit later at τ = {tau:g}")
    right.axvline(1.5, c="0.7", lw=0.8)
    right.set(xticks=[0, 1, 2], xticklabels=["fixed K=2", "fixed K=3", f"rule, τ={tau:g}\n(iterations per token vary)"],
              ylim=(0.93, 1.003), ylabel="3-hop accuracy", title="3-hop accuracy: fixed depths and the rule")
    right.legend(fontsize=8, loc="lower right", title="marker: seed; orange: the rule", title_fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("3-hop answers run over one iteration longer than 1-hop ones in every seed")
    fig.tight_layout()
    return fig


def plot_chain_frontier(runs: list[dict], n: int) -> Figure:
    """Per seed, wrong answers (of `n`) against counted FLOPs (× fixed K_max): fixed K = 1..K_max, the best per-sequence
    mix of two (dashed, `mix_acc`), and the rule at each τ > 0; a red ring marks a τ that no single fixed K matches
    (`beaten_by_fixed`)."""
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, len(runs), sharey=True)
    for ax, run in zip(np.atleast_1d(axes), runs):
        fixed, ad = run["fixed"], [r for r in run["adaptive"] if r["tau"] > 0]
        wrong = lambda r: (1 - r["acc"]) * n  # noqa: E731
        ax.plot([f["flops_vs_max"] for f in fixed], [wrong(f) for f in fixed], "x", c="k", label="fixed K = 1..6")
        xs = np.linspace(fixed[0]["flops_vs_max"], fixed[-1]["flops_vs_max"], 400)  # straight in linear axes, curved in symlog
        ax.plot(xs, [(1 - mix_acc(fixed, x)) * n for x in xs], "--", c="k", lw=0.8, label="best mix of two fixed K")
        for f in fixed:
            ax.annotate(f"K={f['k']}", (f["flops_vs_max"], wrong(f)), textcoords="offset points", xytext=(-4, 6),
                        fontsize=7)
        ax.plot([r["flops_vs_max"] for r in ad], [wrong(r) for r in ad], "o-", c="C1", ms=4,
                label="exit rule, one dot per τ (larger τ: left)")
        for r, dy in ((ad[0], -18), (ad[-1], 16)):  # the smallest τ (right) labelled below, the largest (left) above
            ax.annotate(f"τ={r['tau']:g}", (r["flops_vs_max"], wrong(r)), textcoords="offset points", xytext=(0, dy),
                        fontsize=7, color="C1", ha="center", va="center", arrowprops=dict(arrowstyle="-", color="C1", lw=0.6))
        alone = [r for r in ad if beaten_by_fixed(run, "flops_vs_max", "acc", n)[r["tau"]] is None]
        ax.plot([r["flops_vs_max"] for r in alone], [wrong(r) for r in alone], "o", mfc="none", mec="r", ms=10,
                label="no fixed K as accurate for no more FLOPs")
        ax.set(yscale="symlog", ylim=(0, 500), xlim=(0.25, 1.08), xlabel=f"counted FLOPs per token (× fixed K={len(fixed)})",
               title=f"seed {run['seed']}")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(f"wrong answers (of {n:,}; symlog)")
    np.atleast_1d(axes)[-2].legend(fontsize=7, loc="upper right")
    fig.suptitle("Most thresholds match K = 6 for fewer FLOPs; a fixed K = 2 or 3 matches all but one for fewer still,\n"
                 "and a mix of two fixed K (dashed) that one too")
    fig.tight_layout()
    return fig


def seeds_report(runs: list[dict], gaps: dict, n: int, n3: int, tau: float = 0.03) -> str:
    """The per-seed numbers behind the two figures above, as text (the notebook's appendix)."""
    lines = []
    for run in runs:
        r, fx, g = at_tau(run["adaptive"], tau), {f["k"]: f for f in run["fixed"]}, gaps[run["seed"]]
        p, q = r["acc_by_hops"]["3"], fx[2]["acc_by_hops"]["3"]
        other = (4 * r["mean_iter"] - r["mean_iter_scored"]) / 3  # answers are one position in four (x=y;)
        lines += [f"seed {run['seed']}, tau={tau:g}: exit 1/2/3-hop " + "/".join(f"{r['iter_by_hops'][h]:.2f}" for h in "123")
                  + f"; minus 1-hop per program: 2-hop {g[2][0]:+.2f} (s.e. {g[2][1]:.3f}), 3-hop {g[3][0]:+.2f} "
                  f"(s.e. {g[3][1]:.3f}); answers {r['mean_iter_scored']:.2f}, other positions {other:.2f}",
                  f"   3-hop accuracy: rule {p:.3f}, fixed K=2 {q:.3f} (s.e. of the difference "
                  f"{se_diff(p, q, n3):.3f}); fixed K=1 by hops "
                  + " ".join(f"{fx[1]['acc_by_hops'][h]:.3f}" for h in "123"),
                  "   wrong answers at fixed K=1..6: " + " ".join(str(round((1 - f["acc"]) * n)) for f in run["fixed"])
                  + "; per tau: " + " ".join(f"{a['tau']:g}:{round((1 - a['acc']) * n)}" for a in run["adaptive"]),
                  f"   as accurate as K=6 for fewer FLOPs: tau in {cheaper_and_as_good(run['adaptive'], fx[6], 'acc', n)}",
                  f"   cheapest fixed K as accurate, per tau: {beaten_by_fixed(run, 'flops_vs_max', 'acc', n)}"]
    return "\n".join(lines)


def seeds_summary(runs: list[dict], gaps: dict, n3: int, tau: float = 0.03) -> str:
    """Three lines under the exit-gap figure: the per-program gaps, the rule's 3-hop edge over fixed K = 2 in
    standard errors, and fixed K = 1's accuracy by hops, one number per seed."""
    def fixed(run, k):
        return next(f for f in run["fixed"] if f["k"] == k)["acc_by_hops"]

    def edge(run):
        p, q = at_tau(run["adaptive"], tau)["acc_by_hops"]["3"], fixed(run, 2)["3"]
        return (p - q) / max(se_diff(p, q, n3), 1 / n3)

    seeds = "/".join(str(r["seed"]) for r in runs)
    return "\n".join([
        f"seeds {seeds}, per program, exit iteration minus 1-hop's: 3-hop "
        + " ".join(f"{gaps[r['seed']][3][0]:+.2f}" for r in runs) + ", 2-hop "
        + " ".join(f"{gaps[r['seed']][2][0]:+.2f}" for r in runs)
        + f" (s.e. at most {max(v[1] for r in runs for v in gaps[r['seed']].values()):.3f})",
        f"3-hop accuracy, the rule at tau={tau:g} minus fixed K=2, in s.e.: " + " ".join(f"{edge(r):+.1f}" for r in runs),
        "at fixed K=1: 2-hop accuracy " + " ".join(f"{fixed(r, 1)['2']:.3f}" for r in runs)
        + ", 3-hop " + " ".join(f"{fixed(r, 1)['3']:.3f}" for r in runs) + " (chance 0.25)"])
