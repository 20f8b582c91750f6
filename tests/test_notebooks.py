"""The committed notebooks read well on GitHub: every figure a cell draws is stored as that cell's image output.
And package plotting builds bare Figures, so it never switches a live notebook's backend off."""

import json
import re
from pathlib import Path

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# A code cell draws a figure if it shows, creates or displays one (pyplot, a bare Figure, or a saved PNG).
DRAWS = re.compile(r"plt\.(show|subplots|figure|imshow)\(|\bFigure\(|display\(\s*(fig|Image)|\bImage\(")


def _code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"]), c.get("outputs", [])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def _n_images(outputs):
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _draws(source, outputs):
    code = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments don't draw
    returned_figure = any("<Figure size" in "".join(o.get("data", {}).get("text/plain", "")) for o in outputs)
    return bool(DRAWS.search(code)) or returned_figure


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_drawn_figure_is_committed_in_its_cell(path):
    """A cell that draws holds an image/png output; a cell that draws nothing holds none (a figure that
    turns up under a later cell, as after a backend switch, fails both ways)."""
    missing = [i for i, src, outs in _code_cells(path) if _draws(src, outs) and _n_images(outs) == 0]
    stray = [i for i, src, outs in _code_cells(path) if not _draws(src, outs) and _n_images(outs) > 0]
    assert not missing, (f"{path.name}: cells {missing} draw a figure but hold no image/png output; "
                         f"execute the notebook with the inline backend: env -u MPLBACKEND jupyter nbconvert --to notebook "
                         f"--execute --inplace {path.name}")
    assert not stray, f"{path.name}: cells {stray} draw nothing but hold an image (a figure from an earlier cell?)"


def test_figure_detector_catches_each_way_of_drawing():
    no_png = [{"output_type": "stream", "text": ["ok"]}]
    for src in ("plt.show()", "fig, ax = plt.subplots()", "display(fig)", "display(Image(path))", "fig = Figure()"):
        assert _draws(src, no_png), src
    assert _draws("fig", [{"output_type": "execute_result", "data": {"text/plain": ["<Figure size 640x480 with 1 Axes>"]}}])
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
