"""Figures and tables of notebook 03 (a task that needs depth): the variable-binding chain runs of
notebooks/results/chain_task.json (depth) and chain_context.json (context access), a short live run, and the
lookups of the committed trained models. Every figure is a bare matplotlib Figure (the caller's backend is kept)."""

import copy
import json
import time
from dataclasses import replace

import numpy as np
import safetensors.torch
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from minimal_asymloop import experiments as ex
from minimal_asymloop.model import LoopedLM
from minimal_asymloop.paths import RESULTS
from minimal_asymloop.probes import chain_lookups
from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, train_on_task

STYLE = {"dense": ("k", "s", "Dense, L = 1..4"), "asymloop": ("tab:blue", "o", "AsymLoop E=D=1, K=1..5"),
         "full_loop": ("tab:orange", "^", "Full Loop L=2, K=2")}
LABELS = {"asymloop_k3": "Global KV", "asymloop_k3_no_global": "without\nGlobal KV", "asymloop_k3_additive": "additive",
          "asymloop_k3_no_local": "without\nLocal KV", "full_loop_k2": "Full Loop\nK=2", "dense_l4": "Dense\nL=4"}


def pretty(name: str) -> str:
    """A run's name as the text says it: dense_l3 -> Dense L=3, asymloop_k3_no_local -> AsymLoop K=3 without Local KV."""
    for code, words in (("dense_l", "Dense L="), ("asymloop_k", "AsymLoop K="), ("full_loop_k", "Full Loop K=")):
        name = name.replace(code, words)
    return name.replace("_no_global", " without Global KV").replace("_no_local", " without Local KV").replace("_additive", " additive")


class ChainRuns:
    """The runs of one chain experiment (chain_task or chain_context), by (name, seed)."""

    def __init__(self, experiment: str):
        data = json.loads((RESULTS / f"{experiment}.json").read_text())
        self.command, self.setting, self.seeds = data["command"], data["setting"], data["setting"]["seeds"]
        self.runs = {(r["name"], r["seed"]): r for r in data["runs"]}
        self.names = list(dict.fromkeys(r["name"] for r in data["runs"]))
        self.task = ChainTask(**self.setting["task"])
        self.hops = list(range(1, self.task.max_hops + 1))

    def run(self, name, seed):
        return self.runs[(name, seed)]

    def acc(self, name, h, k=None):
        """Accuracy on h-hop statements per seed, at test-time K (default: the trained K)."""
        return np.array([r["acc_by_test_k"][str(k or r["n_iter"])][str(h)] for r in self._all(name)])

    def solved(self, name):
        return np.array([r["converged"] for r in self._all(name)])

    def steps(self, name):
        """Steps to converge, solved seeds only."""
        return np.array([r["steps"] for r in self._all(name) if r["converged"]])

    def parted_at(self, other: "ChainRuns", name):
        """Per seed, the first check step at which this study's run of `name` and `other`'s score the check programs
        differently (None: never, within the steps both ran)."""
        curves = [[dict(r.run(name, s)["curve"]) for r in (self, other)] for s in self.seeds]  # {step: accuracy by hops}
        return [next((t for t in sorted(a.keys() & b.keys()) if a[t] != b[t]), None) for a, b in curves]

    def minutes(self, names=None):
        return sum(r["seconds"] for (n, _), r in self.runs.items() if names is None or n in names) / 60

    def _all(self, name):
        return [self.runs[(name, s)] for s in self.seeds]

    def table(self, names):
        """Per-seed accuracy on 2- and 3-hop statements (*: the run converged) and steps to converge."""
        steps = {n: ", ".join(f"{x:,}" for x in sorted(self.steps(n))) or "-" for n in names}
        w = max(26, *map(len, steps.values()))  # the steps column fits its longest row
        print(f"{'model':>22} {'depth':>5} {'params':>6} {'solved':>6} {'steps, solved seeds':>{w}}   "
              + "   ".join(f"{h}-hop accuracy per seed" for h in self.hops[1:]))
        for n in names:
            r, st = self.run(n, self.seeds[0]), steps[n]
            per = "   ".join(" ".join(f"{a:.2f}{'*' if ok else ' '}" for a, ok in zip(self.acc(n, h), self.solved(n)))
                           for h in self.hops[1:])
            print(f"{n:>22} {r['effective_depth']:>5} {r['params'] / 1e3:>5.0f}K {self.solved(n).sum():>4}/"
                  f"{len(self.seeds)} {st:>{w}}   {per}")


def _plateau(ax, level, label=True):
    """The guessing level (Dense L = 1's mean, section 1) dashed, its value written on it in every panel (each hop
    count has its own), and chance (1/4: four digits) dotted."""
    ax.axhline(level, color="0.4", ls="--", lw=1, label="plateau (its value on the line)" if label else None)
    ax.text(0.99, level + 0.01, f"plateau {level:.2f}", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
            fontsize=7, color="0.3")
    ax.axhline(0.25, color="0.7", ls=":", lw=1, label="chance (0.25)" if label else None)


def _seed_dots(ax, x, acc, ok, color, marker, label=None, spread=0.045):
    xs = x + spread * (np.arange(len(acc)) - (len(acc) - 1) / 2)
    ax.scatter(xs[ok], acc[ok], marker=marker, s=40, color=color, label=label)
    ax.scatter(xs[~ok], acc[~ok], marker=marker, s=40, facecolor="white", edgecolor=color, lw=1.3)


def _steps_panel(ax, x, st, n_failed, max_steps, color, marker, spread=0.06):
    """Solved seeds as filled markers at their step; the failed ones as one hollow marker above the cap, with their count."""
    st = np.sort(st)
    ax.scatter(x + spread * (np.arange(len(st)) - (len(st) - 1) / 2), st, marker=marker, s=40, color=color)
    if n_failed:
        ax.scatter([x], [max_steps * 1.08], marker=marker, s=40, facecolor="white", edgecolor=color, lw=1.3)
        ax.text(x, max_steps * 1.12, f"{n_failed}", ha="center", fontsize=9, color=color)


def plot_depth(grid: ChainRuns, names, plateau: dict | None = None) -> Figure:
    """Accuracy on 2- and 3-hop statements against effective depth (one dot per seed, hollow: not converged; plateau:
    {hops: accuracy}, dashed) and the steps to converge of the solved seeds, with the number of failed seeds on top."""
    fig = Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 3)
    max_steps = grid.setting["max_steps"]
    for j, (arch, (color, marker, label)) in enumerate(STYLE.items()):
        for i, n in enumerate([n for n in names if grid.run(n, grid.seeds[0])["arch"] == arch]):
            d = grid.run(n, grid.seeds[0])["effective_depth"] + 0.28 * (j - 1)
            for ax, h in zip(axes[:2], grid.hops[1:]):
                _seed_dots(ax, d, grid.acc(n, h), grid.solved(n), color, marker, label if i == 0 else None)
            _steps_panel(axes[2], d, grid.steps(n), len(grid.seeds) - grid.solved(n).sum(), max_steps, color, marker)
    bar = grid.setting["converged"]
    for ax, h in zip(axes[:2], grid.hops[1:]):
        ax.axhline(bar, color="0.5", ls=":", lw=1, label=f"converged: every hop count >= {bar}" if h == 2 else None)
        if plateau:
            _plateau(ax, plateau[h], label=h == 2)
        ax.set(title=f"{h}-hop statements", xlabel="effective depth (blocks per token)",
               ylabel="accuracy, check programs", ylim=(0, 1.05))
    axes[0].scatter([], [], s=40, facecolor="white", edgecolor="0.3", lw=1.3, label="hollow: seed not converged")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[2].axhline(max_steps, color="0.6", ls=":", lw=1)
    axes[2].set(title="steps to converge (filled: solved seeds)\nhollow above the cap: failed, with their count",
                ylabel="training steps", xlabel="effective depth (blocks per token)", ylim=(0, max_steps * 1.2),
                xlim=axes[0].get_xlim())
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    k1 = f"AsymLoop K=1 (depth 2) converges in {grid.solved('asymloop_k1').sum()}/{len(grid.seeds)} seeds (best 3-hop " \
         f"{', '.join(f'{a:.2f}' for a in sorted(grid.acc('asymloop_k1', 3))[::-1][:2])}); " \
        if "asymloop_k1" in names else ""
    fig.suptitle(f"Dense L=1-2 never learns even 2 hops; {k1}from depth 3 on, some seeds converge", fontsize=11)
    fig.tight_layout(w_pad=0.5)
    return fig


def by_test_k(grid: ChainRuns, names, hop=3):
    """For every AsymLoop run: its `hop`-hop accuracy at test-time K = 1 .. trained K + 3, by (name, seed)."""
    out = {}
    for n in names:
        for s in grid.seeds:
            r = grid.run(n, s)
            out[(n, s)] = np.array([r["acc_by_test_k"][str(k)][str(hop)] for k in range(1, r["n_iter"] + 4)])
    return out


def plot_test_depth(grid: ChainRuns, names, plateau: dict | None = None) -> Figure:
    """3-hop accuracy of each AsymLoop run at test-time K, solved and failed runs apart, one colour per trained K;
    plateau: {hops: accuracy}, dashed."""
    fig = Figure(figsize=(12.5, 4))
    axes = fig.subplots(1, 2, sharey=True)
    curves = by_test_k(grid, names)
    for j, n in enumerate(names):
        color = plt_color(j, len(names))
        for s in grid.seeds:
            r, a = grid.run(n, s), curves[(n, s)]
            ax = axes[0] if r["converged"] else axes[1]
            ax.plot(np.arange(1, len(a) + 1), a, "-o", ms=3, lw=1.2, color=color)
            ax.plot(r["n_iter"], a[r["n_iter"] - 1], "*", ms=12, color=color)
    handles = [axes[0].plot([], [], "-o", color=plt_color(j, len(names)), label=f"trained K={grid.run(n, grid.seeds[0])['n_iter']}")[0]
               for j, n in enumerate(names)]
    for ax in axes if plateau else ():
        _plateau(ax, plateau[3])
    handles += axes[0].get_legend_handles_labels()[0][len(handles):]
    n_ok = sum(grid.solved(n).sum() for n in names)
    for ax, what, m in zip(axes, ("solved", "failed"), (n_ok, len(names) * len(grid.seeds) - n_ok)):
        ax.set(title=f"{what} runs ({m})", xlabel="iterations K at test time (★: the trained K)", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("3-hop accuracy, check programs")
    axes[1].legend(handles=handles, fontsize=9, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the lines
    fig.suptitle("Solved runs need more than one iteration; iterating past the trained K rescues no failed run")
    fig.tight_layout()
    return fig


def plt_color(j, n):
    return ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")[j % 6]


def plot_context(ctx: ChainRuns, names, plateau: dict | None = None) -> Figure:
    """Effective depth 4, the context-access variants beside Full Loop and Dense: one dot per seed (plateau: {hops:
    accuracy}, dashed), steps to converge."""
    fig = Figure(figsize=(11, 4.6))
    axes = fig.subplots(1, 3)
    max_steps = ctx.setting["max_steps"]
    for i, n in enumerate(names):
        color, marker, _ = STYLE[ctx.run(n, ctx.seeds[0])["arch"]]
        for ax, h in zip(axes[:2], ctx.hops[1:]):
            _seed_dots(ax, i, ctx.acc(n, h), ctx.solved(n), color, marker, spread=0.1)
        _steps_panel(axes[2], i, ctx.steps(n), len(ctx.seeds) - ctx.solved(n).sum(), max_steps, color, marker, 0.12)
    for ax, h in zip(axes[:2], ctx.hops[1:]):
        ax.set(title=f"{h}-hop statements", ylabel="accuracy, check programs", ylim=(0, 1.05))
        if plateau:
            _plateau(ax, plateau[h], label=h == 2)
    if plateau:
        axes[0].legend(fontsize=8, loc="lower left")
    axes[2].axhline(max_steps, color="0.6", ls=":", lw=1)
    axes[2].set(title="steps to converge (filled: solved seeds)\nhollow above the cap: failed, with their count",
                ylabel="training steps", ylim=(0, max_steps * 1.2))
    for ax in axes:
        ax.set_xticks(range(len(names)), [LABELS[n] for n in names], fontsize=8, rotation=90)
    c, n = {v: ctx.solved(v).sum() for v in names}, len(ctx.seeds)
    fig.suptitle(f"Effective depth 4: Global KV converges in {c.get('asymloop_k3', 0)}/{n} seeds, additive injection "
                 f"in {c.get('asymloop_k3_additive', 0)}/{n} (filled: converged)")
    fig.tight_layout()
    return fig


def plot_curves(runs: ChainRuns, names, h=3, title="", rule: dict | None = None) -> Figure:
    """h-hop accuracy during training, one panel per model, one line per seed (dashed: not converged); rule:
    {hops: accuracy} of the no-chain rule on the same programs, drawn dotted."""
    fig = Figure(figsize=(min(11, 2.7 * len(names)), 3.3))
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    for ax, n in zip(axes, names):
        for j, s in enumerate(runs.seeds):
            r = runs.run(n, s)
            steps, a = zip(*[(st, acc[str(h)]) for st, acc in r["curve"]])
            ax.plot(steps, a, "-" if r["converged"] else "--", color=f"C{j}", lw=1.4, label=f"seed {s}")
        if rule:
            ax.axhline(rule[h], color="k", ls=":", lw=1.2)
        ax.set(title=pretty(n), xlabel="training step", xlim=(0, runs.setting["max_steps"]), ylim=(0, 1.05))
        ax.title.set_fontsize(9)
        ax.xaxis.set_major_locator(MaxNLocator(3))
    axes[0].set_ylabel(f"{h}-hop accuracy")
    handles = [axes[0].plot([], [], "-", color=f"C{j}", label=f"seed {s}")[0] for j, s in enumerate(runs.seeds)]
    if rule:
        handles += axes[0].plot([], [], "k:", label=f"no-chain rule ({rule[h]:.2f})")
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9)
    fig.suptitle(title + " (dashed: not converged)", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# ----------------------------------------------------------------------------- live


class _TaskOn(ChainTask):
    """The chain task with its batches on a device."""

    device = "cpu"

    def batch(self, *args):
        return tuple(t.to(self.device) for t in super().batch(*args))


def train_live(setting: dict, variants: dict, seed: int, max_steps: int, device="cpu") -> dict:
    """Train AsymLoop E=D=1 (chain_models' asymloop_k3, changed by each variant's fields) with the stored runs' recipe
    (same seed, programs and LR schedule), checking twice as often (a check changes no weight); stop at convergence or
    after max_steps.
    Returns {label: [(step, {hops: accuracy}), ...]}."""
    task = _TaskOn(**setting["task"])
    task.device = device
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # as the stored runs were made (--threads 1): the same kernels, so the same rounding
    try:
        for label, fields in variants.items():
            torch.manual_seed(seed)  # as the committed runs: the seed builds the model, then seeds the programs
            model = LoopedLM(replace(ex.chain_models(task)["asymloop_k3"], **fields)).to(device)
            curve = []

            def check(step, m, curve=curve):
                curve.append((step, accuracy_by_hops(m, task, n=setting["eval_programs"])))
                return min(curve[-1][1].values()) >= setting["converged"] or step >= max_steps

            t0 = time.time()
            train_on_task(model, task, steps=setting["max_steps"], batch_size=setting["batch"], lr=setting["lr"],
                          seed=seed, check_every=setting["check_every"] // 2, check=check)
            out[label] = curve
            print(f"{label:>24}: {curve[-1][0]:>5} steps in {time.time() - t0:3.0f} s; accuracy by hops "
                  + " ".join(f"{h}: {a:.4f}" for h, a in curve[-1][1].items()))  # 4 digits: 0.9896 is below 0.99
    finally:
        torch.set_num_threads(threads)
    return out


def plot_live(live: dict, title: str, plateau: dict | None = None, rule: dict | None = None) -> Figure:
    """Live 2- and 3-hop accuracy per variant; plateau: {hops: accuracy} of the guessing level, drawn dashed; rule:
    that of the no-chain rule on the same programs, drawn dotted."""
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, 2, sharey=True)
    for j, (label, curve) in enumerate(live.items()):
        for ax, h in zip(axes, (2, 3)):
            ax.plot(*zip(*[(s, a[h]) for s, a in curve]), "-o", ms=4, color=f"C{j}", label=label)
    for ax, h in zip(axes, (2, 3)):
        if plateau:
            ax.axhline(plateau[h], color="0.4", ls="--", lw=1, label="plateau (Dense L = 1, section 2)")
        if rule:
            ax.axhline(rule[h], color="k", ls=":", lw=1.2, label="no-chain rule (notebook 00)")
        ax.set(title=f"{h}-hop statements", xlabel="training step", ylim=(0, 1.05))
    axes[0].set_ylabel("accuracy, check programs")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def live_title(live: dict, seed: int, max_steps: int, converged: float) -> str:
    """The live figure's title, from the runs: each variant's 3-hop accuracy at its end, and which converged (every hop
    count at the bar) within max_steps; a run just short of the bar says by how much, to four digits (0.9896 is not
    0.99)."""
    parts = []
    for label, (step, acc) in ((label, curve[-1]) for label, curve in live.items()):
        worst, top = min(acc, key=acc.get), max(acc)  # the hop count furthest from the bar; the longest chains
        part = f"{label}: {top}-hop {acc[top]:.2f}"
        if acc[worst] >= converged:
            part += f", converged at step {step:,}"
        elif acc[worst] >= converged - 0.02:
            part += f", just short of the bar ({worst}-hop {acc[worst]:.4f} < {converged:g})"
        parts.append(part)
    return f"Live, seed {seed}, within {max_steps:,} steps: " + "; ".join(parts)


def uniform_share(qhops, h: int = 3) -> float:
    """Share of attention (both halves summed) one 4-token statement gets from an h-hop query that attends uniformly
    to every key it may see: 4 / (q + 1) for the query at position q, mean over the h-hop queries."""
    q = 2 + 4 * torch.arange(qhops.shape[1])
    return float((4 / (q + 1)).expand_as(qhops)[qhops == h].mean())


# ----------------------------------------------------------------------------- lookups


FRESH = 4321  # generator seed of the fresh programs: neither a training stream (seeds 0-4) nor the check set (1234)


def load_trained(runs: ChainRuns, device="cpu", keys=None) -> dict:
    """The committed trained models (notebooks/results/chain_weights/; only `keys`, a list of (name, seed), if given),
    each checked against its run's recorded accuracy on the check programs (a mismatch raises) and scored on fresh
    programs: {(name, seed): model}."""
    models = {}
    for path in sorted((RESULTS / "chain_weights").glob("*.safetensors")):
        name, seed = path.stem.rsplit("-s", 1)
        if keys is not None and (name, int(seed)) not in keys:
            continue
        m = LoopedLM(ex.chain_models(runs.task)[name]).eval()
        m.load_state_dict(safetensors.torch.load_file(path))
        now, then = accuracy_by_hops(m, runs.task, n=runs.setting["eval_programs"]), runs.run(name, int(seed))
        stored = {h: then["acc_by_test_k"][str(m.config.n_iter)][str(h)] for h in now}
        if any(abs(now[h] - stored[h]) > 1e-6 for h in now):
            raise ValueError(f"{path.name}: accuracy {now} differs from its run's {stored}; the weights are not that run's")
        fresh = accuracy_by_hops(m, runs.task, n=4 * runs.setting["eval_programs"], seed=FRESH)
        print(f"{name} seed {seed}: by hops " + " ".join(f"{a:.3f}" for a in now.values())
              + f" on the check programs, as its run (converged after {then['steps']:,} steps); on "
              + f"{4 * runs.setting['eval_programs']:,} fresh programs " + " ".join(f"{a:.3f}" for a in fresh.values()))
        models[(name, int(seed))] = m.to(device)
    if keys is not None and set(keys) - set(models):
        raise ValueError(f"no committed weights for {sorted(set(keys) - set(models))}; have: {sorted(models)}")
    return models


def lookups(runs: ChainRuns, models: dict) -> tuple[dict, torch.Tensor]:
    """chain_lookups of every model on the check programs (the accuracy checks' fixed draw), and each query's hop count."""
    idx, _, hops = runs.task.batch(runs.setting["eval_programs"], torch.Generator().manual_seed(1234))
    return {key: chain_lookups(copy.deepcopy(m).cpu(), runs.task, idx) for key, m in models.items()}, hops[:, 2::4]


def shares(lk: dict, qhops, h: int) -> np.ndarray:
    """(K, J, 2): share of h-hop queries' attention on the statement j back (j = 0..3), Global | Local half,
    mean over the queries and the heads of decoder layer 0."""
    return lk["stmt"][:, 0, :, qhops == h].mean((1, 2)).numpy()


def head_shares(lk: dict, qhops, h: int) -> np.ndarray:
    """(K, heads, J): per head, both halves summed, mean over the h-hop queries."""
    return lk["stmt"][:, 0, :, qhops == h].mean(2).sum(-1).numpy()


def plot_lookups(look: dict, qhops) -> Figure:
    """Where 3-hop queries look at each iteration: j=1 (the variable's definition) and j=2 (the one before), per
    half, one column per trained model."""
    keys = list(look)
    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    its = np.arange(1, 4)
    style = {(1, 0): ("tab:red", "--", "j=1 via Global"), (1, 1): ("tab:red", "-", "j=1 via Local"),
             (2, 0): ("tab:blue", "--", "j=2 via Global"), (2, 1): ("tab:blue", "-", "j=2 via Local")}
    u = uniform_share(qhops)
    for ax, key in zip(axes, keys):
        b = shares(look[key], qhops, 3)
        for (j, half), (color, ls, lab) in style.items():
            if half == 1 and key[0] != "asymloop_k3":  # no Local half in this model: nothing to draw
                continue
            ax.plot(its, b[:, j, half], ls, marker="o", ms=4, color=color, label=lab)
        if key[0] == "asymloop_k3":  # the summed j=1 share (the title's multiples compare it with u); uniform per half
            ax.plot(its, b[:, 1].sum(-1), color="tab:red", ls=":", marker="s", ms=3, lw=1.2, label="j=1, both halves summed")
            ax.axhline(u / 2, color="0.3", ls=(0, (1, 1)), lw=2, zorder=5, label=f"uniform, one statement: {u / 2:.2f} per half")
        ax.axhline(u, color="k", ls=":", lw=1.2, label=f"uniform, one statement: {u:.2f} (summed, or Global only)")
        ax.set_title(f"{'both halves' if key[0] == 'asymloop_k3' else 'without Local KV'}\nseed {key[1]}", fontsize=10)
        ax.set(xticks=its, xlabel="iteration", ylim=(0, 0.85))
    axes[0].set_ylabel("share of attention\n(mean over heads)")
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}  # both uniform lines
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    again = ", ".join(f"{shares(look[k], qhops, 3).sum(-1)[1, 1] / u:.1f}x" for k in keys if k[0] == "asymloop_k3")
    seeds = ", ".join(str(k[1]) for k in keys if k[0] == "asymloop_k3")
    fig.suptitle("3-hop queries: without Local KV, iteration 1 looks at j=1 and iteration 2 at j=2. With both halves, "
                 f"iteration 2 keeps\nattention on j=1, mostly through Local; its two halves summed (dotted red): {again} the "
                 f"uniform {u:.2f} (seeds {seeds})",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    return fig


AGAIN = 1.5  # with both halves, iteration 2's share on j=1 must be at least this many times the uniform share


def lookup_claims(lk: dict, qhops, local: bool) -> bool:
    """3-hop queries, mean over heads (S: both halves summed). Without Local KV: iteration 1 looks at j=1 and
    iterations 2 and 3 (where run) at j=2, each with over 0.4 and over twice the other's share. With both halves: iteration 2 still looks at
    j=1 (over AGAIN times the uniform share, 1.5 times its share on j=2), mostly through Local (twice its
    Global share)."""
    b = shares(lk, qhops, 3)
    s = b.sum(-1)
    if not local:
        return bool(s[0, 1] > 0.4 and s[0, 1] > 2 * s[0, 2] and all(s[k, 2] > 0.4 and s[k, 2] > 2 * s[k, 1] for k in range(1, len(s))))
    return bool(s[1, 1] > AGAIN * uniform_share(qhops) and s[1, 1] > 1.5 * s[1, 2] and b[1, 1, 1] > 2 * b[1, 1, 0])


def untrained_lookups(runs: ChainRuns, seed: int = 0, name: str = "asymloop_k3") -> dict:
    """chain_lookups of model `name` at initialisation (seed `seed`), on the same programs: the reference."""
    torch.manual_seed(seed)
    return lookups(runs, {"init": LoopedLM(ex.chain_models(runs.task)[name]).eval()})[0]["init"]
