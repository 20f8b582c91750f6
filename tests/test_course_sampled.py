"""Notebook 05's build steps and live measurements (minimal_asymloop.course.sampled_build): each reference passes its
check, each wrong version fails it, and the memory and gradient measurements say what the notebook reads from them."""

import dataclasses

import pytest
import torch

from minimal_asymloop import adaptive as A
from minimal_asymloop.course import sampled_build as B
from minimal_asymloop.course.build import passes
from minimal_asymloop.depth import DepthSampler, check_model
from minimal_asymloop.paths import RESULTS


@pytest.fixture(scope="module")
def chain():
    model = A.chain_model(RESULTS / "chain_weights" / "asymloop_k3-s1.safetensors")
    idx, targets, _ = A.chain_batch(16)
    return model, idx, targets


def test_the_reference_sampler_draws_what_depth_sampler_draws_and_huginns_mean_does_not():
    B.check_draw(B.draw)
    assert not passes(B.check_draw, B.huginn_draw)
    with pytest.raises(AssertionError, match="not an int K"):
        B.check_draw(lambda mean, cap, g: None)  # the cell as shipped
    huginn = B.draws(B.huginn_draw, n=4000)
    assert abs(sum(huginn) / len(huginn) - DepthSampler("lognormal_poisson", mean=4, cap=8).expected()) < 0.1  # E[K] one more


def test_the_truncated_loop_gives_the_package_gradients_and_the_wrong_versions_fail(chain):
    model, idx, targets = chain
    B.check_states(B.states, model, idx, targets)
    with pytest.raises(AssertionError, match="get a gradient in one version only"):
        B.check_states(B.states_kv_cut, model, idx, targets)  # encoder and embedding lose their gradient
    with pytest.raises(AssertionError):
        B.check_states(lambda m, x, K, n: B.states(m, x, K, K), model, idx, targets)  # no truncation at all
    cut = B.grad_norms(B.grads(model, lambda: B.states_kv_cut(model, idx, 8, 1), idx, targets))
    ok = B.grad_norms(B.grads(model, lambda: B.states(model, idx, 8, 1), idx, targets))
    assert cut["encoder"] == cut["embedding"] == cut["decoder's Global KV projections"] == 0 < min(ok.values())
    assert cut["decoder, the rest"] > 0  # the iterations after the cut still train the decoder
    with pytest.raises(ValueError, match="without gradient"):
        check_model(dataclasses.replace(model.config, context="none"), DepthSampler("fixed", 8), 1)


def test_memory_follows_n_and_the_truncated_gradient_is_another_direction(chain):
    model, idx, targets = chain
    m = B.by_backprop_depth(model, idx, targets, K=4)
    assert all(b > a for a, b in zip(m["peak_bytes"], m["peak_bytes"][1:]))
    assert abs(m["cosine"][-1] - 1) < 1e-4 and m["cosine"][0] < 0.9
    fixed2, at4_n2 = B.step_bytes(model, idx, targets, 2), B.step_bytes(model, idx, targets, 4, 2)
    assert abs(at4_n2 / fixed2 - 1) < 0.05  # K = 4 with a graph through 2 needs about what K = 2 needs
    assert torch.is_grad_enabled() and all(p.grad is None for p in model.parameters())


def test_figures_build_with_titles_and_labels(chain):
    model, idx, targets = chain
    from matplotlib.colors import to_hex

    from minimal_asymloop.course.sampled_depth import KIND_COLORS

    fig = B.fig_sampler(B.draws(B.draw, n=200), who="the reference")
    assert fig.axes[0].get_title() and fig.axes[0].get_xlabel()
    assert any("the reference: 200 draws" in t.get_text() for t in fig.axes[0].get_legend().get_texts())  # whose draws
    bars = [c for c in fig.axes[0].containers]  # fixed, uniform, ours: each in its colour of notebook 05's figures
    assert [to_hex(b[0].get_facecolor(), keep_alpha=False) for b in bars[:3]] == [
        to_hex(KIND_COLORS[k]) for k in ("fixed", "uniform", "lognormal_poisson")]
    huginn = bars[3][0]  # Huginn's mu: ours' colour, hatched and unfilled, its E[K] in the legend
    assert not huginn.get_fill() and to_hex(huginn.get_edgecolor(), keep_alpha=False) == to_hex(KIND_COLORS["lognormal_poisson"])
    assert any("Huginn's mu, mean 3 (E[K] 3.88)" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    m = dict(n=[1, 2], peak_bytes=[1 << 20, 2 << 20], cosine=[0.3, 1.0])
    assert all(ax.get_title() and ax.get_ylabel() for ax in B.fig_backprop_depth(m, 2, 1 << 20).axes)
