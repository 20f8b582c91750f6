"""notebooks/02's figures and tables (minimal_asymloop.course.depth): the numbers it prints are the JSON's and the
paper's, and its figures build without pyplot."""

import json
import math

import matplotlib.pyplot as plt
import numpy as np
import pytest

from minimal_asymloop.course import depth
from minimal_asymloop.paths import RESULTS


@pytest.fixture(scope="module")
def runs():
    return depth.LMRuns()


def test_paper_constants_agree_with_each_other():
    # Table 6 gives G(K) as a CE difference: its rows 3.260346 - 3.238735 etc.; Table 7 and Table 4a share AsymLoop
    # (uniform LR, K=3) at 24.727
    ce = {1: (3.260346, 3.238735), 3: (3.241257, 3.207915), 5: (3.248483, 3.203515)}  # w/o Global KV, AsymLoop
    assert depth.TABLE6 == {k: pytest.approx(a - b, abs=2e-6) for k, (a, b) in ce.items()}  # rounded CE in the table
    assert depth.TABLE7["asymloop_k3"] == depth.TABLE4A[3]["asymloop"] == 24.727
    assert depth.TABLE7["asymloop_k3_no_global"] == 25.566  # Table 4a's "w/o Global KV" at K=3 is the same run


def test_loss_is_the_json_per_seed(runs):
    md = json.loads((RESULTS / "matched_depth.json").read_text())
    rows = {(r["name"], r["seed"]): r["val_loss"] for r in md["runs"]}
    assert list(runs.loss("asymloop_k3")) == [rows[("asymloop_k3", s)] for s in md["setting"]["seeds"]]


def test_gain_at_k1_is_the_dense_pair_with_its_sign_flipped(runs):
    g = depth.gains(runs)
    assert np.allclose(g[1], -(runs.loss("asymloop_k1") - runs.loss("dense")))
    assert set(g) == {1, 3, 5}


def test_variant_table_names_the_paper_table_of_each_value(runs, capsys):
    assert depth.paper_variant("no_local", 5) == (pytest.approx(math.log(25.465 / 24.619)), "Table 4a")
    assert depth.paper_variant("no_global", 5) == (depth.TABLE6[5], "Table 6")  # Table 6's G(5), as CE difference
    assert depth.paper_variant("additive", 5) is None  # Table 7 has no K=5 run
    assert depth.variant_name("additive", 1) == depth.variant_name("no_global", 1) == "dense"  # K = 1: Dense
    depth.variant_table(runs)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("additive injection"))
    want = (runs.loss("asymloop_k3_additive") - runs.loss("asymloop_k3")).mean()
    assert f"{want:+.3f} ({math.log(25.116 / 24.727):+.3f})" in line


def test_variant_figure_draws_each_seed_and_the_zero_line(runs):
    fig = depth.plot_variants(runs)
    assert len(fig.axes) == 3 and plt.get_fignums() == []
    dots = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "o"]
    assert len(dots) == len(runs.seeds)  # one dot per seed at each K
    g5 = runs.loss("asymloop_k5_no_global") - runs.loss("asymloop_k5")
    assert sorted(d.get_ydata()[-1] for d in dots) == pytest.approx(sorted(g5))
    assert ("every seed" in fig._suptitle.get_text()) and "unlike Table 7" in fig._suptitle.get_text()
    paper = {ax.get_title().splitlines()[0]: next(t.get_text() for t in ax.get_legend().get_texts() if t.get_text().startswith("paper"))
             for ax in fig.axes}  # Table 4's caption states 60M; Tables 6 and 7 give no size
    assert [("Table 4a" in t, "inferred" in t) for t in paper.values()].count((True, True)) == 0
    assert any("inferred" in t for t in paper.values()) and any("Table 4a; 60M," in t for t in paper.values())


def test_matched_table_gives_like_for_like_paper_values_only(runs, capsys):
    diffs = {(b, a): depth.within(runs, a, b) for b, a in depth.PAIRS}
    depth.matched_table(runs, diffs)
    out = capsys.readouterr().out
    assert f"{math.log(24.727 / 25.053):+.3f} (Table 7)" in out
    assert f"{3.238735 - 3.260346:+.3f} (Table 6, its K = 1 w/o Global KV as Dense: inferred)" in out
    assert "Table 3" not in out and out.count("no like-for-like run") == 1  # depth 12: Tables 3 and 8 only


def test_figures_build_without_pyplot(runs):
    figs = [depth.plot_matched(runs, depth.matched_depth(runs)), depth.plot_lens(runs, init=[6.9] * 8),
            depth.plot_variants(runs)]
    assert plt.get_fignums() == []
    for fig in figs:
        assert all(ax.get_ylabel() for ax in fig.axes[:1]) and (fig._suptitle or fig.axes[0].get_title())


def test_paper_matched_takes_each_difference_within_one_table():
    # Table 6 at K=1 (w/o Global KV = Dense): 3.238735 - 3.260346; Table 7 only at depth 2L; Table 3 ln ratio
    p = {pair: depth.paper_matched(*pair) for pair in depth.PAIRS}
    assert p[("dense", "asymloop_k1")]["Table 6"] == pytest.approx(3.238735 - 3.260346)
    assert p[("full_loop_k2", "asymloop_k3")]["Table 6"] is None and p[("full_loop_k3", "asymloop_k5")]["Table 6"] is None
    assert p[("full_loop_k2", "asymloop_k3")]["Table 7"] == pytest.approx(math.log(24.727 / 25.053))
    assert p[("dense", "asymloop_k1")]["Table 7"] is None and p[("full_loop_k3", "asymloop_k5")]["Table 7"] is None
    assert p[("dense", "asymloop_k1")]["Table 3"] == pytest.approx(math.log(21.79 / 23.72))
    assert p[("full_loop_k3", "asymloop_k5")]["Table 8"] == pytest.approx(3.205305 - 3.229346)  # both rows of Table 8
    assert p[("dense", "asymloop_k1")]["Table 8"] is None  # Table 8 has no AsymLoop K=1


def test_a_model_keeps_its_colour_across_figures(runs):
    # the logit-lens figure (either panel) draws each model in its COLOR, as the live figures do
    lens = depth.plot_lens(runs, ["full_loop_k2", "asymloop_k3_additive"]).axes
    for n in ("full_loop_k2", "asymloop_k3_additive"):
        drawn = [h for ax in lens for h in ax.get_legend_handles_labels()[0] if h.get_label().startswith(n)][0]
        assert drawn.lines[0].get_color() == depth.COLOR[n], n


def test_lens_from_zero_reads_h_then_the_package_lens():
    # k = 0 is the head on H = Enc(Embed(x)) (with Global KV and without it), k >= 1 is probes.logit_lens;
    # additive injection starts from z_0 = 0, which the bias-free head scores as a uniform guess, ln V
    import torch
    import torch.nn.functional as F

    from minimal_asymloop import experiments as ex
    from minimal_asymloop.model import LoopedLM
    from minimal_asymloop.probes import logit_lens

    idx = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, 1)
    for context in ("global_kv", "none", "additive"):
        torch.manual_seed(0)
        m = LoopedLM(ex.lm_config("asymloop", n_iter=2, context=context)).eval()
        with torch.no_grad():
            h = m.embed(idx)
            for blk in m.encoder:
                h = blk(h, m.rope)
            z0 = torch.zeros_like(h) if context == "additive" else h
            want0 = F.cross_entropy(m.logits(z0).flatten(0, 1), targets.flatten()).item()
        got = depth.lens_from_zero(m, idx, targets, n_iter=3)
        assert got[0] == pytest.approx(want0, abs=1e-5) and got[1:] == pytest.approx(logit_lens(m, idx, targets, 3))
        assert (got[0] == pytest.approx(math.log(1024), abs=1e-4)) == (context == "additive"), context


def test_live_run_retraces_the_stored_runs_first_steps(runs):
    # the live run trains the first steps of the stored 200-step schedule: its losses are the stored run's (a
    # schedule compressed to `steps` would change the LR from the second step on)
    live = depth.train_live(runs, steps=3, seed=0, names=("asymloop_k3",))
    stored = [x[1] for x in runs.runs[("asymloop_k3", 0)]["train_loss"][:3]]
    assert [x[1] for x in live["asymloop_k3"]["train_loss"]] == pytest.approx(stored, abs=1e-3)
    with pytest.raises(ValueError, match="stored runs' schedule"):
        depth.train_live(runs, steps=runs.setting["steps"] + 1)


def test_live_figures_build_and_name_the_leader(runs):
    fake = {n: dict(train_loss=runs.runs[(n, 0)]["train_loss"][:60]) for n in depth.LIVE_ARMS}
    lens = {"asymloop_k3": [5.4, 4.9, 4.8, 4.8, 4.81], "asymloop_k3_no_global": [5.4, 5.0, 5.0, 5.0, 5.01]}
    title = depth.plot_live_lens(lens, 60, 0).axes[0].get_title()
    assert "with Global KV is ahead at K = 3 by 0.20" in title
    gap = depth.plot_live_gap(runs, fake)
    assert plt.get_fignums() == [] and len(gap.axes) == len(runs.seeds)
    assert any(line.get_label() == "live run" for line in gap.axes[0].get_lines())


def test_describe_counts_each_run_once_and_prints_the_schedule(runs, capsys):
    runs.describe()
    out = capsys.readouterr().out
    shared = {(r["name"], r["seed"]) for r in runs.md["runs"]} & {(r["name"], r["seed"]) for r in runs.gk["runs"]}
    assert f"{len(shared)} of them reused from the line above; {len(runs.gk['runs']) - len(shared)} trained" in out and shared
    assert f"warm-up over steps 1-{runs.warmup()}" in out and runs.warmup() == round(0.1 * runs.setting["steps"])


def test_lens_titles_say_what_each_panel_shows(runs, monkeypatch):
    # left: Global KV and Full Loop models; right: additive injection past its trained K, on its own scale
    names = ["asymloop_k3", "asymloop_k5", "asymloop_k3_additive", "asymloop_k5_additive"]
    left, right = depth.plot_lens(runs, names).axes
    rise = {n: (runs.lens(n)[:, -1] - runs.lens(n)[:, runs.n_iter(n) - 1]).mean() for n in names}
    assert "least in" not in left.get_title()  # k = 8 is 5 extra iterations at K = 3, 3 at K = 5: not comparable
    assert ("rises in every model" in left.get_title()) == (min(rise[n] for n in names[:2]) > 0)
    assert "Each trained iteration after the first lowers the mean loss;" in left.get_title()  # the stored means fall up to each K
    add = [rise[n] for n in names[2:]]
    assert f"{min(add):+.4f} to {max(add):+.4f}" in right.get_title()
    assert all("additive" in h.get_label() for h in right.get_legend_handles_labels()[0])
    assert right.get_ylim()[1] < 0.05  # its own scale: the rise past K (thousandths of a nat) is visible
    flat = runs.lens("asymloop_k3").copy()
    flat[:, 2] = flat[:, 1] + 0.01  # k = 3 worse than k = 2: a trained iteration that raises the mean loss
    monkeypatch.setattr(runs, "lens", lambda n: flat if n == "asymloop_k3" else depth.LMRuns.lens(runs, n))
    assert "does not always lower the mean loss" in depth.plot_lens(runs, names[:2]).axes[0].get_title()


def test_build_references_match_the_package_and_catch_wrong_versions(runs):
    # the lines notebook 02 ships unwritten: its references agree with the package, and its wrong versions fail
    import torch

    from minimal_asymloop import experiments as ex
    from minimal_asymloop.model import LoopedLM

    torch.manual_seed(0)
    m = LoopedLM(ex.lm_config("asymloop", n_iter=3)).eval()
    x = torch.randint(0, m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = m.embed(x)
        for blk in m.encoder:
            h = blk(h, m.rope)
        kv = [depth.global_kv(b.attn, m.enc_norm(h), m.rope) for b in m.decoder]
        assert all(torch.equal(u, v) for p, q in zip(kv, m.global_kv(h)) for u, v in zip(p, q))
        z = h
        for _ in range(3):
            for blk, kv_g in zip(m.decoder, kv):
                z = depth.block(blk, z, kv_g, m.rope)
        assert torch.allclose(z, m.states(x, n_iter=3)[-1], atol=1e-6)
        assert depth.block(m.decoder[0], h, None, m.rope).equal(m.decoder[0](h, m.rope))
        zs = m.states(x, n_iter=2)
        t = torch.roll(x, -1, 1)
        assert depth.lens_losses(m, zs, t)[-1] == pytest.approx(m(x, t, n_iter=2)[1].item(), abs=1e-5)
        kv_wrong = depth.unroll_kv_from_state(m, h, kv, 3)
        assert all(torch.equal(a, b) for a, b in zip(depth.unroll(m, h, kv, 3), m.states(x, n_iter=3)))
        assert (kv_wrong[-1] - m.states(x, n_iter=3)[-1]).abs().max() > 1e-4
    g = depth.gains(runs)
    assert np.array_equal(depth.within(runs, "asymloop_k3_no_global", "asymloop_k3"), g[3])

    def check(f):
        assert np.allclose(f(runs, "dense", "asymloop_k1"), g[1])

    assert depth.passes(check, depth.within)
    assert not depth.passes(check, lambda r, a, b: r.loss(b) - r.loss(a))  # the wrong sign is caught


def test_context_figure_draws_each_variant_by_its_run_name():
    fig = depth.context_figure(n_iter=3)
    text = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert all(f"run: asymloop_k3{s}" in text for s in depth.CONTEXT_VARIANTS)  # the names the notebook's tables use
    assert text.count("Dec\nk=3") == 3 and "Dec\nk=4" not in text and "$z_0=0$" in text
    assert text.count("come from $z_{k-1}+H$") == 1 and text.count("come from $z_{k-1}$ ") == 2  # additive's input adds H
    assert "Dec\nk=5" in " ".join(t.get_text() for t in depth.context_figure(n_iter=5).axes[0].texts)
    assert plt.get_fignums() == []


def test_replay_check_passes_the_stored_steps_and_catches_a_changed_first_step(runs, monkeypatch, capsys):
    monkeypatch.setattr(depth, "source_identity", lambda *a: runs.setting["data_identity"])  # as on the stored corpus
    live = {n: {"train_loss": [list(x) for x in runs.runs[(n, 0)]["train_loss"][:10]]} for n in depth.LIVE_ARMS}
    depth.replay_check(runs, live, seed=0, steps=10)  # the stored steps themselves: gaps 0
    assert "steps 1-5: 0e+00" in capsys.readouterr().out
    live["asymloop_k3"]["train_loss"][2][1] += 1e-3  # step 3 moved: not the stored run
    with pytest.raises(AssertionError, match="not the stored run's first steps"):
        depth.replay_check(runs, live, seed=0, steps=10)
    monkeypatch.setattr(depth, "source_identity", lambda *a: "another corpus")  # elsewhere the gaps are printed only
    depth.replay_check(runs, live, seed=0, steps=10)
