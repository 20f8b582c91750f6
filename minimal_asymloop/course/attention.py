"""Notebook 01's plumbing: small tables for the numeric trace of joint attention, and the checks that compare a
piece built in the notebook with the package's module (and show a wrong version failing)."""

import torch


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
