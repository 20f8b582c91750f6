"""Figures and a table for train-once-run-at-any-depth (experiments.sampled_depth's results JSON):

    result = json.loads((RESULTS / "sampled_depth.json").read_text())
    fig_test_k(result)      # loss (LM) and accuracy by hops (chain) against test-time K, one curve per training recipe
    fig_frontier(result)    # one seed's exit rule per recipe against the fixed_k3 model's and its own fixed-K frontier
    vs_fixed_frontier(result)  # per recipe and seed: the best threshold minus fixed_k3's fixed-K frontier at equal FLOPs
    vs_fixed_frontier(result, own=True)  # the same against the recipe's own model's fixed-K frontier
    within_seed(result)     # each sampled recipe minus fixed K=3 at every test-time K, per seed
    train_more(model, samplers, steps, batch)  # notebook 05's live run: a trained chain model given more steps per sampler
    finetune_acc(result)    # the same, precomputed for every recipe and committed model: {recipe: {seed: accuracy by K}}
    fig_finetune(result)    # those runs' accuracy against test-time K, one curve per recipe
"""

import numpy as np
from matplotlib.figure import Figure

LABELS = {"fixed_k3": "fixed K=3 training (the paper's depth)", "lognormal_k3": "log-normal Poisson (our μ), E[K]=3",
          "uniform_k1_5": "uniform K in 1..5"}
KIND_COLORS = {"fixed": "C0", "lognormal_poisson": "C1", "uniform": "C2"}  # one colour per sampler in every figure
COLORS = {r: KIND_COLORS[k] for r, k in (("fixed_k3", "fixed"), ("lognormal_k3", "lognormal_poisson"), ("uniform_k1_5", "uniform"))}


def runs_of(result: dict, task: str) -> dict[str, list[dict]]:
    """{recipe: [run per seed, in seed order]} of one task ("lm" or "chain")."""
    out = {}
    for r in sorted((r for r in result["runs"] if r["task"] == task), key=lambda r: r["seed"]):
        out.setdefault(r["recipe"], []).append(r)
    return out


def _band(ax, x, ys, label):
    """Each seed as a thin line and the median over seeds as a thick one: one seed stuck on a plateau stays visible and
    does not drag the summary, as a mean would."""
    ys = np.array(ys)
    line, = ax.plot(x, np.median(ys, 0), "o-", lw=2, color=COLORS.get(label),
                    label=f"{LABELS.get(label, label)}: median of {len(ys)} seeds")
    for y in ys:
        ax.plot(x, y, "-", lw=0.8, alpha=0.4, color=line.get_color())


def fig_test_k(result: dict, hops: str = "3", title: str | None = None, chain: bool = True) -> Figure:
    """LM cross-entropy against test-time K and (chain=True) chain-task accuracy on `hops`-hop chains against test-time K.
    Median over seeds, thin lines each seed; the dotted line is the K every recipe averages in training. The LM axis
    stops a little above the highest median, so one seed far behind does not squeeze the rest (its line leaves the top)."""
    fig = Figure(figsize=(11, 5.2) if chain else (8, 5.2))
    lm_ax, ch_ax = fig.subplots(1, 2) if chain else (fig.subplots(), None)
    medians, lows, highs = [], [], []
    for recipe, runs in runs_of(result, "lm").items():
        ks = [r["k"] for r in runs[0]["sweep"]["fixed"]]
        ys = [[r["ce"] for r in run["sweep"]["fixed"]] for run in runs]
        _band(lm_ax, ks, ys, recipe)
        medians, lows, highs = medians + list(np.median(ys, 0)), lows + [np.min(ys)], highs + [np.max(ys)]
    span = max(medians) - min(lows)
    top = max(medians) + 0.3 * span
    lm_ax.set_ylim(min(lows) - 0.05 * span, top)
    clipped = max(highs) > top  # a seed far behind leaves the top of the axis
    lm_ax.set(title="Tiny LM: held-out loss vs test-time depth" + (" (axis clipped above)" if clipped else ""),
              xlabel="test-time K (decoder iterations)", ylabel="cross-entropy (nats/token)")
    axes = [lm_ax]
    if chain:
        for recipe, runs in runs_of(result, "chain").items():
            ks = [r["k"] for r in runs[0]["sweep"]["fixed"]]
            _band(ch_ax, ks, [[r["acc_by_hops"][hops] for r in run["sweep"]["fixed"]] for run in runs], recipe)
        ch_ax.set(title=f"Chain task: {hops}-hop accuracy vs test-time depth", xlabel="test-time K (decoder iterations)",
                  ylabel=f"accuracy on {hops}-hop statements", ylim=(0, 1.02))  # the whole range: 0.5 is guessing
        axes.append(ch_ax)
    for ax in axes:
        ax.axvline(3, ls=":", c="gray", label="trained K (3)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1 if chain else 2)
    if title and not chain:  # one panel: one title
        lm_ax.set_title(f"{title}\n(median of seeds; thin lines: each seed{'; axis clipped above' if clipped else ''})", fontsize=10)
    elif title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def fig_frontier(result: dict, task: str = "lm", seed: int | None = None, title: str | None = None) -> Figure:
    """One seed's exit rule per recipe against the two frontiers `vs_fixed_frontier` measures it by: the same seed's
    fixed-K=3 model run at fixed K = 1..8 (black x) and its fixed-K frontier, the running minimum of those losses
    (dashed); and each sampled recipe's own model's fixed-K frontier (dotted, in its colour).
    Cross-entropy against counted FLOPs per token (exit checks included), one point per threshold tau > 0 (tau = 0 is
    fixed K = 8), each a run's own point, no average. The fixed-K=3 recipe's points name their tau; thresholds too close
    to tell apart share one label, and labels are placed where they overlap no other text."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    runs = runs_of(result, task)
    seed = runs["fixed_k3"][0]["seed"] if seed is None else seed
    pick = {recipe: next(r for r in rs if r["seed"] == seed) for recipe, rs in runs.items() if any(r["seed"] == seed for r in rs)}
    fig = Figure(figsize=(8, 5.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    base = pick["fixed_k3"]["sweep"]
    unit = next(x for x in base["fixed"] if x["k"] == 3)["flops_per_token"]
    fix = np.array(sorted((r["flops_per_token"] / unit, r["ce"]) for r in base["fixed"]))
    ax.plot(*fix.T, "x", c="k", label=f"fixed_k3 model, seed {seed}, run at fixed K = 1..{len(fix)}")
    ax.plot(fix[:, 0], np.minimum.accumulate(fix[:, 1]), "--", c="k", alpha=0.6,
            label="its fixed-K frontier: the lowest loss of any fixed K at no more FLOPs (joined\n"
                  "linearly: a per-sequence mix of two fixed K); one yardstick for every recipe")
    points, taus = [tuple(p) for p in fix], []
    for recipe, run in pick.items():
        c = COLORS.get(recipe)
        if recipe != "fixed_k3":  # its own model's frontier
            fl, ce = _frontier(run)
            ax.plot(fl / unit, ce, ":", lw=1.5, c=c, label=f"{LABELS.get(recipe, recipe)}: its own fixed-K frontier")
            points += list(zip(fl / unit, ce))
        ada = [a for a in run["sweep"]["adaptive"] if a["tau"] > 0]  # tau = 0 is fixed K = 8
        xy = np.array([(a["flops_per_token"] / unit, a["ce"]) for a in ada])
        ax.plot(*xy.T, "o-", ms=4, c=c, label=f"{LABELS.get(recipe, recipe)}, seed {seed}: exit rule, one point per tau > 0")
        points += [tuple(p) for p in xy]
        if recipe == "fixed_k3":
            taus = [(a["tau"], p) for a, p in zip(ada, xy)]
    ax.set(title=title or f"Seed {seed}: each recipe's exit rule against fixed_k3's and its own fixed-K frontier",
           xlabel="counted FLOPs per token, exit checks included (x fixed K=3)", ylabel="cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.tight_layout()
    span = np.ptp(np.array(points), 0)
    groups = []  # neighbouring thresholds too close to tell apart share one label
    for tau, (x, y) in taus:
        if groups and abs(x - groups[-1][2][0]) < 0.04 * span[0] and abs(y - groups[-1][2][1]) < 0.06 * span[1]:
            groups[-1][0].append(tau)
            groups[-1][2] = (x, y)
        else:
            groups.append([[tau], (x, y), (x, y)])  # taus, where the label goes, the last member
    labels = [(f"K={k}", (x, y), "k") for k, (x, y) in enumerate(fix, 1)]
    labels += [("τ=" + ", ".join(f"{t:g}" for t in ts), xy, COLORS["fixed_k3"]) for ts, xy, _ in groups]
    _place_labels(fig, ax, labels, points)
    return fig


def _place_labels(fig, ax, labels, points, pad=3.0):
    """Annotate each (text, xy, colour) at the first of a ring of offsets whose box overlaps no placed label, no data
    point's marker and stays inside the axes; the last offset tried is kept if none is free."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    marks = [ax.transData.transform(p) for p in points]
    placed = []
    offsets = [(0, -12), (6, 4), (6, -12), (-6, 4), (-6, -12), (0, 8), (10, -2), (-10, -2)]
    offsets += [(dx * 2.2, dy * 2.2) for dx, dy in offsets]
    for text, xy, colour in labels:
        for dx, dy in offsets:
            ha = "center" if dx == 0 else ("left" if dx > 0 else "right")
            ann = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), fontsize=7, color=colour, ha=ha)
            box = ann.get_window_extent(renderer).expanded(1.08, 1.15)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            free = not any(box.overlaps(b) for b in placed) and not any(
                box.x0 - pad < mx < box.x1 + pad and box.y0 - pad < my < box.y1 + pad for mx, my in marks)
            if inside and free or (dx, dy) == offsets[-1]:
                placed.append(box)
                ann.crowded = not (inside and free)  # True: no free place was found (the tests assert none is)
                break
            ann.remove()


def check_cost(result: dict, task: str = "lm") -> tuple[float, float]:
    """(FLOPs of one exit check, FLOPs of one decoder iteration) per token, read off the fixed-K=3 model's counted FLOPs:
    a threshold that runs all K_max iterations pays K_max - 1 checks over fixed K_max."""
    sweep = runs_of(result, task)["fixed_k3"][0]["sweep"]
    fixed, kmax = [x["flops_per_token"] for x in sweep["fixed"]], len(sweep["fixed"])
    full = [a for a in sweep["adaptive"] if a["tau"] > 0 and a["mean_iter"] == kmax]
    if not full:
        raise ValueError("no threshold ran every iteration: pass a result whose smallest tau > 0 stops no token")
    return (full[0]["flops_per_token"] - fixed[-1]) / (kmax - 1), fixed[1] - fixed[0]


def _frontier(run: dict, cost: str = "flops_per_token") -> tuple[np.ndarray, np.ndarray]:
    """(cost per token, the lowest cross-entropy of any fixed K at no more cost) of one run's fixed-K sweep; cost is
    counted FLOPs (exit checks included) or "mean_iter" (decoder iterations, checks free)."""
    f = sorted((x[cost], x["ce"]) for x in run["sweep"]["fixed"])
    return np.array([a for a, _ in f]), np.minimum.accumulate([c for _, c in f])


def vs_fixed_frontier(result: dict, task: str = "lm", own: bool = False,
                      cost: str = "flops_per_token") -> dict[str, list[dict]]:
    """Per recipe and seed: the threshold closest to a fixed-K frontier, by counted FLOPs (checks included): `gap` = its
    cross-entropy minus the frontier's (the lowest loss of any fixed K, linearly interpolated between fixed depths: a
    per-sequence mix of two fixed K) at the same FLOPs. The frontier is that of the same seed's fixed-K=3 model
    (own=False: one yardstick for every recipe, so a worse model shows as a larger gap) or of the run's own model
    (own=True: what the exit rule costs against that model run at fixed K). `gap` > 0: no threshold reaches it.
    cost="mean_iter" measures cost in decoder iterations instead, so an exit check costs nothing; `cost_vs_k3` is the
    threshold's cost over fixed K=3's, in that unit."""
    runs = runs_of(result, task)
    base = {r["seed"]: _frontier(r, cost) for r in runs["fixed_k3"]}
    out = {}
    for recipe, rs in runs.items():
        for r in rs:
            fl, ce = _frontier(r, cost) if own else base[r["seed"]]
            gaps = [(a["ce"] - np.interp(a[cost], fl, ce), a) for a in r["sweep"]["adaptive"]]
            gap, a = min(gaps, key=lambda g: g[0])
            out.setdefault(recipe, []).append(dict(seed=r["seed"], tau=a["tau"], ce=a["ce"], gap=float(gap),
                                                   cost_vs_k3=a[cost] / fl[2]))
    return out


def within_seed(result: dict, task: str = "lm", metric: str = "ce") -> dict[str, dict]:
    """{recipe: {"k": [...], "diff": [[per seed]...]}}: the recipe's `metric` minus fixed K=3's at each test-time K, for the
    seeds both have (within-seed: same init and data order)."""
    runs = runs_of(result, task)
    base = {r["seed"]: r for r in runs.get("fixed_k3", [])}
    out = {}
    for recipe, rs in runs.items():
        if recipe == "fixed_k3":
            continue
        pairs = [(r, base[r["seed"]]) for r in rs if r["seed"] in base]
        if pairs:
            out[recipe] = dict(k=[row["k"] for row in pairs[0][0]["sweep"]["fixed"]], seeds=[r["seed"] for r, _ in pairs],
                               diff=[[a[metric] - b[metric] for a, b in zip(r["sweep"]["fixed"], f["sweep"]["fixed"])]
                                     for r, f in pairs])
    return out


def beats_fixed(result: dict, task: str = "lm", budget: float = 3.0) -> dict[str, list[dict]]:
    """Per recipe and seed: the adaptive threshold with the lowest cross-entropy at <= `budget` mean iterations per token,
    against the fixed-K=3 model run at K=3 (same seed). `gain` < 0: that threshold beats the paper's recipe at equal or
    lower compute."""
    runs = runs_of(result, task)
    base = {r["seed"]: next(x for x in r["sweep"]["fixed"] if x["k"] == 3) for r in runs.get("fixed_k3", [])}
    out = {}
    for recipe, rs in runs.items():
        for r in rs:
            if r["seed"] not in base:
                continue
            ok = [a for a in r["sweep"]["adaptive"] if a["mean_iter"] <= budget + 1e-9]
            best = min(ok, key=lambda a: a["ce"]) if ok else None
            out.setdefault(recipe, []).append(dict(seed=r["seed"], tau=best and best["tau"], mean_iter=best and best["mean_iter"],
                                                   ce=best and best["ce"], fixed_k3_ce=base[r["seed"]]["ce"],
                                                   gain=best and best["ce"] - base[r["seed"]]["ce"]))
    return out


def accuracy_by_k(model, batch, hops: int = 3, max_k: int = 8) -> list[float]:
    """Accuracy on the `hops`-hop answers of a chain batch (idx, targets, hops) at test-time K = 1..max_k (one forward:
    the head on each z_k)."""
    import torch

    idx, targets, hop = batch
    scored = (targets >= 0) & (hop == hops)
    with torch.no_grad():
        return [(model.logits(z).argmax(-1) == targets)[scored].float().mean().item() for z in model.states(idx, max_k)]


class _Recorded:
    """A depth sampler that keeps every K it draws (train_on_task only calls `draw`)."""

    def __init__(self, depth):
        self.depth, self.ks = depth, []

    def draw(self) -> int:
        self.ks.append(self.depth.draw())
        return self.ks[-1]


def train_more(model, samplers: dict, steps: int, batch, lr: float = 3e-3, seed: int = 0,
               backprop_depth: int | None = None) -> dict[str, dict]:
    """For each {name: depth.DepthSampler}: a copy of the trained chain `model` given `steps` more steps of the chain
    task (the same programs in the same order for every sampler), then scored at test-time K = 1..8; backprop_depth:
    truncated backprop through the last n iterations of each step (None: all of them).
    Returns {name: {"acc": 3-hop accuracy by K, "drawn": {K: steps}, "cpu_s": CPU seconds, "kind": the sampler's
    kind}}, "before" first (kind None)."""
    import copy
    import time
    from collections import Counter

    import torch

    from minimal_asymloop.experiments.chain import CHAIN_TASK
    from minimal_asymloop.tasks import ChainTask, train_on_task

    model, batch = copy.deepcopy(model).cpu(), [t.cpu() for t in batch]  # the task's batches are made on the CPU
    out = {"before": dict(acc=accuracy_by_k(model, batch), drawn={}, cpu_s=0.0, kind=None)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (ours) a model this small runs as fast on one thread, and a second one spins on a busy CPU
    try:
        for name, depth in samplers.items():
            m, rec, t0 = copy.deepcopy(model), _Recorded(depth), time.process_time()
            train_on_task(m, ChainTask(**CHAIN_TASK), steps=steps, lr=lr, seed=seed, depth=rec, backprop_depth=backprop_depth)
            out[name] = dict(acc=accuracy_by_k(m.eval(), batch), drawn=dict(sorted(Counter(rec.ks).items())),
                             cpu_s=time.process_time() - t0, kind=getattr(depth, "kind", None))
    finally:
        torch.set_num_threads(threads)
    return out


def finetune_acc(result: dict, hops: str = "3") -> dict[str, dict[int, list[float]]]:
    """{recipe: {seed: `hops`-hop accuracy at test-time K = 1..8}} of the fine-tune part (experiments.sampled_depth's
    finetune_run: a committed chain model converged at fixed K = 3, given more steps with each recipe's K)."""
    return {recipe: {r["seed"]: [x["acc_by_hops"][hops] for x in r["sweep"]["fixed"]] for r in rs}
            for recipe, rs in runs_of(result, "finetune").items()}


ARM_RECIPES = {"fixed K=3": "fixed_k3", "K drawn per step": "lognormal_k3"}  # notebook 05's live arms, by recipe


def live_vs_stored(live: dict, result: dict, seed: int, steps: int) -> float | None:
    """The largest |live - precomputed| 3-hop accuracy over K and notebook 05's two arms, or None where the fine-tune
    part has no run of this seed and step count."""
    stored = finetune_acc(result)
    if steps != result["setting"]["finetune"]["steps"] or seed not in stored["fixed_k3"]:
        return None
    return max(abs(a - b) for arm, recipe in ARM_RECIPES.items() for a, b in zip(live[arm]["acc"], stored[recipe][seed]))


def finetune_vs_fixed(result: dict, n: int, hops: str = "3") -> dict[str, dict[int, list[float]]]:
    """{sampled recipe: {seed: (its accuracy - fixed K=3's) / one standard error of that difference, at K = 1..8}} of the
    fine-tune part, on `n` answers (binomial s.e. sqrt((p(1-p) + q(1-q)) / n), at least 1/n so equal scores give 0)."""
    acc = finetune_acc(result, hops)
    from minimal_asymloop.course.adaptive import se_diff

    return {r: {s: [(x - f) / max(se_diff(x, f, n), 1 / n) for x, f in zip(a, acc["fixed_k3"][s])] for s, a in by.items()}
            for r, by in acc.items() if r != "fixed_k3"}


def _mark_trained_k_and_chance(ax):
    """The trained K (3) and chance on the chain task's 4 values, on an accuracy-against-test-time-K axis."""
    ax.axvline(3, ls="-", c="0.85", lw=3, zorder=0)
    ax.text(3.08, 0.05, "trained K", color="0.4", fontsize=8)
    ax.axhline(0.25, ls="--", c="0.7", lw=1)
    ax.text(8, 0.27, "chance (4 values)", ha="right", color="0.4", fontsize=8)


def fig_finetune(result: dict, hops: str = "3", title: str | None = None) -> Figure:
    """The fine-tune part: `hops`-hop accuracy against test-time K per recipe (median of the committed models, thin lines
    each), with chance and the trained K marked."""
    fig = Figure(figsize=(7.5, 4.6))
    ax = fig.subplots()
    for recipe, by_seed in finetune_acc(result, hops).items():
        _band(ax, range(1, 1 + len(next(iter(by_seed.values())))), list(by_seed.values()), recipe)
    steps = result["setting"]["finetune"]["steps"]
    _mark_trained_k_and_chance(ax)
    ax.set(xlabel="test-time K (decoder iterations)", ylabel=f"accuracy on {hops}-hop answers", ylim=(0, 1.03),
           title=title or f"Converged models given {steps} more steps per recipe")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def fig_live(curves: dict, steps: int, title: str = "3-hop accuracy by test-time depth, before and after more steps") -> Figure:
    """3-hop accuracy against test-time K: the trained model before, and after `steps` more steps per sampler, each in
    its sampler kind's colour (KIND_COLORS; an unknown kind gets one of its own)."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    styles = {"before": dict(c="0.5", ls=":", marker="x")}
    for j, (name, c) in enumerate(curves.items()):
        ks = range(1, len(c["acc"]) + 1)
        label = "trained at fixed K=3 (committed weights)" if name == "before" else f"+ {steps} steps, {name}"
        colour = KIND_COLORS.get(c.get("kind"), f"C{2 + j}")
        ax.plot(ks, c["acc"], **styles.get(name, dict(c=colour, marker="os^"[j % 3], ms=8 - 2 * (j % 3),
                                                         ls="-" if j % 3 < 2 else "--")), label=label)  # none hidden
    _mark_trained_k_and_chance(ax)
    ax.set(xlabel="test-time K (decoder iterations)", ylabel="accuracy on 3-hop answers", ylim=(0, 1.03),
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def lm_report(result: dict) -> str:
    """The per-seed numbers behind notebook 05's section 6 figures, as text (its appendix): LM loss at K = 8 minus K = 3
    and at the best K, the sampled runs below fixed K = 3 at some K, and each recipe's closest threshold to fixed_k3's
    frontier and to its own model's."""
    ce = {r: [[a["ce"] for a in x["sweep"]["fixed"]] for x in rs] for r, rs in runs_of(result, "lm").items()}
    lines = [f"LM {r:>12}: CE at K=8 minus K=3 " + ", ".join(f"{c[7] - c[2]:+.3f}" for c in v)
             + "; best K's CE minus fixed_k3's best " + ", ".join(f"{min(c) - min(f):+.3f}" for c, f in zip(v, ce["fixed_k3"]))
             for r, v in ce.items()]
    lines += [f"{r} seed {s}: below fixed_k3 (same seed) at K=" + ",".join(str(k) for k, x in zip(d["k"], row) if x < 0)
              for r, d in within_seed(result).items() for s, row in zip(d["seeds"], d["diff"]) if min(row) < 0]
    for own, what in ((False, "fixed_k3's frontier"), (True, "its own frontier")):
        lines += [f"{r:>12} closest threshold to {what}: " + "; ".join(
            f"seed {b['seed']} tau={b['tau']:g} FLOPs {b['cost_vs_k3']:.2f} x K=3 {b['gap']:+.4f}" for b in rows)
            for r, rows in vs_fixed_frontier(result, own=own).items()]
    lines.append("peak training memory at the largest K (MiB): "
                 + str({r: round(m["peak_bytes_at_largest_k"] / 2**20) for r, m in result["memory"].items()}))
    return "\n".join(lines)
