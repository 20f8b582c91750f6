"""AsymLoop drawn: one unrolled data-flow figure of the forward pass (the paper's Section 3), the (N, 2N) joint mask,
and truncated backprop through the loop (notebook 05; Huginn's, not the paper's).

`asymloop_figure(highlight=...)` greys out all but one part, so each notebook can show where it sits. All return
bare matplotlib Figures (no pyplot state): a notebook displays them, `fig.savefig` writes them.
"""

import io

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

HIGHLIGHTS = ("encoder", "global_kv", "joint_attention", "loop", "head")
MAX_ITER = 5  # more columns than this no longer fit a notebook's width
COLORS = {"encoder": "#4C72B0", "global_kv": "#DD8452", "joint_attention": "#8172B3", "loop": "#55A868",
          "head": "#595959"}
GREY = "#B4B4B4"
FONT = 10.5


class NotebookFigure(Figure):
    """A bare Figure that shows itself as a PNG when a notebook cell returns it, also in a kernel that never imported
    pyplot (which is what registers the inline backend's own display of Figures)."""

    def _repr_png_(self):
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return buf.getvalue()


class _Canvas:
    """Boxes, arrows and text in inch coordinates on one axes, each tagged with its part of the model."""

    def __init__(self, width, height, highlight):
        if highlight is not None and highlight not in HIGHLIGHTS:
            raise ValueError(f"unknown highlight {highlight!r}; choose one of None, {', '.join(map(repr, HIGHLIGHTS))}")
        self.fig = NotebookFigure(figsize=(width, height))
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(0, height)
        self.ax.axis("off")
        self.highlight = highlight

    def color(self, part):
        return COLORS[part] if self.highlight in (None, part) else GREY

    def ink(self, part):  # text colour: dark when the part is shown, grey when it is greyed out
        return "black" if part is None or self.highlight in (None, part) else "#6E6E6E"

    def box(self, x, y, w, h, text, part, fill=True, size=FONT, dashed=False):
        c = self.color(part)
        self.ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.08", lw=1.6,
                                         ec=c, fc=c + "22" if fill and c != GREY else "white",
                                         ls="--" if dashed else "-"))
        if text:
            self.text(x + w / 2, y + h / 2, text, part, size=size)

    def text(self, x, y, s, part, size=FONT, **kw):
        self.ax.text(x, y, s, ha=kw.pop("ha", "center"), va=kw.pop("va", "center"), fontsize=size,
                     color=self.ink(part), **kw)

    def arrow(self, start, end, part, style="arc3", lw=1.6):
        self.ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=13, lw=lw,
                                          color=self.color(part), connectionstyle=style, shrinkA=0, shrinkB=0))


def _elbow(cv, start, x_turn, end, part):
    """An arrow that runs right from start to x_turn, vertically to end's height, then right into end."""
    cv.ax.plot([start[0], x_turn, x_turn], [start[1], start[1], end[1]], color=cv.color(part), lw=1.6)
    cv.arrow((x_turn, end[1]), end, part)


def _mask_inset(cv, x, y, cell, n=3):
    """The (n, 2n) joint mask as n x 2n cells from (x, y) up: Global half orange, Local half green. It belongs to
    joint attention, so it keeps its colours when that part (or a half's own part) is highlighted."""
    att = cv.highlight == "joint_attention"
    for i in range(n):
        for j in range(2 * n):
            part = "global_kv" if j < n else "loop"
            fc = (COLORS[part] if att else cv.color(part)) if j % n <= i else "white"
            cv.ax.add_patch(Rectangle((x + j * cell, y + (n - 1 - i) * cell), cell, cell, lw=0.6,
                                      ec=cv.color("joint_attention"), fc=fc))
    cv.ax.plot([x + n * cell] * 2, [y, y + n * cell], color=cv.color("joint_attention"), lw=2)
    for half, (label, part) in enumerate((("$K^G$", "global_kv"), ("$K^L$", "loop"))):
        cv.text(x + (half + 0.5) * n * cell, y + n * cell + 0.13, label, "joint_attention" if att else part,
                size=FONT - 0.5)


def asymloop_figure(n_iter: int = 3, highlight: str | None = None) -> Figure:
    """AsymLoop unrolled over K = n_iter iterations; `highlight` (one of HIGHLIGHTS) greys out everything else."""
    if not isinstance(n_iter, int) or not 1 <= n_iter <= MAX_ITER:
        raise ValueError(f"n_iter={n_iter!r} cannot be drawn; choose an integer K in 1..{MAX_ITER}")
    gap, x0 = 0.55, 2.35  # iteration columns: the gap between them, the left edge of the first
    col_w = max(2.3, (6.6 - (n_iter - 1) * gap) / n_iter)  # wide enough for the Global KV text above them
    right = x0 + n_iter * col_w + (n_iter - 1) * gap  # right edge of the last iteration column
    width, height = right + 2.15, 6.4
    cv = _Canvas(width, height, highlight)
    enc, gkv, att, loop, head = HIGHLIGHTS

    # the encoder, run once: tokens -> embedding -> E blocks -> H
    cv.box(0.15, 0.25, 1.7, 0.45, "tokens", enc, fill=False)
    cv.box(0.15, 1.0, 1.7, 0.45, "embedding", enc)
    cv.box(0.15, 1.8, 1.7, 1.05, "encoder\n$E$ blocks\nrun once", enc)
    cv.box(0.55, 3.2, 0.9, 0.45, "$H$", enc)
    for y0, y1 in ((0.7, 1.0), (1.45, 1.8), (2.85, 3.2)):
        cv.arrow((1.0, y0), (1.0, y1), enc)

    # Global KV: RMSNorm(H), each decoder layer's own W_K^G, W_V^G, computed once
    cv.box(0.15, 4.05, 1.7, 0.45, "RMSNorm$(H)$", gkv)
    cv.box(0.15, 4.9, 1.7, 0.9, "each decoder\nlayer's $W_K^G,\\ W_V^G$", gkv)
    cv.arrow((1.0, 3.65), (1.0, 4.05), gkv)
    cv.arrow((1.0, 4.5), (1.0, 4.9), gkv)
    bus_y = 5.05
    cv.box(x0, bus_y, right - x0, 0.6, "", gkv)
    cv.text((x0 + right) / 2, bus_y + 0.3, "fixed $(K^G_l, V^G_l)$ for each decoder layer $l$: computed once, "
            "read by every iteration", gkv)
    cv.arrow((1.85, bus_y + 0.3), (x0, bus_y + 0.3), gkv)

    # the decoder loop, unrolled: iteration k runs the D layers; each layer makes its own Q, K^L, V^L from its
    # RMS-normed input (only layer 1 reads z_{k-1}) and reads its own fixed (K^G_l, V^G_l)
    lw, ly, lh = col_w - 0.35, (0.55, 2.55), 1.45  # layer boxes: width, bottoms (layer 1, layer D), height
    for k in range(1, n_iter + 1):
        x = x0 + (k - 1) * (col_w + gap)
        cv.box(x - 0.08, 0.04, col_w + 0.16, 4.5, "", loop, fill=False, dashed=True)
        cv.text(x + col_w / 2, 0.28, f"iteration $k={k}$: $D$ layers", loop)
        for layer, y in zip(("1", "D"), ly):
            cv.box(x + 0.25, y, lw, lh, "", loop)
            cx = x + 0.25 + lw / 2
            cv.text(cx, y + 1.2, f"decoder layer ${layer}$", loop, size=FONT - 1)
            cv.text(cx, y + 0.88, "RMSNorm $\\to Q,\\ K^L,\\ V^L$", loop, size=FONT - 1.5)
            cv.box(x + 0.32, y + 0.36, lw - 0.14, 0.36, f"one softmax, $[K^G_{layer} ; K^L]$", att, size=FONT - 1.5)
            cv.text(cx, y + 0.17, "+ residual; MLP + residual", loop, size=FONT - 1.5)
        cv.arrow((cx, ly[0] + lh), (cx, ly[1]), loop)
        cv.text(cx + 0.18, (ly[0] + lh + ly[1]) / 2, "$\\vdots$", loop)
        # this layer's own Global KV: layer D from above, layer 1 down the column's left edge
        cv.arrow((cx, bus_y), (cx, ly[1] + lh), gkv)
        cv.text(cx + 0.12, bus_y - 0.27, "$K^G_D, V^G_D$", gkv, size=FONT - 1.5, ha="left")
        cv.ax.plot([x + 0.08] * 2, [bus_y, ly[0] + 1.05], color=cv.color(gkv), lw=1.6)
        cv.arrow((x + 0.08, ly[0] + 1.05), (x + 0.25, ly[0] + 1.05), gkv)
        cv.text(x + 0.14, bus_y - 0.27, "$K^G_1, V^G_1$", gkv, size=FONT - 1.5, ha="left")
        # z_k leaves layer D's right side: to the next iteration's layer 1, or to the head
        if k < n_iter:
            _elbow(cv, (x + 0.25 + lw, 3.3), x + col_w + gap / 2, (x + col_w + gap + 0.25, 0.8), loop)
            cv.text(x + col_w + gap / 2, 3.5, f"$z_{{{k}}}$", loop)
    _elbow(cv, (1.45, 3.42), x0 - 0.24, (x0 + 0.25, 0.8), loop)
    cv.text(1.55, 3.62, "$z_0 = H$", loop, ha="left")

    # after z_K: final RMSNorm -> head -> logits; above them, the joint mask every layer's softmax uses
    hx = right + 0.45
    cv.arrow((right - 0.1, 3.3), (hx, 3.3), head)
    cv.text(right + 0.27, 3.5, f"$z_{{{n_iter}}}$", head)
    cv.box(hx, 3.05, 1.55, 0.5, "RMSNorm", head)
    cv.box(hx, 1.95, 1.55, 0.5, "head", head)
    cv.box(hx, 0.85, 1.55, 0.5, "logits", head, fill=False)
    cv.arrow((hx + 0.775, 3.05), (hx + 0.775, 2.45), head)
    cv.arrow((hx + 0.775, 1.95), (hx + 0.775, 1.35), head)
    cv.text(hx + 0.775, 5.2, "every layer's mask\n$(N, 2N)$, $N=3$:", att, size=FONT - 1)
    _mask_inset(cv, hx + 0.175, 4.0, 0.2)
    cv.text(hx + 0.775, 3.8, "row $i$: query $i$; filled: visible", att, size=FONT - 2)
    cv.text(width / 2, height - 0.3, f"AsymLoop unrolled, $K={n_iter}$: the $D$ decoder layers run $K$ times, "
            "weights shared across iterations", None, size=FONT + 1.5)
    return cv.fig


def mask_figure(n: int = 4) -> Figure:
    """The joint attention mask (N, 2N): query i sees key j of the Global half and of the Local half iff j <= i."""
    if not isinstance(n, int) or not 1 <= n <= 12:
        raise ValueError(f"n={n!r} tokens cannot be drawn legibly; choose an integer in 1..12")
    cell = 0.6
    fig = NotebookFigure(figsize=(2 * n * cell + 1.6, n * cell + 1.5), layout="constrained")
    ax = fig.add_subplot()
    for i in range(n):
        for j in range(2 * n):
            seen = j % n <= i
            ax.add_patch(Rectangle((j, i), 1, 1, lw=1, ec="white",
                                   fc=(COLORS["global_kv"] if j < n else COLORS["loop"]) if seen else "#EEEEEE"))
            ax.text(j + 0.5, i + 0.5, "1" if seen else "0", ha="center", va="center", fontsize=FONT,
                    color="white" if seen else "#999999")
    ax.axvline(n, color="black", lw=2)
    ax.set_xlim(0, 2 * n)
    ax.set_ylim(n, 0)
    ax.set_xticks([j + 0.5 for j in range(2 * n)],
                  [f"$k^G_{{{j}}}$" if j < n else f"$k^L_{{{j - n}}}$" for j in range(2 * n)], fontsize=FONT)
    ax.set_yticks([i + 0.5 for i in range(n)], [f"$q_{{{i}}}$" for i in range(n)], fontsize=FONT)
    ax.set_xlabel("key $k_j$ (subscript: position $j$): Global half (from $H$) | Local half (from the layer's input)",
                  fontsize=FONT)
    ax.set_ylabel("query position $i$", fontsize=FONT)
    ax.set_title(f"Joint mask $({n}, {2 * n})$: query $i$ sees key $j$ of both halves iff $j \\leq i$", fontsize=FONT + 1)
    ax.tick_params(length=0)
    return fig


GRAD = "#C44E52"  # the backward pass in truncation_figure


def _grad(cv, start, end, style="arc3"):
    """A dashed red arrow: the gradient, against the forward pass."""
    cv.ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.4, color=GRAD, ls="--",
                                    connectionstyle=style))


def _grad_text(cv, x, y, s, size=FONT - 2.5):
    cv.ax.text(x, y, s, ha="center", va="center", fontsize=size, color=GRAD)


def truncation_figure(K: int = 5, n: int = 2) -> Figure:
    """Truncated backprop through the loop (notebook 05), two rows: AsymLoop, whose every iteration reads the
    encoder's Global KV, and the same loop without Global KV, where the input enters only as z_0. The first K - n
    iterations run without a graph (grey, dashed); the gradient (red) goes back from the loss through the last n, and
    reaches the encoder only through Global KV."""
    if not (isinstance(K, int) and isinstance(n, int) and 1 <= n <= K <= MAX_ITER + 1):
        raise ValueError(f"K={K!r}, n={n!r} cannot be drawn; choose integers 1 <= n <= K <= {MAX_ITER + 1}")
    w, gap, x0 = 1.05, 0.35, 2.6  # iteration boxes: width, gap, left edge of the first
    right = x0 + K * w + (K - 1) * gap
    width, row_h = right + 1.6, 2.55
    cv = _Canvas(width, 2 * row_h + 0.5, None)
    for row, with_global in enumerate((True, False)):
        y = (1 - row) * row_h + 0.25  # bottom of this row
        title = ("AsymLoop: every iteration reads the encoder's Global KV" if with_global else
                 "without Global KV: the input enters the loop only as $z_0$")
        cv.text(0.15, y + 2.15, title, None, size=FONT + 0.5, ha="left")
        cv.box(0.15, y + 0.35, 1.5, 0.6, "embedding,\nencoder: $H$", "encoder", size=FONT - 1)
        mid = y + 0.65
        cv.arrow((1.65, mid), (x0, mid), "loop")
        cv.text((1.65 + x0) / 2, mid + 0.17, "$z_0$", "loop", size=FONT - 1)
        if with_global:  # the Global KV bar over the iterations, fed once from H
            cv.box(x0, y + 1.4, right - x0, 0.35, "fixed Global KV, made from $H$ once", "global_kv", size=FONT - 1)
            cv.arrow((0.55, y + 0.95), (x0, y + 1.62), "global_kv", style="arc3,rad=-0.3")
        for k in range(1, K + 1):
            x = x0 + (k - 1) * (w + gap)
            graph = k > K - n
            part = "loop" if graph else "head"
            cv.box(x, y + 0.35, w, 0.6, f"iteration {k}", part, fill=graph, dashed=not graph, size=FONT - 1)
            if not graph:
                cv.text(x + w / 2, y + 0.17, "no graph", "head", size=FONT - 2.5)
            if k < K:
                cv.arrow((x + w, mid), (x + w + gap, mid), "loop")
            if with_global:
                cv.arrow((x + w / 2, y + 1.4), (x + w / 2, y + 0.95), "global_kv")
                if graph:  # the gradient into Global KV, and from there to the encoder
                    _grad(cv, (x + w * 0.75, y + 0.95), (x + w * 0.75, y + 1.4))
            if graph:  # the gradient back through the iterations that kept a graph
                start = right + 0.2 if k == K else x + w + gap
                _grad(cv, (start, mid - 0.2), (x + w, mid - 0.2))
        cv.box(right + 0.2, y + 0.35, 1.1, 0.6, "loss", "head", fill=False)
        cut = x0 + (K - n) * (w + gap) - gap / 2  # between the last no-graph iteration and the first with one
        if n < K:
            cv.ax.plot([cut, cut], [y + 0.2, y + 1.1], color=GRAD, lw=2)
            _grad_text(cv, cut, y + 0.08 if with_global else y + 1.2, "cut", size=FONT - 1.5)
        if with_global:
            _grad(cv, (x0, y + 1.48), (1.3, y + 0.97), style="arc3,rad=0.25")
        _grad_text(cv, 0.9, y + 0.12, "the encoder's gradient\ncomes through Global KV" if with_global else
                   "no gradient reaches\nthe encoder")
    cv.text(width / 2, 2 * row_h + 0.25, f"Backprop through the last $n={n}$ of $K={K}$ iterations: forward in colour, "
            "the gradient red and dashed", None, size=FONT + 1)
    return cv.fig
