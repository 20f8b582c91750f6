"""Notebook 02's drawing of the three ways the decoder reads the encoder output H (Global KV, additive injection,
neither), unrolled over the decoder iterations. A bare matplotlib Figure (the caller's backend is kept)."""

from matplotlib.figure import Figure

CONTEXT_VARIANTS = {  # run name suffix: (panel title, the recurrence, what each decoder block attends to, its input)
    "": ("with Global KV (joint attention)", r"$z_0=H,\ z_k=\mathrm{Dec}(z_{k-1};\,K^G,V^G)$",
         "attends to $[K^G ; K^L]$ under one softmax", "$z_{k-1}$"),
    "_additive": ("additive injection", r"$z_0=0,\ z_k=\mathrm{Dec}(z_{k-1}+H)$", "attends to its own $K^L$ only",
                  "$z_{k-1}+H$"),
    "_no_global": ("without Global KV (ablation)", r"$z_0=H,\ z_k=\mathrm{Dec}(z_{k-1})$",
                   "attends to its own $K^L$ only", "$z_{k-1}$"),
}


def context_figure(n_iter: int = 3) -> Figure:
    """The three context-access variants side by side, unrolled over `n_iter` decoder iterations: how the encoder
    output H reaches the decoder (Global KV at every iteration, added before every iteration, or only as z_0)."""
    from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch
    enc_c, kv_c, dec_c = "#4C72B0", "#DD8452", "#55A868"
    pw, step, w = 1.55 + 1.0 * n_iter, 1.0, 0.55  # panel width, Dec box pitch and width (inches)
    fig = Figure(figsize=(3 * pw, 4.8))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, 3 * pw), ylim=(0, 4.8))
    ax.text(1.5 * pw, 4.72, f"How the decoder reads the encoder output H, unrolled over K = {n_iter} iterations "
            "(Dec: the D weight-tied decoder blocks)", ha="center", va="top", fontsize=11.5, weight="bold")
    ax.axis("off")

    def arrow(a, b, color="k"):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=11, lw=1.3, color=color, shrinkA=0,
                                     shrinkB=0))

    def box(x, y, bw, bh, text, color, size=9.5):
        ax.add_patch(FancyBboxPatch((x, y), bw, bh, boxstyle="round,pad=0,rounding_size=0.06", lw=1.5, ec=color,
                                    fc=color + "22"))
        ax.text(x + bw / 2, y + bh / 2, text, ha="center", va="center", fontsize=size)

    for i, (suffix, (title, rule, attends, source)) in enumerate(CONTEXT_VARIANTS.items()):
        ox, y = i * pw, 2.2  # panel origin; the decoder row's bottom
        xs = [ox + 1.3 + step * k for k in range(n_iter)]  # left edge of each iteration's Dec box
        mid = y + 0.25
        ax.text(ox + pw / 2, 4.3, f"{title}\nrun: asymloop_k{n_iter}{suffix}", ha="center", va="top", fontsize=10.5)
        box(ox + 0.1, 0.95, 0.9, 0.45, "Enc (once)", enc_c)
        ax.text(ox + 0.68, 1.62, "H", fontsize=11, weight="bold", color=enc_c, va="center")
        for k, x in enumerate(xs, 1):
            box(x, y, w, 0.5, f"Dec\nk={k}", dec_c, size=9)
            right = xs[k] if k < n_iter else x + w + 0.4
            arrow((x + w, mid), (right, mid))
            ax.text((x + w + right) / 2, mid + 0.12, f"$z_{k}$", ha="center", va="bottom", fontsize=10)
        if suffix == "_additive":  # z_0 = 0; H added before every iteration
            ax.text(xs[0] - 0.45, mid + 0.08, "$z_0=0$", ha="right", va="bottom", fontsize=10)
            ax.plot([ox + 0.55, ox + 0.55, xs[-1] - 0.2], [1.4, 1.8, 1.8], color=enc_c, lw=1.3)
            for x in xs:
                c = (x - 0.2, mid)
                ax.add_patch(Circle(c, 0.09, fc="white", ec=enc_c, lw=1.3, zorder=3))
                ax.text(*c, "+", ha="center", va="center", fontsize=9, color=enc_c, zorder=4)
                arrow((x - 0.2, 1.8), (x - 0.2, mid - 0.09), enc_c)
            arrow((xs[0] - 0.5, mid), (xs[0] - 0.29, mid))
        else:  # z_0 = H
            ax.plot([ox + 0.55, ox + 0.55], [1.4, mid], color=enc_c, lw=1.3)
            arrow((ox + 0.55, mid), (xs[0], mid), enc_c)
            ax.text((ox + 0.55 + xs[0]) / 2, mid + 0.08, "$z_0=H$", ha="center", va="bottom", fontsize=10)
        if suffix == "":  # Global KV: made once from RMSNorm(H), read by every iteration
            box(xs[0], 3.15, xs[-1] + w - xs[0], 0.5,
                "$K^G_l, V^G_l$ = RMSNorm(H) $W^G_l$ per block $l$:\nmade once, read at every k", kv_c, size=8.5)
            ax.plot([ox + 0.3, ox + 0.3, xs[0]], [1.4, 3.4, 3.4], color=kv_c, lw=1.3)
            for x in xs:
                arrow((x + w / 2, 3.15), (x + w / 2, y + 0.5), kv_c)
        ax.text(ox + pw / 2, 0.75, f"{rule}\neach Dec block {attends};\n$Q$, $K^L$, $V^L$ come from {source} at every k",
                ha="center", va="top", fontsize=9)
    for i in (1, 2):
        ax.plot([i * pw - 0.05] * 2, [0.05, 4.3], color="0.8", lw=1)
    return fig
