"""Notebook 04's exit signal: KL(p_{k-1} || p_k) by group on a trained chain model, against an untrained one."""

import json

import numpy as np
import pytest
import torch

from minimal_asymloop import adaptive as A
from minimal_asymloop.course import exit_signal as X
from minimal_asymloop.course.build import passes
from minimal_asymloop.model import LoopedLM
from minimal_asymloop.paths import RESULTS


@pytest.fixture(scope="module")
def chain():
    model = A.chain_model(RESULTS / "chain_weights" / "asymloop_k3-s1.safetensors")
    return model, A.chain_batch(64)


def test_kl_is_the_lens_kl_of_successive_iterations(chain):
    model, (idx, targets, hops) = chain
    kl = X.kl_by_group(model, idx, targets, hops, 4)
    assert set(kl) == {"1-hop answers", "2-hop answers", "3-hop answers", "no target"}
    assert sum(len(v) for v in kl.values()) == idx.numel() and all(v.shape[1] == 3 for v in kl.values())
    with torch.no_grad():  # one position by hand: the first no-target position, KL(p_1 || p_2)
        b, t = (targets < 0).nonzero()[0].tolist()
        p = [torch.log_softmax(model(idx, n_iter=k)[0][b, t].float(), -1) for k in (1, 2)]
    assert kl["no target"][0, 0] == pytest.approx((p[0].exp() * (p[0] - p[1])).sum().item(), abs=1e-5)


def test_trained_model_separates_the_groups_and_an_untrained_one_does_not(chain):
    model, (idx, targets, hops) = chain
    torch.manual_seed(0)
    for m, trained in ((model, True), (LoopedLM(model.config).eval(), False)):
        kl = X.kl_by_group(m, idx, targets, hops, 6)
        med, settled = X.median_at(kl, 2), X.settled_share(kl, 0.03)
        assert (med["3-hop answers"] > 100 * med["1-hop answers"]) == trained
        assert (settled["no target"][1] < settled["3-hop answers"][1] - 0.3) == trained
    assert "3-hop answers" in X.summary(kl, 0.03)


def test_figure_draws_one_line_per_group_and_the_threshold(chain):
    model, (idx, targets, hops) = chain
    kl = X.kl_by_group(model, idx, targets, hops, 5)
    ax = X.plot_kl_by_group(kl, 0.03).axes[0]
    assert len(ax.lines) == len(kl) + 1 and ax.get_yscale() == "log"
    x, y = ax.lines[2].get_data()  # 3-hop answers: the median at each k
    assert list(x) == [2, 3, 4, 5] and np.allclose(y, np.median(np.maximum(kl["3-hop answers"], 1e-9), 0))


def test_beaten_check_passes_the_reference_and_fails_the_exact_comparison():
    """Notebook 04's verdict step: the check accepts the package's verdicts and rejects "as accurate" compared exactly
    (seed 0's τ = 1 and seed 3's small τ are beaten only within one standard error)."""
    runs = json.loads((RESULTS / "adaptive.json").read_text())["chain"]["runs"]
    check = X.beaten_check(runs, 2048)
    assert passes(check, X.beaten) and not passes(check, X.exact)
    assert not passes(check, lambda run, n: {t: None for t in X.beaten(run, n)})  # "nothing beaten" fails too
    assert X.beaten(runs[0], 2048)[0.3] is None and X.exact(runs[0], 2048)[1.0] is None
