"""Notebook 04's figures and tables (minimal_asymloop.course.adaptive) read notebooks/results/adaptive.json as it is."""

import json

import pytest

from minimal_asymloop.course import adaptive as C
from minimal_asymloop.paths import RESULTS

RES = json.loads((RESULTS / "adaptive.json").read_text())


def _labelled(fig):
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def test_figures_build_with_titles_and_labels():
    for fig in (C.plot_chain(RES["chain"]["runs"]), C.plot_lm(RES["lm"])):
        assert all(x for x, _ in _labelled(fig)) and _labelled(fig)[0][1]
        assert fig._suptitle is not None or all(ax.get_title() for ax in fig.axes)


def test_exit_gap_is_three_hop_minus_one_hop():
    run = RES["chain"]["runs"][0]
    row = next(r for r in run["adaptive"] if r["tau"] == 0.03)
    assert C.exit_gap(run, 0.03) == row["iter_by_hops"]["3"] - row["iter_by_hops"]["1"] > 0.5
    assert abs(C.exit_gap(run, 0.0)) < 1e-9  # tau = 0: every answer runs K_max
    with pytest.raises(ValueError, match="no adaptive row at tau=0.5"):
        C.at_tau(run["adaptive"], 0.5)


def test_cheaper_and_as_good_needs_both():
    ref = dict(acc=0.9, flops_vs_max=0.5)
    rows = [dict(tau=0.1, acc=0.9, flops_vs_max=0.4),   # as good, cheaper: yes
            dict(tau=0.2, acc=0.8, flops_vs_max=0.3),   # worse
            dict(tau=0.3, acc=0.95, flops_vs_max=0.6),  # dearer
            dict(tau=0.0, acc=0.99, flops_vs_max=0.1)]  # tau = 0 is fixed depth, never counted
    assert C.cheaper_and_as_good(rows, ref, "acc", True) == [0.1]
    ce_ref = dict(ce=2.0, flops_vs_max=0.5)
    assert C.cheaper_and_as_good([dict(tau=0.1, ce=1.9, flops_vs_max=0.4), dict(tau=0.2, ce=2.1, flops_vs_max=0.4)],
                                 ce_ref, "ce", False) == [0.1]


def test_beaten_by_fixed_on_the_committed_lm():
    lm = RES["lm"]
    beaten = C.beaten_by_fixed(lm, "flops_vs_max")
    for tau, k in beaten.items():
        r = next(r for r in lm["adaptive"] if r["tau"] == tau)
        f = next(f for f in lm["fixed"] if f["k"] == k)
        assert f["ce"] <= r["ce"] and f["flops_vs_max"] <= r["flops_vs_max"]
    assert None in C.beaten_by_fixed(lm, "mean_iter").values()  # some thresholds lie on the fixed-K curve in iterations


def test_tables_print_the_json_numbers():
    lm, run = RES["lm"], RES["chain"]["runs"][0]
    text = C.lm_table(lm)
    assert f"{lm['fixed'][2]['ce']:.4f}" in text and len(text.splitlines()) == 1 + len(lm["fixed"]) + len(lm["adaptive"])
    line = next(s for s in C.chain_table(RES["chain"]["runs"]).splitlines() if s.split()[:2] == [str(run["seed"]), "tau=0.03"])
    assert f"{C.at_tau(run['adaptive'], 0.03)['iter_by_hops']['3']:.2f}" in line


def test_exit_grid_marks_ran_and_stopped_cells():
    exit_iter, hops = [2, 6, 3], [0, 1, 3]
    fig = C.plot_exit_grid(exit_iter, hops, 6, 0.1)
    ax = fig.axes[0]
    img = ax.get_images()[0].get_array()
    assert img[:2, 0].tolist() == [1, 1] and img[2:, 0].tolist() == [0, 0, 0, 0]  # token 0 ran 2 iterations
    assert img[:, 1].tolist() == [1] * 6  # token 1 never stopped
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("2") == 4 and texts.count("3") == 3 and "6" not in texts  # stopped cells show the exit iteration
    assert [t.get_text() for t in ax.get_xticklabels()] == ["", "1h", "3h"]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
