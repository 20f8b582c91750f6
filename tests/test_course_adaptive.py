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


def test_chain_figure_labels_the_minimum_inside_the_axes():
    ax = C.plot_chain(RES["chain"]["runs"]).axes[0]
    label = next(t for t in ax.texts if "minimum" in t.get_text())
    lo, hi = ax.get_xlim()
    assert lo < label.get_position()[0] < hi


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
    assert C.cheaper_and_as_good(rows, ref, "acc") == [0.1]
    assert C.cheaper_and_as_good(rows, ref, "acc", n=10) == [0.1, 0.2]  # 0.8 is within one SE (0.13) of 0.9 on 10
    assert C.cheaper_and_as_good(rows, ref, "acc", n=10_000) == [0.1]
    ce_ref = dict(ce=2.0, flops_vs_max=0.5)
    assert C.cheaper_and_as_good([dict(tau=0.1, ce=1.9, flops_vs_max=0.4), dict(tau=0.2, ce=2.1, flops_vs_max=0.4)],
                                 ce_ref, "ce") == [0.1]


def test_beaten_by_fixed_on_the_committed_lm():
    lm = RES["lm"]
    beaten = C.beaten_by_fixed(lm, "flops_vs_max")
    for tau, k in beaten.items():
        r = next(r for r in lm["adaptive"] if r["tau"] == tau)
        f = next(f for f in lm["fixed"] if f["k"] == k)
        assert f["ce"] <= r["ce"] and f["flops_vs_max"] <= r["flops_vs_max"]
    assert None in C.beaten_by_fixed(lm, "mean_iter").values()  # some thresholds lie on the fixed-K curve in iterations


def test_beaten_by_fixed_on_the_chain_counts_noise():
    seed3 = RES["chain"]["runs"][2]  # K=2: 4 wrong of 2,048 at 0.437 of K=6's FLOPs; thresholds: 3-4 wrong
    assert set(C.beaten_by_fixed(seed3, "flops_vs_max", "acc", n=2048).values()) == {2}
    assert C.beaten_by_fixed(seed3, "flops_vs_max", "acc")[0.01] == 3  # exact: K=2 (4 wrong) loses to 3 wrong
    seed0 = RES["chain"]["runs"][0]
    assert C.beaten_by_fixed(seed0, "flops_vs_max", "acc", n=2048)[0.3] is None  # between K=2 and K=3


def test_mix_acc_interpolates_between_fixed_depths_and_beats_the_one_unbeaten_threshold():
    fixed = [dict(k=1, flops_vs_max=0.2, acc=0.5), dict(k=2, flops_vs_max=0.4, acc=0.9), dict(k=3, flops_vs_max=0.6, acc=0.8)]
    assert C.mix_acc(fixed, 0.3) == pytest.approx(0.7)  # halfway between K=1 and K=2
    assert C.mix_acc(fixed, 0.5) == pytest.approx(0.9)  # past K=2, K=2 alone beats any mix with the worse K=3
    assert C.mix_acc(fixed, 0.1) == 0.0  # cheaper than every fixed K: nothing to mix
    seed0 = RES["chain"]["runs"][0]  # tau=0.3: 8 wrong; the K=2/K=3 mix at its FLOPs about 3
    assert (1 - C.mix_acc(seed0["fixed"], C.at_tau(seed0["adaptive"], 0.3)["flops_vs_max"])) * 2048 == pytest.approx(3.08, abs=0.01)
    assert C.beaten_by_mix(seed0, n=2048)[0.3]
    sweep = dict(fixed=fixed, adaptive=[dict(tau=0.1, flops_vs_max=0.3, acc=0.8), dict(tau=0.2, flops_vs_max=0.3, acc=0.6)])
    assert C.beaten_by_mix(sweep, n=None) == {0.1: False, 0.2: True}  # above the mix's 0.7 at 0.3, and below it


def test_train_more_scores_before_and_after_and_records_the_drawn_k():
    from minimal_asymloop import adaptive
    from minimal_asymloop.course import sampled_depth as SD
    from minimal_asymloop.depth import DepthSampler

    model = adaptive.chain_model(RESULTS / "chain_weights" / "asymloop_k3-s1.safetensors")
    batch = adaptive.chain_batch()
    seed1 = RES["chain"]["runs"][1]
    assert seed1["seed"] == 1
    out = SD.train_more(model, {"fixed": DepthSampler("fixed", 3), "uniform": DepthSampler("uniform", 3, 1, 5, seed=0)},
                        2, batch)
    # before: the committed sweep's 3-hop accuracy at K = 1..6 (the same 256 programs)
    assert [round(a, 3) for a in out["before"]["acc"][:6]] == [round(r["acc_by_hops"]["3"], 3) for r in seed1["fixed"]]
    assert out["fixed"]["drawn"] == {3: 2} and sum(out["uniform"]["drawn"].values()) == 2
    assert set(out["uniform"]["drawn"]) <= {1, 2, 3, 4, 5} and out["uniform"]["acc"] != out["before"]["acc"]
    assert (out["before"]["kind"], out["fixed"]["kind"], out["uniform"]["kind"]) == (None, "fixed", "uniform")
    fig = SD.fig_live(out, 2)
    assert fig.axes[0].get_title() and fig.axes[0].get_xlabel() and len(fig.axes[0].get_legend().get_texts()) == 3
    colours = [line.get_color() for line in fig.axes[0].get_lines()[:3]]  # each arm in its sampler's colour
    assert colours[1:] == [SD.KIND_COLORS["fixed"], SD.KIND_COLORS["uniform"]]


def test_finetune_part_starts_converged_and_the_lm_axis_is_clipped():
    """The fine-tune part of sampled_depth.json starts from the committed converged models (fixed K = 3 stays right at
    the trained K = 3 and at chance at K = 1, in every seed; an untrained start fails both); fig_finetune draws one curve
    per recipe. The LM panel of fig_test_k stops below a seed far behind the rest (synthetic runs here)."""
    from minimal_asymloop.course import sampled_depth as SD

    sd = json.loads((RESULTS / "sampled_depth.json").read_text())
    acc = SD.finetune_acc(sd)
    assert set(acc) == {"fixed_k3", "lognormal_k3", "uniform_k1_5"} and sorted(acc["fixed_k3"]) == [0, 1, 3]
    assert all(a[2] >= 0.99 and a[0] < 0.35 for a in acc["fixed_k3"].values())
    fig = SD.fig_finetune(sd)
    assert "300" in fig.axes[0].get_title() and len(fig.axes[0].get_legend().get_texts()) == 3
    runs = [dict(task="lm", recipe=recipe, seed=seed, sweep=dict(fixed=[dict(k=k, ce=5.0 + 0.01 * k + off) for k in range(1, 9)]))
            for recipe in ("fixed_k3", "uniform_k1_5") for seed, off in enumerate((0.0, 0.02, 0.8 if recipe != "fixed_k3" else 0.04))]
    fig = SD.fig_test_k({"runs": runs}, chain=False)
    assert len(fig.axes) == 1 and fig.axes[0].get_ylim()[1] < 5.8  # the seed 0.8 nats behind leaves the top
    assert "clipped" in fig.axes[0].get_title()
    fig = SD.fig_test_k(sd, chain=False)  # the stored LM runs: no seed far behind, so nothing clipped nor said to be
    assert max(y for line in fig.axes[0].get_lines() for y in line.get_ydata()) < fig.axes[0].get_ylim()[1]
    assert "clipped" not in fig.axes[0].get_title()


def test_vs_fixed_frontier_measures_the_gap_at_equal_flops():
    """A threshold's loss minus a fixed-K frontier interpolated at its counted FLOPs: fixed_k3's frontier for every
    recipe, or (own=True) the recipe's own model's. On the stored runs every gap of both kinds is positive, and
    fixed_k3's two are the same; a synthetic threshold below the frontier gives a negative gap of the right size, and
    a worse model measured against its own frontier gives the gap to its own, not fixed_k3's."""
    from minimal_asymloop.course import sampled_depth as SD

    sd = json.loads((RESULTS / "sampled_depth.json").read_text())
    base, own = SD.vs_fixed_frontier(sd), SD.vs_fixed_frontier(sd, own=True)
    assert all(b["gap"] > 0 for gaps in (base, own) for rows in gaps.values() for b in rows)
    assert own["fixed_k3"] == base["fixed_k3"] and own["lognormal_k3"] != base["lognormal_k3"]
    fixed = [dict(k=k, flops_per_token=100.0 * k, ce=c) for k, c in zip((1, 2, 3, 4), (5.0, 4.0, 3.0, 3.5))]
    ada = [dict(tau=0.1, flops_per_token=250.0, ce=3.45), dict(tau=0.01, flops_per_token=350.0, ce=2.9)]
    worse = [dict(f, ce=f["ce"] + 1.0) for f in fixed]  # a model 1 nat worse at every K; its rule 0.2 above its K=3
    toy = {"runs": [dict(task="lm", recipe="fixed_k3", seed=0, sweep=dict(fixed=fixed, adaptive=ada)),
                    dict(task="lm", recipe="uniform_k1_5", seed=0,
                         sweep=dict(fixed=worse, adaptive=[dict(tau=0.1, flops_per_token=300.0, ce=4.2)]))]}
    best = SD.vs_fixed_frontier(toy)["fixed_k3"][0]
    assert best["tau"] == 0.01 and abs(best["gap"] - (2.9 - 3.0)) < 1e-9  # past K=3 the frontier stays at K=3's 3.0
    assert abs(SD.vs_fixed_frontier(toy)["fixed_k3"][0]["cost_vs_k3"] - 350 / 300) < 1e-9
    assert abs(SD.vs_fixed_frontier(toy)["uniform_k1_5"][0]["gap"] - 1.2) < 1e-9  # against fixed_k3's 3.0
    assert abs(SD.vs_fixed_frontier(toy, own=True)["uniform_k1_5"][0]["gap"] - 0.2) < 1e-9  # against its own 4.0


def test_exit_mechanism_draws_each_token_stopping_at_its_own_iteration():
    """The schematic: a token stops at the first k >= 2 whose KL is below τ (else K_max); every iteration after its exit
    is a grey frozen box, and the right panel draws one KL curve per token."""
    from matplotlib.colors import to_hex

    fig = C.plot_exit_mechanism(kl=([0.03], [2.1, 0.8, 0.3], [0.9, 0.05]), tau=0.1, max_iter=4)
    grid, curve = fig.axes
    ticks = [t.get_text() for t in grid.get_xticklabels()]
    assert ticks == ["token 1\nexit after 2", "token 2\nexit after 4\n(K_max)", "token 3\nexit after 3"]
    grey = [p for p in grid.patches if to_hex(p.get_facecolor()) == "#eeeeee"]
    assert len(grey) == (4 - 2) + 0 + (4 - 3)  # frozen boxes after each exit
    assert sum(t.get_text().endswith("(frozen)") for t in grid.texts) == 3 and len(curve.lines) == 3 + 1  # + the τ line
    assert fig._suptitle is not None and curve.get_ylabel() and grid.get_ylabel()


def test_frontier_figure_draws_one_seeds_own_points_and_labels_that_do_not_overlap():
    """fig_frontier draws one seed's runs, no average: the dashed line is the running minimum of that seed's fixed_k3
    losses (never rising), each recipe's exit-rule curve is that seed's stored points with tau = 0 left out (it is fixed
    K = 8), and no two labels overlap (one of them groups thresholds). check_cost reads 2·d·V = 131,072 FLOPs per check
    and 393,216 per iteration off the stored LM (d = 64, V = 1,024): a third."""
    import numpy as np

    from minimal_asymloop.course import sampled_depth as SD

    sd = json.loads((RESULTS / "sampled_depth.json").read_text())
    for seed in (0, 2):
        fig = SD.fig_frontier(sd, seed=seed)
        ax = fig.axes[0]
        runs = {r: next(x for x in rs if x["seed"] == seed) for r, rs in SD.runs_of(sd, "lm").items()}
        dashed = next(line for line in ax.get_lines() if line.get_linestyle() == "--")
        fixed_ce = [x["ce"] for x in runs["fixed_k3"]["sweep"]["fixed"]]
        assert np.allclose(dashed.get_ydata(), np.minimum.accumulate(fixed_ce))
        curves = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        assert len(curves) == len(runs) == 3
        for line, (recipe, run) in zip(curves, runs.items()):
            assert np.allclose(line.get_ydata(), [a["ce"] for a in run["sweep"]["adaptive"] if a["tau"] > 0])
            assert f"seed {seed}" in line.get_label() and line.get_color() == SD.COLORS[recipe]
        dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]  # each sampled model's own frontier
        assert [line.get_color() for line in dotted] == [SD.COLORS["lognormal_k3"], SD.COLORS["uniform_k1_5"]]
        for line, recipe in zip(dotted, ("lognormal_k3", "uniform_k1_5")):
            assert np.allclose(line.get_ydata(), np.minimum.accumulate([x["ce"] for x in runs[recipe]["sweep"]["fixed"]]))
        labels = [t for t in ax.texts if t.get_text().startswith("τ=")]
        assert not any("τ=0," in t.get_text() or t.get_text() == "τ=0" for t in labels)
        assert any("," in t.get_text() for t in labels) and not any(t.crowded for t in ax.texts)
        r = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(r) for t in ax.texts]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        assert f"Seed {seed}" in ax.get_title() and "median" not in ax.get_title()
    check, it = SD.check_cost(sd)
    assert (check, it) == (2 * 64 * 1024, 393216)


def test_reference_build_matches_the_package_and_the_wrong_versions_fail():
    """course.adaptive's references for notebook 04's build (Frozen, adaptive_loop) pass their checks; a Frozen that
    does not reuse the keys and a loop that never stops a token both fail them, and so does the no-reuse loop."""
    from minimal_asymloop import adaptive as A

    model = A.chain_model(RESULTS / "chain_weights" / "asymloop_k3-s1.safetensors")
    idx = A.chain_batch(16)[0]
    C.check_frozen(C.Frozen, model, idx)
    C.check_loop(C.adaptive_loop, model, idx)

    class NoReuse(C.Frozen):
        def append(self, k, v):
            self.kv = (k, v)
            return k, v

    with pytest.raises(AssertionError, match="exit iterations differ"):
        C.check_frozen(NoReuse, model, idx)
    with pytest.raises(AssertionError):
        C.check_loop(lambda m, x, tau, k: C.adaptive_loop(m, x, 0.0, k), model, idx)  # never stops a token
    with pytest.raises(AssertionError):
        C.check_loop(lambda m, x, tau, k: C.adaptive_loop(m, x, tau, k, reuse=False), model, idx)


def test_paired_exit_gap_is_per_program():
    """paired_exit_gap: per program, a-hop minus b-hop mean exit; mean and standard error over programs."""
    import torch

    targets = torch.tensor([[1, 1, -1], [1, 1, -1], [1, 1, 1]])
    hops = torch.tensor([[1, 2, 0], [1, 2, 0], [1, 1, 2]])
    ex = torch.tensor([[2, 3, 5], [2, 4, 5], [2, 4, 5]])
    mean, se, n = C.paired_exit_gap(ex, targets, hops, 2, 1)
    assert n == 3 and abs(mean - (1 + 2 + 2) / 3) < 1e-6 and abs(se - torch.tensor([1.0, 2, 2]).std().item() / 3 ** 0.5) < 1e-6


def test_exit_grid_writes_the_program_under_its_columns():
    """plot_exit_grid labels each column with the program's character, answers with their hop count too."""
    from minimal_asymloop import adaptive as A

    idx, targets, hops = A.chain_batch(1)
    chars = C.chain_chars(idx[0])
    assert "".join(chars).count(";") == 8 and chars[1] == "="
    fig = C.plot_exit_grid([2] * 32, hops[0].where(targets[0] >= 0, 0), 3, 0.1, tokens=chars)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == chars[0] and ticks[2].startswith(chars[2] + "\n") and ticks[2].endswith("h")


def _fake_gaps(runs):
    return {r["seed"]: {2: (0.1 * (j + 1), 0.02, 256), 3: (1.2 + 0.05 * j, 0.03, 212)} for j, r in enumerate(runs)}


def test_exit_gap_figure_draws_each_seeds_gaps_and_the_fixed_k_reference():
    runs = RES["chain"]["runs"]
    fig = C.plot_exit_gaps(runs, _fake_gaps(runs))
    left, right = fig.axes[:2]
    assert fig._suptitle.get_text() and left.get_ylabel() and right.get_ylabel()
    ys = sorted(round(float(line.get_ydata()[0]), 3) for line in left.lines if line.get_marker() in C.MARKERS)
    assert ys == sorted(round(g[a][0], 3) for g in _fake_gaps(runs).values() for a in (2, 3))  # one dot per seed and hop
    assert any(list(line.get_ydata()) == [0, 0] for line in left.lines)  # fixed K: gap 0
    seed0 = next(line for line in right.lines if line.get_label() == f"seed {runs[0]['seed']}")
    assert seed0.get_ydata()[0] == runs[0]["fixed"][1]["acc_by_hops"]["3"]  # fixed K = 2, not K = 1
    assert len(seed0.get_ydata()) == 2  # the rule is drawn apart, not on the line of fixed depths


def test_chain_frontier_rings_only_the_thresholds_no_fixed_k_matches():
    runs = RES["chain"]["runs"]
    n = 2048
    fig = C.plot_chain_frontier(runs, n)
    for ax, run in zip(fig.axes, runs):
        ring = next(line for line in ax.lines if line.get_label().startswith("no fixed K"))
        alone = [t for t, k in C.beaten_by_fixed(run, "flops_vs_max", "acc", n).items() if k is None]
        assert len(ring.get_xdata()) == len(alone)
    assert len(next(line for line in fig.axes[0].lines if line.get_label().startswith("no fixed")).get_xdata()) == 1
    taus = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("τ=")]
    assert taus == [f"τ={runs[0]['adaptive'][1]['tau']:g}", f"τ={runs[0]['adaptive'][-1]['tau']:g}"]  # smallest, largest > 0


def test_seeds_summary_and_report_print_the_committed_numbers():
    runs = RES["chain"]["runs"]
    gaps = _fake_gaps(runs)
    text = C.seeds_summary(runs, gaps, 287)
    assert "3-hop +1.20 +1.25 +1.30" in text and "s.e. at most 0.030" in text
    assert f"2-hop accuracy {runs[0]['fixed'][0]['acc_by_hops']['2']:.3f}" in text  # fixed K = 1's, not K = 2's
    report = C.seeds_report(runs, gaps, 2048, 287)
    assert report.count("cheapest fixed K as accurate") == len(runs) and "0.3: None" in report


def test_seed_gaps_recomputes_later_exits_for_three_hop_answers():
    from minimal_asymloop import adaptive as A

    runs = RES["chain"]["runs"][1:2]
    g = C.seed_gaps(runs, A.chain_batch(48))[runs[0]["seed"]]
    assert g[3][0] > 0.5 > g[2][0] - 1 and g[3][2] > 10


def test_lm_report_lists_every_recipe_and_the_sampled_runs_ahead_somewhere():
    from minimal_asymloop.course import sampled_depth as SD

    sd = json.loads((RESULTS / "sampled_depth.json").read_text())
    text = SD.lm_report(sd)
    assert text.count("closest threshold to fixed_k3's frontier") == text.count("closest threshold to its own") == 3
    assert text.count("CE at K=8 minus K=3") == 3
    assert text.count("below fixed_k3") == sum(min(r) < 0 for d in SD.within_seed(sd).values() for r in d["diff"])


def test_vs_fixed_frontier_in_decoder_iterations_lets_an_exit_check_cost_nothing():
    """cost="mean_iter" places each threshold by its mean decoder iterations, so the exit checks' FLOPs drop out: a
    threshold that pays checks above the FLOP frontier can sit below the iteration frontier. On the stored runs the
    fixed_k3 model's best threshold is below its own frontier in every seed in iterations, above it in FLOPs."""
    from minimal_asymloop.course import sampled_depth as SD

    fixed = [dict(k=k, mean_iter=float(k), flops_per_token=100.0 * k, ce=c) for k, c in zip((1, 2, 3), (5.0, 4.0, 3.0))]
    ada = [dict(tau=0.1, mean_iter=2.5, flops_per_token=280.0, ce=3.4)]  # 30 FLOPs of checks over 2.5 iterations
    toy = {"runs": [dict(task="lm", recipe="fixed_k3", seed=0, sweep=dict(fixed=fixed, adaptive=ada))]}
    assert abs(SD.vs_fixed_frontier(toy)["fixed_k3"][0]["gap"] - (3.4 - 3.2)) < 1e-9  # frontier at 280 FLOPs: 3.2
    assert abs(SD.vs_fixed_frontier(toy, cost="mean_iter")["fixed_k3"][0]["gap"] - (3.4 - 3.5)) < 1e-9  # at 2.5: 3.5
    sd = json.loads((RESULTS / "sampled_depth.json").read_text())
    flops, iters = (SD.vs_fixed_frontier(sd, own=True, cost=c)["fixed_k3"] for c in ("flops_per_token", "mean_iter"))
    assert all(b["gap"] > 0 for b in flops) and all(b["gap"] < 0 for b in iters)
