"""The package's layout: no import circles, imports only downward through the floors below, and files of a readable
size. Imports are read with `ast`, wherever they are: at module level, inside functions, under TYPE_CHECKING."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minimal_asymloop"

# Each module's floor: a module imports only modules on its own floor or below (a subpackage such as experiments/
# takes its own entry). A new module needs a line here.
FLOORS = {
    # 0: plumbing and standalone algorithms; they import nothing of the package
    "paths": 0, "system": 0, "sources": 0, "alrs": 0, "gsm8k": 0,
    # 1: the model with its kernels, decoding and FLOP count; the data; metrics, probes and the run-folder lock
    "kernels": 1, "generate": 1, "model": 1, "flops": 1, "data": 1, "metrics": 1, "probes": 1, "runfolder": 1, "loss": 1, "batches": 1,
    "integrity": 1, "depth": 1,
    # 2: training: its configs and presets, the optimizer, checkpoints, the trainer and the small-task trainer;
    # the transformers wrapper and the files of its export
    "config": 2, "optim": 2, "checkpoint": 2, "trainer": 2, "tasks": 2, "hf": 2, "hf_files": 2,
    # 3: the commands, and what only they use
    "evaluate": 3, "harness": 3, "finetune": 3, "sample": 3, "hub": 3, "bench": 3, "bench_gpu": 3, "nbtools": 3,
    "experiments": 3, "adaptive": 3,
    # 4: what the notebooks import (figures and tables), above everything they show
    "course": 4,
}
MAX_LINES = 450  # every module but model.py, the one file that reads like the paper's Section 3
LONGER_ALLOWED = {"model"}


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted name relative to the package ('' for its __init__, 'experiments.lm'): (path, is a package)}."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imports(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, all import statements anywhere in its file."""
    mods, top = modules(root), root.name
    graph = {}
    for name, (path, is_pkg) in mods.items():
        here = [top, *name.split(".")] if name else [top]
        package = here if is_pkg else here[:-1]  # what a relative import starts from
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # `from pkg import x` imports the module pkg.x when there is one, else a name of pkg
                targets = [f"{module}.{a.name}" if _local(f"{module}.{a.name}", top) in mods else module for a in node.names]
            else:
                continue
            found.update(_local(t, top) for t in targets if t == top or t.startswith(top + "."))
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def _local(dotted: str, top: str) -> str:
    return dotted.removeprefix(top).removeprefix(".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def floor_of(name: str) -> int | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # experiments.lm: its own entry, else the subpackage's
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    return None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower floor to a higher one, as 'a (floor i) imports b (floor j)'."""
    known = lambda m: m and floor_of(m) is not None  # a module without a floor fails the test for that
    return [f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})" for m in sorted(graph) if known(m)
            for d in sorted(graph[m]) if known(d) and floor_of(d) > floor_of(m)]


def too_long(root: Path) -> list[str]:
    return [f"{path.relative_to(root.parent)}: {n} lines" for name, (path, _) in modules(root).items()
            if name not in LONGER_ALLOWED and (n := len(path.read_text().splitlines())) > MAX_LINES]


def write(root: Path, files: dict[str, str]):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


# ----------------------------------------------------------------------------- the walker itself, on a made-up package


def test_every_import_form_is_seen(tmp_path):
    pkg = tmp_path / "pkg"
    write(pkg, {"__init__.py": "", "low.py": "", "mid.py": "", "high.py": "", "other.py": "", "sub/__init__.py": "",
                "sub/a.py": "from . import b\nfrom .b import f\nfrom .. import low\n",
                "sub/b.py": "from ..mid import g\ndef f(): pass\n",
                "sub/c.py": "import pkg.sub.a\nfrom pkg.sub import shared_name\n",
                "uses.py": ("import os\nfrom typing import TYPE_CHECKING\nfrom pkg import low\nimport pkg.mid\n"
                            "from pkg.high import h\nif TYPE_CHECKING:\n    from pkg.sub import a\n"
                            "def f():\n    from pkg import other\n")})
    graph = imports(pkg)
    assert graph["uses"] == {"low", "mid", "high", "sub.a", "other"}  # module level, TYPE_CHECKING, in a function
    assert graph["sub.a"] == {"sub.b", "low"} and graph["sub.b"] == {"mid"}  # relative imports
    assert graph["sub.c"] == {"sub.a", "sub"}  # a name of the subpackage's __init__ is an import of it
    assert find_cycle(graph) is None


def test_a_circle_is_found_even_through_a_function_body(tmp_path):
    pkg = tmp_path / "pkg"
    write(pkg, {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.c import x\n",
                "c.py": "if False:\n    import pkg.a\n"})
    assert find_cycle(imports(pkg)) == ["a", "b", "c", "a"]
    write(pkg, {"c.py": ""})
    assert find_cycle(imports(pkg)) is None


# ----------------------------------------------------------------------------- the package


def test_no_import_circles():
    cycle = find_cycle(imports(PACKAGE))
    assert cycle is None, "import circle: " + " -> ".join(cycle or []) + "; move the shared piece down a floor"


def test_every_module_has_a_floor():
    missing = [m for m in modules(PACKAGE) if m and floor_of(m) is None]
    assert not missing, f"modules without a floor: {missing}; add each to FLOORS in tests/test_structure.py"


def test_imports_only_go_down_the_floors():
    graph = imports(PACKAGE)
    assert "model" in graph["flops"] and "trainer" in graph["experiments.common"]  # the walker sees this package
    bad = upward(graph)
    assert not bad, "upward imports: " + "; ".join(bad)


def test_floor_rule_catches_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    write(pkg, {"__init__.py": "", "model.py": "", "trainer.py": "from pkg import model\n"})
    monkeypatch.setitem(FLOORS, "model", 1)
    assert upward(imports(pkg)) == []
    write(pkg, {"model.py": "def f():\n    from pkg.trainer import train\n"})
    assert upward(imports(pkg)) == ["model (floor 1) imports trainer (floor 2)"]


def test_no_module_but_model_is_over_the_line_limit():
    assert not too_long(PACKAGE), f"over {MAX_LINES} lines: " + ", ".join(too_long(PACKAGE)) + "; split each by idea"


def test_the_model_file_imports_only_what_the_model_needs():
    """A reader of model.py pulls in its kernels, decoding and loss, never the data pipeline or evaluation."""
    graph, seen, todo = imports(PACKAGE), set(), ["model"]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    assert seen == {"generate", "kernels", "loss"}, seen
