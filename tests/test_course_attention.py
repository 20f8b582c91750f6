"""Notebook 01's plumbing (minimal_asymloop/course/attention.py): the trace tables, the checks, the reuse of a build."""

import json
import linecache
import math

import pytest
import torch

from minimal_asymloop.course import attention
from minimal_asymloop.course.attention import check, competition_figure, global_shares, key_labels, show_failing, table
from minimal_asymloop.model import LoopedLM


def test_the_table_prints_each_value_and_splits_the_halves():
    text = table("probs", [[0.8044, float("-inf")], [0.25, 0.75]], key_labels(1))
    assert text.splitlines() == ["probs", "             G0 |     L0", " token 0  0.804 |   -inf",
                                 " token 1  0.250 |  0.750"]
    with pytest.raises(ValueError, match="3 column names for 2 columns"):
        table("x", [[1.0, 2.0]], ["a", "b", "c"])


def test_check_passes_within_tolerance_and_names_the_difference_otherwise(capsys):
    a = torch.zeros(3)
    check("same", a, a + 1e-12)
    assert "OK      same: largest difference 1e-12" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="off: largest difference 1e-08 > tolerance 1e-10"):
        check("off", a, a + 1e-8)
    with pytest.raises(AssertionError, match="off: largest difference 0.5 > tolerance 1e-06"):
        check("off", a, a + 0.5, tol=1e-6)


def test_show_failing_prints_a_caught_check_and_refuses_a_passing_one(capsys):
    show_failing("wrong", lambda: check("x", torch.zeros(1), torch.ones(1)))
    assert "CAUGHT  wrong version (wrong): x: largest difference 1" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="cannot tell the two apart"):
        show_failing("not wrong", lambda: check("x", torch.zeros(1), torch.zeros(1)))


def test_notebook_01_section_5_asserts_fail_on_the_untrained_model(capsys):
    """Run notebook 01's code cells in order (its unwritten build lines fall back on the reference) with STEPS = 0
    (the init models) and the headline asserts forced on: the summary's claim (masking Global leaves chance) must
    fail there, and the verdict lines of both inits must say so."""
    from minimal_asymloop.paths import REPO

    cells = json.loads((REPO / "notebooks" / "01_joint_attention.ipynb").read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    knobs, guard = "STEPS, LAG = 200, 2", "if (STEPS, LAG) == (200, 2):"
    assert any(knobs in s for s in sources) and any(guard in s for s in sources), "section 5's knobs or guard moved"
    ns = {}
    dtype, rng = torch.get_default_dtype(), torch.get_rng_state()  # the notebook sets float64 for the whole process
    try:
        with pytest.raises(AssertionError, match="masking Global"):
            for i, src in enumerate(sources):
                if "asymloop_figure(" in src or "mask_figure(" in src or "competition_figure(" in src:
                    src = "\n".join(line for line in src.splitlines() if "_figure(" not in line)
                src, name = src.replace(knobs, "STEPS, LAG = 0, 2").replace(guard, "if True:"), f"<notebook 01 cell {i}>"
                linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)  # as IPython does
                exec(compile(src, name, "exec"), ns)
        assert all(ns["shares"][i][1].mean() < 0.6 for i in ("bug-hunting", "standard"))  # the init models' shares, about half
        out = capsys.readouterr().out
        assert out.count("does NOT hold: masking Global") == 2
        assert out.count("your line is not written yet") == 3  # global_kv, joint_softmax and decoder_loop, shipped unwritten
    finally:  # later tests in this process train in float32 from their own seeds
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)


def test_the_competition_figure_plots_one_softmax_global_share_against_two_softmaxes_half():
    """Token 0 sees G0 (score 2) and L0 (score 0): w_G = e^(2g) / (e^(2g) + 1), 1/2 at g = 0; two softmaxes: 1/2."""
    scores = torch.tensor([[2.0, 0.0, 0.0, 0.0], [1.0, -1.0, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, False], [True, True, True, True]])
    for g in (0.0, 1.0, 2.0):
        assert abs(global_shares(scores, mask, g)[0].item() - math.exp(2 * g) / (math.exp(2 * g) + 1)) < 1e-12
    fig = competition_figure(scores, mask, global_scale=2.0)
    curves = fig.axes[1].get_lines()
    grid, token0 = curves[0].get_data()
    assert abs(token0[grid.tolist().index(2.0)] - math.exp(4) / (math.exp(4) + 1)) < 1e-12
    assert list(curves[2].get_ydata()) == [0.5, 0.5]  # the two-softmax line
    from matplotlib.colors import rgb_to_hsv, to_rgb

    hues = [rgb_to_hsv(to_rgb(line.get_color()))[0] for line in curves[:2]]  # tokens in joint attention's purple,
    assert all(0.65 < h < 0.8 for h in hues), hues  # not the orange/green/blue that mean Global/loop/encoder in 01
    cells = [t.get_text() for t in fig.axes[0].texts]
    assert cells[:4] == [f"{math.exp(4) / (math.exp(4) + 1):.2f}", "-", f"{1 / (math.exp(4) + 1):.2f}", "-"]
    with pytest.raises(ValueError, match="must both be \\(N, 2N\\); pass one head"):
        competition_figure(scores[None], mask)


def test_the_decoder_look_figure_draws_each_mean_cell_and_accuracy():
    from minimal_asymloop.course.attention import decoder_look_figure

    shares = {"standard": (torch.full((3, 2), 0.5), torch.tensor([[0.9, 0.3], [0.8, 0.7], [0.6, 0.5]])),
              "bug-hunting": (torch.full((3, 2), 0.4), torch.full((3, 2), 0.8))}
    acc = {"standard": {"nothing": 1.0, "Global": 0.03, "Local": 0.97}, "bug-hunting": {"nothing": 0.9, "Global": 0.1, "Local": 1.0}}
    ax, bx = decoder_look_figure(shares, acc, chance=1 / 32).axes
    assert [round(p.get_height(), 4) for p in ax.patches] == [0.5, 0.6333, 0.4, 0.8]  # means: init, trained, per init
    assert sorted(ax.collections[1].get_offsets()[:, 1].tolist()) == sorted(shares["standard"][1].flatten().tolist())
    assert [p.get_height() for p in bx.patches] == [1.0, 0.03, 0.97, 0.9, 0.1, 1.0]
    assert [t.get_text() for t in bx.get_xticklabels()] == ["nothing\n(both left)", "Global\n(Local left)", "Local\n(Global left)"] * 2
    chain = {0: {"nothing": {1: 1.0, 2: 1.0, 3: 0.99}, "Global": {1: 0.7, 2: 0.3, 3: 0.2}, "Local": {1: 0.3, 2: 0.8, 3: 0.36}},
             1: {"nothing": {1: 1.0, 2: 1.0, 3: 1.0}, "Global": {1: 1.0, 2: 0.9, 3: 0.92}, "Local": {1: 1.0, 2: 0.4, 3: 0.33}}}
    *_, cx = decoder_look_figure(shares, acc, chance=1 / 32, chain=chain).axes  # a third panel: 3-hop accuracy
    assert [p.get_height() for p in cx.patches] == [0.99, 0.2, 0.36, 1.0, 0.92, 0.33]


def test_chain_masked_runs_a_build_on_the_trained_chain_models_and_masking_local_breaks_3_hop():
    """Notebook 01's second experiment, with the reference build: notebook 03's trained models answer 3-hop statements
    with both halves and fail with the Local half masked; an untrained model fails with nothing masked (the notebook's
    assert fails there)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        local_off = lambda s: attention.joint_softmax(s.masked_fill(torch.arange(s.size(-1)) >= s.size(-1) // 2, -math.inf))
        masks = {"nothing": attention.joint_softmax, "Local": local_off}
        chain = attention.chain_masked(masks, seeds=(1,))
        assert chain[1]["nothing"][3] > 0.99 and chain[1]["Local"][3] < 0.5
        untrained = lambda model, idx, n_iter, probs: attention.asymloop(_reinit(model), idx, n_iter, probs)
        assert attention.chain_masked({"nothing": attention.joint_softmax}, seeds=(1,), build=untrained)[1]["nothing"][3] < 0.5
    finally:
        torch.set_default_dtype(dtype)


def _reinit(model):  # an untrained model of the same configuration
    torch.manual_seed(0)
    return LoopedLM(model.config).to(torch.float64)


def test_the_reference_build_equals_the_package_and_a_wrong_joint_mask_does_not():
    """The reference that notebook 01's unwritten steps fall back on, and that its solutions import: logits equal to
    LoopedLM's; an all-visible Global half changes them."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cfg, model, idx = attention.tiny_model()
        with torch.no_grad():
            want = model(idx)[0]
            check("reference asymloop", attention.asymloop(model, idx, cfg.n_iter), want)
            wrong = attention.asymloop(model, idx, cfg.n_iter, lambda s: attention.joint_softmax(s, causal_global=False))
            show_failing("all-visible Global half", lambda: check("reference asymloop", wrong, want))
            H = attention.encoder(model, model.embed.weight[idx])
            for (k, v), (k_pkg, v_pkg) in zip(attention.global_kv(model, H), model.global_kv(H)):
                check("K^G", k, k_pkg)
                check("V^G", v, v_pkg)
    finally:
        torch.set_default_dtype(dtype)
    assert model.embed.weight.dtype == torch.float64  # tiny_model draws in float64 whatever the default
    t = attention.trace()
    from minimal_asymloop.model import joint_attention, joint_mask

    assert torch.equal(t["mask"], joint_mask(3, "cpu"))
    probs = t["scores"].masked_fill(~t["mask"], float("-inf")).softmax(1)
    assert abs(probs[0, 0].item() - 0.804) < 1e-3  # the trace's row 0, as notebook 01 prints it
    out = joint_attention(*(t[n][None, None] for n in ("q", "k_g", "v_g", "k_l", "v_l")))[0, 0]
    check("trace", probs @ torch.cat([t["v_g"], t["v_l"]]), out)


def test_train_lag_lowers_the_loss_and_steps_0_changes_nothing():
    from minimal_asymloop.model import LoopedLM, ModelConfig
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(arch="asymloop", n_layer=2, d_model=16, n_head=2, d_ff=32, vocab_size=8, max_seq_len=8))
    x = torch.randint(0, 8, (16, 8), generator=torch.Generator().manual_seed(0))
    y = x.roll(1, dims=1).masked_fill(torch.arange(8) < 1, -100)
    def loss():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-100).item()
    before = loss()
    attention.train_lag(model, lambda: (x, y), 0)
    assert loss() == before
    attention.train_lag(model, lambda: (x, y), 30)
    assert loss() < 0.5 * before
