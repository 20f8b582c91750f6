"""The mechanism drawn (minimal_asymloop/course/draw.py): every highlight builds a figure, bad input is refused."""

import pytest
from matplotlib.figure import Figure

from minimal_asymloop.course.draw import HIGHLIGHTS, asymloop_figure, mask_figure, truncation_figure


@pytest.mark.parametrize("highlight", (None, *HIGHLIGHTS))
def test_every_highlight_builds_a_figure(highlight):
    fig = asymloop_figure(highlight=highlight)
    assert isinstance(fig, Figure)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "iteration $k=3$: $D$ layers" in texts and "iteration $k=4$: $D$ layers" not in texts  # K columns, no more
    shown = {t.get_text(): t.get_color() for t in fig.axes[0].texts}
    encoder_ink = shown["encoder\n$E$ blocks\nrun once"]
    assert (encoder_ink == "black") == (highlight in (None, "encoder"))  # the rest is greyed out


def test_the_figure_unrolls_k_columns():
    texts = [t.get_text() for t in asymloop_figure(n_iter=5).axes[0].texts]
    assert sum(t.startswith("iteration $k=") for t in texts) == 5 and "$z_{4}$" in texts


def test_each_decoder_layer_projects_its_own_input_and_reads_its_own_global_kv():
    """Only layer 1 of an iteration reads z_{k-1}; every layer l has its own (K^G_l, V^G_l) (Section 3.2)."""
    texts = [t.get_text() for t in asymloop_figure(n_iter=3).axes[0].texts]
    assert not any("from $z_" in t for t in texts)
    assert texts.count("decoder layer $1$") == texts.count("decoder layer $D$") == 3
    assert texts.count("$K^G_1, V^G_1$") == texts.count("$K^G_D, V^G_D$") == 3
    assert "one softmax, $[K^G_D ; K^L]$" in texts
    xlabel = mask_figure(n=3).axes[0].get_xlabel()
    assert "z_{k-1}" not in xlabel and "K^G_l" not in xlabel and "position $j$" in xlabel  # ticks: k_j, j = position


def test_a_bad_highlight_names_the_choices():
    with pytest.raises(ValueError, match="unknown highlight 'decoder'; choose one of None, 'encoder', 'global_kv'") as e:
        asymloop_figure(highlight="decoder")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="choose an integer K in 1..5"):
        asymloop_figure(n_iter=9)


def test_the_mask_figure_shows_j_le_i_in_both_halves():
    fig = mask_figure(n=4)
    cells = [t.get_text() for t in fig.axes[0].texts]  # row by row, 2n per row: "1" where key j <= query i
    rows = [cells[i * 8:(i + 1) * 8] for i in range(4)]
    assert rows[0] == ["1", "0", "0", "0", "1", "0", "0", "0"] and rows[3] == ["1"] * 8
    with pytest.raises(ValueError, match="choose an integer in 1..12"):
        mask_figure(n=0)


def test_a_returned_figure_shows_itself_without_pyplot():
    """A notebook cell that returns the figure shows it as a PNG even when the kernel never imported pyplot."""
    for fig in (asymloop_figure(), mask_figure()):
        png = fig._repr_png_()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_the_truncation_figure_cuts_the_first_k_minus_n_iterations_and_routes_the_gradient_through_global_kv():
    """Notebook 05: K - n iterations without a graph in each row; only the AsymLoop row has Global KV, and only it
    says the encoder gets a gradient."""
    texts = [t.get_text() for t in truncation_figure(K=5, n=2).axes[0].texts]
    assert texts.count("no graph") == 2 * 3 and texts.count("iteration 5") == 2 and "iteration 6" not in texts
    assert texts.count("fixed Global KV, made from $H$ once") == 1
    assert "the encoder's gradient\ncomes through Global KV" in texts and "no gradient reaches\nthe encoder" in texts
    assert texts.count("cut") == 2
    full = [t.get_text() for t in truncation_figure(K=3, n=3).axes[0].texts]
    assert full.count("no graph") == full.count("cut") == 0  # n = K: every iteration keeps its graph
    with pytest.raises(ValueError, match="K=2, n=3 cannot be drawn; choose integers 1 <= n <= K <= 6"):
        truncation_figure(K=2, n=3)
