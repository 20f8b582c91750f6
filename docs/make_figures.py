"""Draw the README's figures into docs/: the three architectures, and the notebooks' key result.

    python docs/make_figures.py          # writes docs/asymloop.png and docs/notebook_results.png

The second figure reads the precomputed runs in notebooks/results/ (written by
`python -m minimal_asymloop.experiments all`); run this again after they change.
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


def val_losses(name: str) -> dict[str, list[float]]:
    """{run name: [val loss per seed]} from notebooks/results/<name>.json."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        sys.exit(f"error: {path} is missing; run `python -m minimal_asymloop.experiments {name}` first")
    runs = {}
    for r in json.loads(path.read_text())["runs"]:
        runs.setdefault(r["name"], []).append(r["val_loss"])
    return runs


def results_figure() -> Figure:
    """Validation loss at matched effective depth, with and without Global KV (mean; bars span the seeds)."""
    runs = {**val_losses("matched_depth"), **val_losses("global_kv")}
    groups = [("effective depth 4 (L)", [("Dense", "dense"), ("AsymLoop K=1\nwithout Global KV", "asymloop_k1_no_global"),
                                         ("AsymLoop K=1", "asymloop_k1")]),
              ("effective depth 8 (2L)", [("Full Loop K=2", "full_loop_k2"), ("AsymLoop K=3\nwithout Global KV", "asymloop_k3_no_global"),
                                          ("AsymLoop K=3", "asymloop_k3")])]
    colors = ["#636363", "#31a354", "#e6550d"]
    fig = Figure(figsize=(8.5, 3.8), dpi=150)
    ax = fig.subplots()
    ticks, labels, n_seeds = [], [], set()
    top = max(max(v) for v in runs.values()) + 0.05
    for g, (group, members) in enumerate(groups):
        for i, (label, key) in enumerate(members):
            vals = runs[key]
            n_seeds.add(len(vals))
            mean, pos = statistics.fmean(vals), g * 4 + i
            err = [[mean - min(vals)], [max(vals) - mean]]
            ax.errorbar(pos, mean, yerr=err, fmt="o", ms=8, color=colors[i], capsize=4)
            ax.text(pos + 0.15, mean, f"{mean:.3f}", va="center", fontsize=8)
            ticks.append(pos)
            labels.append(label)
        ax.text(g * 4 + 1, top, group, ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_ylim(min(min(v) for v in runs.values()) - 0.05, top + 0.05)
    ax.set_xlim(-0.6, 6.8)
    ax.set_xticks(ticks, labels, fontsize=7.5)
    ax.set_ylabel("validation cross-entropy (nats/token)")
    seeds = "/".join(str(n) for n in sorted(n_seeds))
    ax.set_title(f"Matched depth, with and without Global KV: tiny CPU setting, {seeds} seed{'s' * (seeds != '1')}, "
                 f"mean and range; lower is better", fontsize=8.5)
    ax.grid(axis="y", lw=0.3)
    fig.tight_layout()
    return fig


def main():
    for name, fig in (("asymloop.png", architecture_figure()), ("notebook_results.png", results_figure())):
        fig.savefig(DOCS / name)
        print(f"wrote {DOCS / name}")


if __name__ == "__main__":
    main()
