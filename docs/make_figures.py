"""Draw the README's figures into docs/: the three architectures, and the notebooks' key result.

    python docs/make_figures.py          # writes docs/asymloop.png and docs/notebook_results.png

The second figure reads the precomputed runs in notebooks/results/ (matched_depth.json, chain_task.json and
chain_context.json, the same files notebooks 02 and 03 read; written by `python -m minimal_asymloop.experiments all`);
run this again after they change.
"""

import json
import statistics
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

DOCS = Path(__file__).resolve().parent
RESULTS = DOCS.parent / "notebooks" / "results"
COLORS = dict(block="#d9d9d9", enc="#9ecae1", dec="#fdae6b", glob="#a1d99b", io="#f0f0f0")


def box(ax, x, y, w, h, text, color, size=9):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.005,rounding_size=0.015",
                                fc=color, ec="black", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def arrow(ax, a, b, rad=0.0, style="-|>", color="black", ls="-"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, lw=1.0, color=color, ls=ls,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))


def stack(ax, x, names, colors, y0, dy, w=0.34, h=0.075):
    """Boxes bottom-up from y0, joined by arrows; returns their centre heights."""
    ys = [y0 + i * dy for i in range(len(names))]
    for i, (name, c, y) in enumerate(zip(names, colors, ys)):
        box(ax, x, y, w, h, name, c)
        if i:
            arrow(ax, (x, ys[i - 1] + h / 2), (x, y - h / 2))
    return ys


def loop(ax, x, y_lo, y_hi, label, w=0.34, rad=0.6):
    """The weight-tied loop: an arc from the stack's top back to its bottom, on its left."""
    left = x - w / 2 - 0.01
    arrow(ax, (left, y_hi), (left, y_lo), rad=rad)
    ax.text(left - 0.04 - rad * (y_hi - y_lo) * 0.6, (y_lo + y_hi) / 2, label, ha="right", va="center", fontsize=10,
            fontweight="bold")


def architecture_figure() -> Figure:
    """Dense, Full Loop and AsymLoop with L = 4 blocks (E = D = 2), side by side."""
    fig = Figure(figsize=(11, 4.6), dpi=150)
    axes = fig.subplots(1, 3, gridspec_kw=dict(width_ratios=[1, 1, 1.45]))
    dy, x = 0.14, 0.5
    for ax in axes:
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")

    def ends(ax, x, ys, top_y):
        box(ax, x, 0.05, 0.34, 0.06, "tokens → embed", COLORS["io"], 8)
        arrow(ax, (x, 0.08), (x, ys[0] - 0.0375))
        box(ax, x, top_y, 0.34, 0.06, "RMSNorm → head", COLORS["io"], 8)
        arrow(ax, (x, ys[-1] + 0.0375), (x, top_y - 0.03))

    ax = axes[0]
    ys = stack(ax, x, [f"block {i}" for i in range(1, 5)], [COLORS["block"]] * 4, 0.2, dy)
    ends(ax, x, ys, 0.86)
    ax.set_title("Dense\nL blocks, once\ndepth L = 4", fontsize=10)

    ax = axes[1]
    ys = stack(ax, x, [f"block {i}" for i in range(1, 5)], [COLORS["block"]] * 4, 0.2, dy)
    ends(ax, x, ys, 0.86)
    loop(ax, x, ys[0], ys[-1], "× K")
    ax.set_title("Full Loop\nall L blocks, K times (shared weights)\ndepth K·L = 8 (K=2)", fontsize=10)

    ax = axes[2]
    x = 0.36
    enc = stack(ax, x, ["encoder 1", "encoder 2"], [COLORS["enc"]] * 2, 0.2, dy, w=0.3)
    dec = stack(ax, x, ["decoder 1", "decoder 2"], [COLORS["dec"]] * 2, 0.2 + 2.35 * dy, dy, w=0.3)
    h_y = (enc[-1] + dec[0]) / 2
    arrow(ax, (x, enc[-1] + 0.0375), (x, dec[0] - 0.0375))
    ax.text(x + 0.02, h_y, "H", fontsize=10, fontweight="bold", va="center")
    box(ax, x, 0.05, 0.3, 0.06, "tokens → embed", COLORS["io"], 8)
    arrow(ax, (x, 0.08), (x, enc[0] - 0.0375))
    box(ax, x, 0.91, 0.3, 0.06, "RMSNorm → head", COLORS["io"], 8)
    arrow(ax, (x, dec[-1] + 0.0375), (x, 0.88))
    loop(ax, x, dec[0], dec[-1], "× K", w=0.3, rad=1.2)
    gx = 0.8
    box(ax, gx, (dec[0] + dec[-1]) / 2, 0.3, 0.2, "Global KV\none (K, V) per\ndecoder layer,\nbuilt once per pass", COLORS["glob"], 8)
    arrow(ax, (x + 0.01, h_y), (gx, (dec[0] + dec[-1]) / 2 - 0.1), rad=0.3, color="#31a354")
    ax.text(gx, h_y - 0.06, "RMSNorm(H) → W_k, W_v\nof each decoder layer", fontsize=7, color="#31a354", va="top", ha="center")
    for y in dec:
        arrow(ax, (gx - 0.15, y), (x + 0.15, y), color="#31a354", ls="--")
    ax.text(0.66, dec[-1] + 0.11, "each decoder attention: one softmax over\n[Global KV ; its own Local KV]",
            fontsize=7.5, ha="center", color="#31a354")
    ax.set_title("AsymLoop\nencoder once, weight-tied decoder K times\ndepth E + K·D = 8 (K=3)", fontsize=10)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.84, wspace=0.05)
    return fig


# ----------------------------------------------------------------------------- the notebooks' key result


# (the paper's matched-depth numbers are from other recipes and budgets than these uniform LR + QKNorm runs: not drawn beside)
PAIRS = [("depth 4 (L)", "dense", "asymloop_k1", "Dense", "AsymLoop K=1"),
         ("depth 8 (2L)", "full_loop_k2", "asymloop_k3", "Full Loop K=2", "AsymLoop K=3"),
         ("depth 12 (3L)", "full_loop_k3", "asymloop_k5", "Full Loop K=3", "AsymLoop K=5")]


def results_figure() -> Figure:
    """Left: AsymLoop minus its matched-depth baseline in validation cross-entropy, within seed (mean ± std over seeds,
    each seed a dot). Middle: the binding-chain task's 3-hop accuracy per seed against effective depth (filled: the run
    converged). Right: the same at effective depth 4 for each way of reaching the encoder's output."""
    fig = Figure(figsize=(15, 5), dpi=150)
    left, middle, right = fig.subplots(1, 3, gridspec_kw=dict(width_ratios=[1, 1.1, 1.1]))
    matched_depth_panel(left)
    chain_panel(middle)
    context_panel(right)
    fig.tight_layout()
    return fig


def matched_depth_panel(ax):
    runs = {}
    for r in json.loads((RESULTS / "matched_depth.json").read_text())["runs"]:
        runs.setdefault(r["name"], {})[r["seed"]] = r["val_loss"]
    n_seeds = set()
    for i, (_, base, asym, _, _) in enumerate(PAIRS):
        seeds = sorted(set(runs.get(base, {})) & set(runs.get(asym, {})))
        if not seeds:
            sys.exit(f"error: {RESULTS / 'matched_depth.json'} has no seed with both {base} and {asym}; "
                     f"run `python -m minimal_asymloop.experiments matched_depth` first")
        n_seeds.add(len(seeds))
        diffs = [runs[asym][s] - runs[base][s] for s in seeds]
        mean, std = statistics.fmean(diffs), statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        ax.errorbar(i - 0.1, mean, yerr=std, fmt="o", ms=8, color="#e6550d", capsize=4,
                    label="ours: mean ± std over seeds" if i == 0 else None)
        ax.plot([i - 0.1] * len(diffs), diffs, ".", color="#e6550d", alpha=0.4, label="ours: each seed" if i == 0 else None)
        ax.text(i + 0.2, mean, f"{mean:+.3f}", va="center", fontsize=8)
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(PAIRS)), [f"{p[0]}\n{p[4]}\n− {p[3]}" for p in PAIRS], fontsize=8)
    ax.set_xlim(-0.6, len(PAIRS) - 0.4)
    ax.set_ylabel("Δ validation cross-entropy (nats/token)\nbelow 0: AsymLoop is better")
    seeds = "/".join(str(n) for n in sorted(n_seeds))
    ax.set_title(f"Language: AsymLoop − matched-depth baseline\n({seeds} seeds, uniform LR, QKNorm, ~2 tokens/param)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(axis="y", lw=0.3)


CHAIN_STYLE = {"dense": ("black", "s", "Dense, L = 1..4"), "asymloop": ("#e6550d", "o", "AsymLoop E = D = 1, K = 1..5"),
               "full_loop": ("#3182bd", "^", "Full Loop L = 2, K = 2")}
CONTEXT_ARMS = [("dense_l4", "Dense\nL=4"), ("full_loop_k2", "Full Loop\nK=2"), ("asymloop_k3", "AsymLoop K=3\nGlobal KV"),
                ("asymloop_k3_no_global", "without\nGlobal KV"), ("asymloop_k3_additive", "additive\ninjection"),
                ("asymloop_k3_no_local", "without\nLocal KV")]


def chain_runs(name: str = "chain_task") -> tuple[dict, list[dict]]:
    ct = json.loads((RESULTS / f"{name}.json").read_text())
    return ct["setting"], ct["runs"]


def seed_dots(ax, x, runs, color, marker, hops, spread=0.05):
    """One dot per seed at x (spread sideways), filled where the run converged, hollow where it did not."""
    for i, r in enumerate(sorted(runs, key=lambda r: r["seed"])):
        xi = x + spread * (i - (len(runs) - 1) / 2)
        ax.plot(xi, r["acc_by_test_k"][str(r["n_iter"])][str(hops)], marker, ms=6.5, mec=color, mew=1.3,
                color=color if r["converged"] else "white")


def chain_panel(ax, hops: int = 3):
    setting, runs = chain_runs()
    base = [r for r in runs if not r["name"].startswith("asymloop_k3_")]  # the depth sweep; the context-access arms: next panel
    for j, (arch, (color, marker, label)) in enumerate(CHAIN_STYLE.items()):
        ax.plot([], [], marker, ms=6.5, color=color, label=label)
        for d in sorted({r["effective_depth"] for r in base if r["arch"] == arch}):
            group = [r for r in base if r["arch"] == arch and r["effective_depth"] == d]
            x = d + 0.3 * (j - 1)
            seed_dots(ax, x, group, color, marker, hops)
            ax.text(x, 1.07, f"{sum(r['converged'] for r in group)}/{len(group)}", ha="center", fontsize=8, color=color)
    ax.axhline(1.0, color="0.8", lw=0.8)
    ax.set_ylim(0, 1.13)
    ax.set_xlabel("effective depth (blocks per token)")
    ax.set_ylabel(f"{hops}-hop accuracy, check programs")
    ax.set_title(f"Variable-binding chains: one dot per seed\nfilled: converged within {setting['max_steps']:,} steps "
                 f"(solved/seeds above)", fontsize=10)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="y", lw=0.3)


def context_panel(ax, hops: int = 3):
    setting, runs = chain_runs("chain_context")  # the six depth-4 arms trained side by side (what notebook 03 reads)
    by = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    arms = [(n, label) for n, label in CONTEXT_ARMS if n in by]
    for i, (n, _) in enumerate(arms):
        color, marker, _ = CHAIN_STYLE[by[n][0]["arch"]]
        seed_dots(ax, i, by[n], color, marker, hops, spread=0.12)
        ax.text(i, 1.07, f"{sum(r['converged'] for r in by[n])}/{len(by[n])}", ha="center", fontsize=8, color=color)
    ax.axhline(1.0, color="0.8", lw=0.8)
    ax.set_ylim(0, 1.13)
    ax.set_xticks(range(len(arms)), [label for _, label in arms], fontsize=8)
    ax.set_ylabel(f"{hops}-hop accuracy, check programs")
    ax.set_title("The same task at effective depth 4:\nhow AsymLoop E = D = 1, K = 3 reads the encoder", fontsize=10)
    ax.grid(axis="y", lw=0.3)


def main():
    for name, fig in (("asymloop.png", architecture_figure()), ("notebook_results.png", results_figure())):
        fig.savefig(DOCS / name)
        print(f"wrote {DOCS / name}")


if __name__ == "__main__":
    main()
