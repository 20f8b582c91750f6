"""The committed notebooks read well on GitHub and run anywhere. Every figure a cell draws is stored as that cell's
image output, and package plotting builds bare Figures, so it never switches a live notebook's backend off. Every
notebook under notebooks/ (solutions included) carries no run-to-run metadata, opens on Colab from its badge, installs
the package there in its first code cell, and finds its files through minimal_asymloop.paths."""

import json
import re

import matplotlib
import pytest

from minimal_asymloop.nbtools import volatile
from minimal_asymloop.paths import REPO, REPO_URL

NOTEBOOKS = sorted(p for p in (REPO / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)

# The Colab install every notebook's first code cell starts with (see the notebook conventions): it clones REPO_URL.
COLAB_SETUP = f"""# On Colab: clone the repository and install it (about a minute); anywhere else this cell does nothing.
import os, subprocess, sys
if "google.colab" in sys.modules:
    if not os.path.isdir("/content/minimal-asymloop"):
        subprocess.run(["git", "clone", "--depth", "1", "{REPO_URL}",
                        "/content/minimal-asymloop"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/minimal-asymloop"], check=True)
    sys.path.insert(0, "/content/minimal-asymloop")  # a running kernel does not see a fresh editable install
"""
# A path relative to the working directory: "results/...", "../out/...", "../results" (use paths.RESULTS / OUT instead).
RELATIVE_PATH = re.compile(r"""["'](?:\.\./)*(?:results|out)/|["'](?:\.\./)+(?:results|out)\b""")

# A code cell draws a figure if it shows, creates or displays one (pyplot, a bare Figure, or a saved PNG).
DRAWS = re.compile(r"plt\.(show|subplots|figure|imshow)\(|\bFigure\(|display\(\s*(fig|Image)|\bImage\(")
RETURNED_FIGURE = re.compile(r"<\w*Figure size")  # a cell's value is a Figure (or a subclass: course.draw's NotebookFigure)


def _code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"]), c.get("outputs", [])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def _n_images(outputs):
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _draws(source, outputs):
    code = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments don't draw
    returned_figure = any(RETURNED_FIGURE.search("".join(o.get("data", {}).get("text/plain", ""))) for o in outputs)
    return bool(DRAWS.search(code)) or returned_figure


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS
    assert any(p.parent.name == "solutions" for p in NOTEBOOKS), "the search misses notebooks/solutions/"


def _nb(path):
    return json.loads(path.read_text())


def _rel(path):
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_no_volatile_metadata(path):
    """Execution timestamps and UI state change on every run; committed notebooks carry none."""
    found = volatile(_nb(path))
    assert not found, f"{_rel(path)}: volatile metadata at {found[:5]}; python -m minimal_asymloop.nbtools strip {_rel(path)}"


def test_volatile_metadata_is_caught():
    nb = _nb(NOTEBOOKS[0])
    assert volatile(nb) == []
    nb["cells"][1].setdefault("metadata", {})["execution"] = {"iopub.execute_input": "2026-11-30T10:00:00.000000Z"}
    assert volatile(nb) == ["cell 1: execution"]


def colab_problems(nb: dict, rel: str) -> list[str]:
    """What keeps a notebook from opening on Colab from its badge and installing the package there."""
    cells = nb["cells"]
    first_md = next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")
    first_code = next(("".join(c["source"]) for c in cells if c["cell_type"] == "code"), "")
    owner_repo = REPO_URL.removeprefix("https://github.com/")
    badge = f"(https://colab.research.google.com/github/{owner_repo}/blob/main/{rel})"
    problems = []
    if "colab-badge.svg" not in first_md or badge not in first_md:
        problems.append(f"the first markdown cell has no Colab badge linking {badge[1:-1]}")
    if not first_code.startswith(COLAB_SETUP):
        problems.append("the first code cell is not the Colab setup cell (clone REPO_URL, pip install -e) of the conventions")
    elif not re.search(r"^DEVICE = ", first_code, re.M):
        problems.append("the setup cell sets no DEVICE knob")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_opens_on_colab(path):
    problems = colab_problems(_nb(path), _rel(path))
    assert not problems, f"{_rel(path)}: " + "; ".join(problems)


def test_colab_check_catches_each_problem():
    nb, rel = _nb(NOTEBOOKS[0]), _rel(NOTEBOOKS[0])
    assert colab_problems(nb, rel) == []
    assert len(colab_problems(nb, "notebooks/other.ipynb")) == 1  # a badge pointing at another notebook
    first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    first_code["source"] = "".join(first_code["source"]).replace(REPO_URL, "https://github.com/someone/fork")
    assert any("setup cell" in p for p in colab_problems(nb, rel))


def relative_paths(nb: dict) -> list[str]:
    code = ["\n".join(line.split("#")[0] for line in "".join(c["source"]).splitlines()) for c in nb["cells"] if c["cell_type"] == "code"]
    return [m.group(0) for src in code for m in RELATIVE_PATH.finditer(src)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_paths_do_not_depend_on_the_working_directory(path):
    found = relative_paths(_nb(path))
    assert not found, (f"{_rel(path)}: relative paths {found}; use minimal_asymloop.paths (RESULTS / \"x.json\", "
                       f"OUT / \"nbNN_run\") so the notebook runs from any directory and on Colab")


def test_relative_path_check_catches_each_form():
    def nb(src):
        return {"cells": [{"cell_type": "code", "source": src}]}
    for bad in ('Path("results/alrs.json")', 'out_dir="../out/nb00_tour"', "load_model('../out')", 'x = "../results"'):
        assert relative_paths(nb(bad)), bad
    for good in ('RESULTS / "alrs.json"', 'OUT / "nb00_tour"', 'dict(out_dir=str(OUT / "x"))', '# see results/x.json'):
        assert not relative_paths(nb(good)), good


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_every_drawn_figure_is_committed_in_its_cell(path):
    """A cell that draws holds an image/png output; a cell that draws nothing holds none (a figure that
    turns up under a later cell, as after a backend switch, fails both ways)."""
    missing = [i for i, src, outs in _code_cells(path) if _draws(src, outs) and _n_images(outs) == 0]
    stray = [i for i, src, outs in _code_cells(path) if not _draws(src, outs) and _n_images(outs) > 0]
    assert not missing, (f"{path.name}: cells {missing} draw a figure but hold no image/png output; "
                         f"execute the notebook with the inline backend: python -m minimal_asymloop.nbtools run {_rel(path)}")
    assert not stray, f"{path.name}: cells {stray} draw nothing but hold an image (a figure from an earlier cell?)"


def test_figure_detector_catches_each_way_of_drawing():
    no_png = [{"output_type": "stream", "text": ["ok"]}]
    for src in ("plt.show()", "fig, ax = plt.subplots()", "display(fig)", "display(Image(path))", "fig = Figure()"):
        assert _draws(src, no_png), src
    for shown in ("<Figure size 640x480 with 1 Axes>", "<NotebookFigure size 1175x640 with 1 Axes>"):
        assert _draws("fig", [{"output_type": "execute_result", "data": {"text/plain": [shown]}}])
    assert not _draws("print(1)  # plt.show() would draw", no_png)


def test_package_plotting_leaves_the_backend_alone(tmp_path):
    """plot_metrics and plot_alrs build bare Figures: the caller's backend (here svg, in a notebook inline) is kept,
    and no pyplot figure is left open."""
    import matplotlib.pyplot as plt

    from minimal_asymloop import alrs
    from minimal_asymloop.trainer import plot_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        dict(step=1, loss=6.0), dict(step=2, loss=5.5, val_loss=5.6)]))
    records = [dict(step=1, alrs_step=0, alrs_multiplier={"encoder.0.mlp.up.weight": 2.0, "decoder.0.mlp.up.weight": 3.0})]
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        assert plot_metrics(tmp_path, unigram_entropy=5.0) == tmp_path / "loss.png"
        assert alrs.plot_alrs(records, 50, 100, tmp_path / "alrs.png") == {"FFN": 3.0 / 2.0}
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
    finally:
        matplotlib.use(before)
    assert (tmp_path / "loss.png").stat().st_size > 10_000 and (tmp_path / "alrs.png").stat().st_size > 10_000


# The course's size rules (issue #28): one idea per notebook, a 20-30 minute read: at most 35 cells and 30,000
# characters of markdown and code source, and no code cell over 30 lines (plumbing belongs in minimal_asymloop.course).
MAX_CELLS, MAX_SOURCE_CHARS, MAX_CODE_LINES = 35, 30_000, 30
COURSE = [p for p in NOTEBOOKS if p.parent.name == "notebooks"]


def course_size_problems(nb: dict) -> list[str]:
    cells = nb["cells"]
    chars = sum(len("".join(c["source"])) for c in cells if c["cell_type"] in ("markdown", "code"))
    long_code = [i for i, c in enumerate(cells) if c["cell_type"] == "code" and len("".join(c["source"]).splitlines()) > MAX_CODE_LINES]
    return ([f"{len(cells)} cells (at most {MAX_CELLS})"] * (len(cells) > MAX_CELLS)
            + [f"{chars:,} characters of source (at most {MAX_SOURCE_CHARS:,})"] * (chars > MAX_SOURCE_CHARS)
            + [f"code cell {i} has over {MAX_CODE_LINES} lines" for i in long_code])


def test_the_size_rule_catches_each_kind_of_overrun():
    md, code = {"cell_type": "markdown", "source": ["x" * 100]}, {"cell_type": "code", "source": ["y\n"] * 31}
    assert course_size_problems({"cells": [md] * 35}) == []
    assert course_size_problems({"cells": [md] * 36}) == ["36 cells (at most 35)"]
    assert course_size_problems({"cells": [{"cell_type": "markdown", "source": ["x" * 30_001]}]}) == [
        "30,001 characters of source (at most 30,000)"]
    assert course_size_problems({"cells": [md, code]}) == ["code cell 1 has over 30 lines"]


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_each_course_notebook_keeps_the_size_rules(path):
    assert len(COURSE) == 7
    problems = course_size_problems(json.loads(path.read_text()))
    assert not problems, f"{path.name}: " + "; ".join(problems) + ": cut prose or move plumbing into minimal_asymloop.course"
