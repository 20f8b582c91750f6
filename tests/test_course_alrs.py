"""Notebook 06's figures and tables (minimal_asymloop.course.alrs): the Marchenko–Pastur bulk, and the ALRS study's
numbers as notebooks/results/alrs.json holds them."""

import json

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb

from minimal_asymloop import alrs
from minimal_asymloop import experiments as ex
from minimal_asymloop.course import alrs as C
from minimal_asymloop.course import alrs_build as AB
from minimal_asymloop.optim import make_alrs
from minimal_asymloop.paths import RESULTS

RES = json.loads((RESULTS / "alrs.json").read_text())


def test_marchenko_pastur_bulk_holds_a_random_matrix_and_not_a_spike():
    torch.manual_seed(0)
    w = torch.randn(512, 256) * 0.05
    e = alrs.eigenvalues(w)
    lo, hi = C.mp_edges(e, tuple(w.shape))
    assert lo > 0 and 0.95 * lo < e.min() and e.max() < 1.05 * hi  # the random spectrum fills the bulk
    x = np.linspace(lo, hi, 20001)
    assert abs(np.trapezoid(C.mp_density(x, lo, hi, tuple(w.shape)), x) - 1) < 0.01  # a density
    spiked = w + 0.5 * torch.randn(512, 1) @ torch.randn(1, 256) / 16
    e2 = alrs.eigenvalues(spiked)
    assert (e2 > C.mp_edges(e2, tuple(w.shape))[1]).sum() >= 1  # a strong direction leaves the bulk


def test_best_lr_and_within_seed_match_the_study():
    for arm in ("uniform", "alrs"):
        assert C.best_lr(RES, arm) == ex.best_lr(RES["runs"], arm, RES["setting"]["seeds"], RES["setting"]["lr_grids"][arm])
    best_u, best_a = C.best_lr(RES, "uniform"), C.best_lr(RES, "alrs")
    u, a = C.runs_of(RES, "uniform", best_u), C.runs_of(RES, "alrs", best_a)
    want = [a[s]["val_loss"] - u[s]["val_loss"] for s in RES["setting"]["seeds"]]
    assert np.allclose(C.within_seed(RES, "alrs", best_a), want)
    assert not np.allclose(C.within_seed(RES, "uniform", best_u), want)  # the baseline minus itself is zero


def test_replay_gaps_compare_the_logged_steps_up_to_the_live_end():
    history = [dict(step=s, loss=6.0 - s / 100) for s in range(1, 11)] + [dict(step=10, val_loss=5.0)]
    stored = dict(train_loss=[(5, 5.95), (10, 5.80), (15, 5.0)])
    gaps = C.replay_gaps(history, stored)
    assert list(gaps) == [5, 10] and gaps[5] < 1e-9 and abs(gaps[10] - 0.1) < 1e-9


ARMS5 = {"ALRS": ("alrs", C.best_lr(RES, "alrs")), "pinned only": ("uniform_top", RES["best_lr_first_seed"]["uniform"])}


def test_figures_build_with_titles_and_labels():
    sp, name = RES["spectra"], ex.SPECTRA[0]
    s = RES["setting"]["model"]
    figs = [C.plot_esd(sp, name, (s["d_ff"], s["d_model"]), {"init": "init", "alrs": "ALRS"}), C.plot_sweep(RES),
            C.plot_controls(RES), C.plot_stable_rank(RES, ARMS5),
            C.plot_allocation(C.runs_of(RES, "alrs", C.best_lr(RES, "alrs"))[0], 5, 250)]
    for fig in figs:
        assert all(ax.get_xlabel() for ax in fig.axes) and fig.axes[0].get_ylabel()
        assert fig._suptitle is not None or all(ax.get_title() for ax in fig.axes)


def test_allocation_trajectory_ends_at_the_last_allocation():
    run = C.runs_of(RES, "alrs", C.best_lr(RES, "alrs"))[0]
    last = run["alrs_records"][-1]["multiplier"]
    thin = [ln for ln in C.plot_allocation(run, 5, 250).axes[0].lines if ln.get_linewidth() < 1]
    assert len(thin) == len(last) and all(ln.get_xdata()[-1] == 250 for ln in thin)
    assert sorted(round(ln.get_ydata()[-1], 9) for ln in thin) == sorted(round(m, 9) for m in last.values())
    assert all(ln.get_ydata()[0] == 1.0 for ln in thin)  # every multiplier starts at 1 and ramps to its first target
    assert C.plot_allocation(run, 5, 250).axes[0].get_xlim() == (0, run["alrs_records"][-1]["step"] + 15)  # zoomed on the phase


def test_sweep_table_prints_every_run():
    text = C.sweep_table(RES)
    assert len(text.splitlines()) == 1 + len({(r["arm"], r["lr"]) for r in RES["runs"]})
    r = RES["runs"][0]
    assert any(line.split()[:2] == [r["arm"], f"{r['lr']:.3g}"] and f"{r['val_loss']:.4f}" in line for line in text.splitlines())


def test_pipeline_figure_and_each_arms_setup(tmp_path):
    fig = C.pipeline_figure()
    assert "ALRS" in fig.axes[0].get_title() and any("TOP_NAMES" in t.get_text() for t in fig.axes[0].texts)

    def setup(arm, **kw):  # notebook 06's live runs and the study build each arm with experiments.arm_setup
        return ex.arm_setup(arm, 2.5e-3, 0, 250, tmp_path, 2.4 if arm == "decoder_boost" else None, **kw)

    assert setup("uniform")[2] is None and not setup("uniform")[1].alrs
    cfg_t, hook = setup("decoder_boost")[1:]
    assert hook is None and cfg_t.dec_lr_mult == 2.4 and not cfg_t.alrs
    assert setup("alrs_hill")[1].alrs_fit == "hill_median" and setup("alrs")[1].alrs and setup("alrs")[2] is None
    assert isinstance(setup("uniform_top")[2], ex.PinnedTop) and not setup("uniform_top")[1].alrs
    tops = {arm: make_alrs(setup(arm)[1], "asymloop") for arm in ("alrs", "alrs_unpinned", "alrs_blocks")}  # the trainer's
    assert [(h.top, h.skip) for h in tops.values()] == [(alrs.TOP_NAMES, ()), ((), ()), ((), alrs.TOP_NAMES)]
    assert setup("uniform", stop_step=50, device="cpu")[1].stop_step == 50
    with pytest.raises(ValueError, match="unknown arm 'adam'"):
        setup("adam")


def test_takeaway_titles_follow_the_data():
    import copy

    assert "every seed" in C.controls_title(RES) and "every base LR" in C.plot_sweep(RES).axes[0].get_title()
    worse = copy.deepcopy(RES)  # every pinned arm made worse than uniform LR: no title may still call it ahead
    for r in worse["runs"]:
        if r["arm"] in C.PINNED:
            r["val_loss"] += 5.0
            r.update({k: v + 1.0 for k, v in r.items() if k.startswith("srank ")})
    assert C.controls_title(worse) != C.controls_title(RES) and "ALRS" not in C.controls_title(worse).split(":")[1]
    assert "at 0 of the" in C.plot_sweep(worse).axes[0].get_title()
    assert "in 0 of 4 groups" in C.plot_stable_rank(worse, ARMS5).axes[0].get_title()


def test_tail_fit_is_the_package_fit_and_counts_its_points():
    torch.manual_seed(0)
    e = alrs.eigenvalues(torch.randn(384, 128), torch.float64)
    a, n = C.tail_fit(e)
    assert a == alrs.ww_fit_alpha(e) and 1 < n < len(e)


def test_controls_bars_are_coloured_by_their_seeds():
    bars = [p.get_facecolor()[:3] for p in C.plot_controls(RES).axes[0].patches]
    arms = list(C.control_arms(RES).values())
    want = [C.VERDICTS[C.seed_verdict(C.within_seed(RES, arm, lr))][0] for arm, lr in arms]
    assert bars == [to_rgb(c) for c in want]
    assert C.seed_verdict(np.array([-0.1, 0.2])) == "mixed" and C.seed_verdict(np.array([0.1, 0.2])) == "worse"
    unpinned = [lab for lab, (arm, _) in C.control_arms(RES).items()].index(C.ARM_LABELS["alrs_unpinned"])
    assert bars[unpinned] == to_rgb("0.6")  # its seeds straddle 0: grey, not a win


def test_build_references_match_the_package_and_wrong_versions_fail():
    torch.manual_seed(0)
    e = alrs.eigenvalues(torch.randn(128, 64) * 0.05, torch.float64)
    edges = C.mp_edges(e, (128, 64))
    assert np.allclose(AB.ref_mp_edges(e.sum() / (128 * 64), 128, 64), edges, rtol=0, atol=1e-12)
    h = e[e > alrs.EVALS_THRESH]
    assert abs(AB.ref_hill(h, len(h) // 2) - alrs.hill_median_alpha(h)) < 1e-9
    alphas = {"a": 2.0, "b": 3.0, "c": 6.0, "embed.weight": 1.0}
    want = alrs.multipliers_from_alphas(alphas, top=alrs.TOP_NAMES)
    assert all(abs(AB.ref_multipliers(alphas)[k] - v) < 1e-12 for k, v in want.items())
    assert all(AB.ref_ramp(3.0, 5.0, s, 10, 5) == alrs.ramp(3.0, 5.0, s, 10, 5) for s in range(30))

    def check(f):
        assert f(1) == 2, "not 2"

    AB.wrong_fails(check, lambda x: x, "identity")  # a failing wrong version passes quietly
    with pytest.raises(AssertionError, match="let a wrong version pass"):
        AB.wrong_fails(check, lambda x: x + 1, "right")


def test_tail_plot_draws_the_fit_from_xmin_with_slope_one_minus_alpha():
    torch.manual_seed(0)
    W = torch.randn(384, 128) / 384 ** 0.5
    W += sum(torch.randn(384, 1) @ torch.randn(1, 128) * s / 30 for s in (3, 2, 1))
    e = alrs.eigenvalues(W, torch.float64)
    alpha, n_tail, xmin = C.tail_fit(e, with_xmin=True)
    assert C.tail_fit(e) == (alpha, n_tail)
    ax = C.plot_tail({"signal": e}).axes[0]
    x, y = ax.lines[1].get_data()  # the fitted power law
    assert abs(x[0] - xmin) < 1e-12 and abs(y[0] - n_tail / len(e)) < 1e-12
    assert abs(np.log(y[-1] / y[0]) / np.log(x[-1] / x[0]) - (1 - alpha)) < 1e-9
    assert ax.lines[2].get_xdata()[0] == xmin  # the xmin marker


def test_alpha_noise_figure_and_control_summary():
    rng = np.random.default_rng(0)
    scatter = {"64×64": (rng.normal(4, 2, 50), np.full(50, 0.8))}
    fig = C.plot_alpha_noise(scatter, {"init": (5.9, 13, 1.35), "ALRS": (6.2, 7, 2.0)}, "m")
    sd = scatter["64×64"][0].std(ddof=1)
    assert fig._suptitle is not None and f"(sd {sd:.1f})" in fig.axes[0].get_xticklabels()[0].get_text()
    bars = [c for c in fig.axes[1].containers]  # right panel: one errorbar per fit, ± the formula s.e. by default
    assert [b.lines[2][0].get_segments()[0][1][1] - 5.9 for b in bars[:1]] == pytest.approx([1.35])
    fig = C.plot_alpha_noise(scatter, {"init": (5.9, 13, 1.35), "ALRS": (6.2, 7, 2.0)}, "m", spread=2.1)
    assert fig.axes[1].containers[1].lines[2][0].get_segments()[0][1][1] - 6.2 == pytest.approx(2.1)  # ± the measured sd
    assert "sd of random matrices" in fig.axes[1].get_ylabel()
    lines = C.control_summary(RES).splitlines()
    arms = C.control_arms(RES)
    assert len(lines) == len(arms) and ("decoder_boost_mult" in RES) == any("Table 4b" in label for label in arms)
    d = C.within_seed(RES, *arms[C.ARM_LABELS["alrs"]])
    assert f"{d.mean():+.3f}" in lines[0] and f"lower in {(d < 0).sum()}/{len(d)}" in lines[0]


def test_spike_is_the_highest_training_loss_after_the_first_steps():
    history = [dict(step=s, loss=v) for s, v in ((1, 9.0), (5, 8.0), (6, 5.0), (14, 6.9), (30, 8.6), (40, 4.0))] + [dict(step=50)]
    assert C.spike(history) == (30, 8.6)
    assert C.spike(history, after=30) == (40, 4.0)


def test_no_pin_puts_the_pinned_names_on_the_line_and_top_share():
    alphas = {"a": 2.0, "b": 4.0, "embed.weight": 3.0, "head.weight": 5.0}
    assert AB.no_pin(alphas) == {"a": 1.0, "b": 5.0, "embed.weight": 3.0, "head.weight": 7.0}
    assert AB.no_pin(alphas) != AB.ref_multipliers(alphas)  # the reference pins both at 5
    share = C.top_share(RES["setting"]["model"])
    assert 0.2 < share < 0.35  # notebook 06 prints 27%


def test_one_adam_step_moves_each_matrix_by_its_multiplier_and_the_wrong_optimizers_fail():
    from minimal_asymloop.model import LoopedLM, ModelConfig

    torch.manual_seed(0)
    net = LoopedLM(ModelConfig(arch="asymloop", n_layer=4, n_enc=2, d_model=64, n_head=4, d_ff=128, vocab_size=128, max_seq_len=32))
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    mults = {name: 1.0 + (i % 5) for i, name in enumerate(alrs.tuned_matrices(net))}  # 1x .. 5x
    AB.check_step_sizes(AB.ref_set_lrs, net, tokens, mults)
    with pytest.raises(AssertionError, match="x the base LR, its multiplier is"):  # the multiplier forgotten
        AB.check_step_sizes(lambda opt, m, lr: [g.update(lr=lr) for g in opt.param_groups], net, tokens, mults)
    with pytest.raises(AssertionError, match="x the base LR"):  # one group for every matrix: nothing to set per matrix
        AB.check_step_sizes(AB.ref_set_lrs, net, tokens, mults, per_matrix=False)
    before = [p.detach().clone() for p in net.parameters()]
    AB.first_step_sizes(net, tokens, AB.ref_set_lrs, mults)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # the model itself is untouched


def test_replay_checks_a_live_run_against_the_study_only_where_it_can(monkeypatch, capsys):
    S = RES["setting"]
    lr = C.best_lr(RES, "uniform")
    run = C.runs_of(RES, "uniform", lr)[S["seeds"][0]]
    live = {"uniform": [dict(step=s, loss=v) for s, v in run["train_loss"] if s <= 50]}  # the study's own losses
    monkeypatch.setattr("minimal_asymloop.sources.source_identity", lambda *a: S["data_identity"])
    early, fig = C.replay(live, RES, ("uniform",), lr, "cpu")
    assert early == {"uniform": 0.0} and fig.axes[0].get_title()
    live["uniform"][1]["loss"] += 0.5  # a live run that differs at step 10
    assert C.replay(live, RES, ("uniform",), lr, "cpu")[0]["uniform"] > 0.4
    assert C.replay(live, RES, ("uniform",), lr, "cuda")[0] == {"uniform": None}  # another device: not checked
    assert "NOT checked" in capsys.readouterr().out
    assert C.replay(live, RES, ("uniform",), 123.0, "cpu")[0] == {"uniform": None}  # no such run in the study
    assert "nothing to check against" in capsys.readouterr().out


def test_alpha_agreement_is_one_for_identical_seeds_and_reads_the_study():
    rho, drift = C.alpha_agreement(RES, C.best_lr(RES, "alrs"))
    assert len(rho) == 3 and all(-1 <= r <= 1 for r in rho) and drift > 0
    same = json.loads(json.dumps(RES))  # every seed's records replaced by seed 0's: the ranks agree exactly
    runs = C.runs_of(same, "alrs", C.best_lr(same, "alrs"))
    for s in runs:
        runs[s]["alrs_records"] = runs[0]["alrs_records"]
    assert C.alpha_agreement(same, C.best_lr(same, "alrs"))[0] == pytest.approx([1.0, 1.0, 1.0])
    assert max(rho) < 0.9  # the study's seeds do not rank the blocks alike (0.12-0.50 when written)


def test_beside_paper_prints_the_papers_deltas_and_ours():
    """Section 6's table: Table 4's 60M deltas as ln(PPL ratio), Table 8's Dense CE delta, and our two arms' means."""
    from minimal_asymloop.course import alrs_build as AB
    diff, at1x = C.within_seed(RES, "alrs", C.best_lr(RES, "alrs")), C.within_seed(RES, "alrs_blocks", C.best_lr(RES, "alrs_blocks"))
    text = AB.beside_paper(RES, diff, at1x)
    assert "PPL 24.727 -> 23.751: -0.0403 nats" in text and "PPL 24.619 -> 23.580: -0.0431 nats" in text
    assert "CE -0.0626 nats" in text and f"val loss {diff.mean():+.4f}" in text and f"val loss {at1x.mean():+.4f}" in text
