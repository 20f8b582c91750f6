"""Notebook 01's plumbing: small tables for the numeric trace of joint attention, and the checks that compare a
piece built in the notebook with the package's module (and show a wrong version failing)."""

import torch

from minimal_asymloop.course.draw import COLORS, FONT, NotebookFigure


def key_labels(n: int) -> list[str]:
    """Column names of the (N, 2N) score matrix: Global keys G0..G(N-1), then Local keys L0..L(N-1)."""
    return [f"G{j}" for j in range(n)] + [f"L{j}" for j in range(n)]


def table(title: str, rows, cols: list[str] | None = None, row_name: str = "token", width: int = 7,
          digits: int = 3) -> str:
    """A small matrix (list of rows, or a 1-D or 2-D tensor) as aligned text; -inf prints as '-inf', and a bar
    separates the Global half from the Local half when the columns are key_labels."""
    m = torch.as_tensor(rows, dtype=torch.float64)
    m = m[:, None] if m.dim() == 1 else m
    if m.dim() != 2:
        raise ValueError(f"table takes a 1-D or 2-D matrix, got shape {tuple(m.shape)}; pick one head and batch row")
    cols = cols or [str(j) for j in range(m.size(1))]
    if len(cols) != m.size(1):
        raise ValueError(f"{len(cols)} column names for {m.size(1)} columns; pass one name per column")
    split = m.size(1) // 2 if cols == key_labels(m.size(1) // 2) and m.size(1) % 2 == 0 else None

    def cell(x):
        return "-inf".rjust(width) if x == float("-inf") else f"{x:{width}.{digits}f}"

    def line(first, items):
        items = list(items)
        if split:
            items.insert(split, " |")
        return f"{first:>8}" + "".join(items)

    out = [title, line("", (c.rjust(width) for c in cols))]
    out += [line(f"{row_name} {i}", (cell(x) for x in r.tolist())) for i, r in enumerate(m)]
    return "\n".join(out)


def show(title: str, rows, cols: list[str] | None = None, **kw):
    print(table(title, rows, cols, **kw) + "\n")


def check(label: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-10):
    """Assert that a piece built in the notebook equals the package's within tol (float64 rounding: about 1e-14 in
    notebook 01); print the largest difference."""
    if got.shape != want.shape:
        raise AssertionError(f"{label}: shape {tuple(got.shape)} against {tuple(want.shape)}")
    diff = (got - want).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{label}: largest difference {diff:.2g} > tolerance {tol:g}")
    print(f"OK      {label}: largest difference {diff:.1g}")


def show_failing(label: str, run):
    """Run a check on a wrong version: it must raise AssertionError, which is printed (so the notebook goes on).
    A wrong version that passes is an error: the check could not tell it apart."""
    try:
        run()
    except AssertionError as e:
        print(f"CAUGHT  wrong version ({label}): {e}")
        return
    raise RuntimeError(f"the check passed on a wrong version ({label}); it cannot tell the two apart")


def global_shares(scores: torch.Tensor, mask: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """w_G per query: the Global half's share of ONE softmax over the (N, 2N) masked scores, the Global half's scores
    multiplied by global_scale."""
    n = scores.size(-1) // 2
    s = torch.cat([global_scale * scores[..., :n], scores[..., n:]], dim=-1)
    return s.masked_fill(~mask, float("-inf")).softmax(-1)[..., :n].sum(-1)


def competition_figure(scores: torch.Tensor, mask: torch.Tensor, global_scale: float = 1.0, max_scale: float = 3.0):
    """Left: the one softmax's probabilities (N, 2N) with the Global scores times global_scale. Right: w_G per token
    against the Global scale, one softmax (a curve per token) against two softmaxes averaged (0.5 whatever the scores)."""
    if scores.dim() != 2 or scores.shape != mask.shape or scores.size(1) != 2 * scores.size(0):
        raise ValueError(f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must both be (N, 2N); pass one head")
    n = scores.size(0)
    s = torch.cat([global_scale * scores[:, :n], scores[:, n:]], dim=1)
    probs = s.masked_fill(~mask, float("-inf")).softmax(1)
    fig = NotebookFigure(figsize=(10, 3.3), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=(1.1, 1))
    ax.imshow(probs.numpy(), cmap="Purples", vmin=0, vmax=1)
    for (i, j), p in zip(torch.cartesian_prod(torch.arange(n), torch.arange(2 * n)).tolist(), probs.flatten().tolist()):
        ax.text(j, i, f"{p:.2f}" if mask[i, j] else "-", ha="center", va="center", fontsize=FONT - 1,
                color="white" if p > 0.5 else "black")
    ax.axvline(n - 0.5, color="black", lw=2)
    ax.set_xticks(range(2 * n), key_labels(n))
    ax.set_yticks(range(n), [f"token {i}" for i in range(n)])
    ax.set_xlabel("key column: Global half | Local half")
    ax.set_ylabel("query")
    ax.set_title(f"one softmax, Global scores x{global_scale:g}: each row sums to 1", fontsize=FONT)
    grid = torch.linspace(0, max_scale, 61)
    curves = torch.stack([global_shares(scores, mask, float(g)) for g in grid])  # (len(grid), N)
    shades, styles = plt_purples(n), ("-", "--", "-.", ":")  # tokens in joint attention's purple, not the halves' colours
    for i in range(n):
        bx.plot(grid.numpy(), curves[:, i].numpy(), lw=2, color=shades[i], ls=styles[i % 4], label=f"token {i}, one softmax")
    bx.axhline(0.5, color=COLORS["head"], ls=(0, (1, 1)), lw=2, label="two softmaxes averaged (any scale)")
    bx.axvline(global_scale, color="black", lw=0.8, ls=":")
    bx.set_ylim(0, 1)
    bx.set_xlabel("GLOBAL_SCALE (factor on every Global score)")
    bx.set_ylabel("$w_G$: Global share of the mass")
    bx.set_title("Only one softmax lets the halves compete", fontsize=FONT)
    bx.legend(fontsize=FONT - 2.5, loc="lower right")
    return fig


def plt_purples(n: int) -> list:
    """n shades of the joint-attention purple (light to dark) for per-token curves."""
    from matplotlib import colormaps

    return [colormaps["Purples"](0.45 + 0.5 * i / max(n - 1, 1)) for i in range(n)]


def definitions(path, tag: str, functions_only: bool = False) -> str:
    """The code of a notebook's cells tagged `tag` without what only prints or checks (calls of print, show, check and
    show_failing, and `for` loops), or with functions_only its `def`s alone (none of its forward or backward passes):
    a solutions notebook execs it to reuse the notebook's build as it is."""
    import ast
    import json
    from pathlib import Path

    cells = json.loads(Path(path).read_text())["cells"]
    tagged = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and tag in c["metadata"].get("tags", [])]
    if not tagged:
        raise ValueError(f"no code cell of {path} is tagged {tag!r}; tag the cells to reuse in their metadata")

    def shown_only(node):
        if functions_only:
            return not isinstance(node, ast.FunctionDef)
        call = node.value if isinstance(node, ast.Expr) else None
        named = isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        return isinstance(node, ast.For) or (named and call.func.id in ("print", "show", "check", "show_failing"))

    return "\n".join(ast.get_source_segment(src, node) for src in tagged for node in ast.parse(src).body
                     if not shown_only(node))


def share_table(before: torch.Tensor, after: torch.Tensor, title: str):
    """Print two (K, D) Global shares (probes.global_attention_share) side by side, one row per iteration k, then the
    mean over layers and iterations and in how many (k, layer) cells the share rose."""
    if before.shape != after.shape or before.dim() != 2:
        raise ValueError(f"shares {tuple(before.shape)} and {tuple(after.shape)} must both be (K, D)")
    print(f"{title}\nshare of each query's attention mass on Global KV (the rest is on Local KV): init -> trained")
    print(" " * 8 + "".join(f"{f'layer {d}':>16}" for d in range(before.size(1))))
    for k, (b, a) in enumerate(zip(before.tolist(), after.tolist()), start=1):
        print(f"{f'k = {k}':>8}" + "".join(f"{f'{x:.2f} -> {y:.2f}':>16}" for x, y in zip(b, a)))
    rose = (after > before).sum().item()
    print(f"mean {before.mean():.2f} -> {after.mean():.2f}; higher after training in {rose} of {after.numel()} (k, layer) cells")
