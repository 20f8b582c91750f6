"""notebooks/03's figures and tables (minimal_asymloop.course.chain): per-seed numbers straight from the JSON, the
lookup claims false at initialisation, figures built without pyplot."""

import copy
import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from minimal_asymloop.course import chain, chain_build
from minimal_asymloop.paths import RESULTS


@pytest.fixture(scope="module")
def ctx():
    return chain.ChainRuns("chain_context")


def test_counts_and_steps_are_the_json(ctx):
    rows = json.loads((RESULTS / "chain_context.json").read_text())["runs"]
    for name in chain.LABELS:
        mine = [r for r in rows if r["name"] == name]
        assert ctx.solved(name).sum() == sum(r["converged"] for r in mine)
        assert sorted(ctx.steps(name)) == sorted(r["steps"] for r in mine if r["converged"])  # failed seeds left out


def test_two_studies_part_on_the_plateau(ctx):
    grid = chain.ChainRuns("chain_task")
    assert ctx.parted_at(ctx, "asymloop_k3") == [None] * 5  # a study never parts from itself
    assert grid.parted_at(ctx, "asymloop_k3") == [500] * 5  # same check scores through step 250, then apart
    assert grid.parted_at(ctx, "asymloop_k3_no_global") == [None] * 5  # chain_task's copies of chain_context's runs
    assert grid.parted_at(ctx, "dense_l4") == [500, 500, 250, 500, 500]


def test_accuracy_at_test_time_k(ctx):
    r = ctx.run("asymloop_k3", 1)
    assert ctx.acc("asymloop_k3", 3, k=1)[1] == r["acc_by_test_k"]["1"]["3"]
    assert ctx.acc("asymloop_k3", 3)[1] == r["acc_by_test_k"]["3"]["3"]  # default: the trained K


def test_lookup_claims_fail_at_initialisation(ctx):
    init = chain.untrained_lookups(ctx, seed=0)
    _, qhops = chain.lookups(ctx, {})
    assert not chain.lookup_claims(init, qhops, local=True) and not chain.lookup_claims(init, qhops, local=False)


def test_figures_build_without_pyplot(ctx):
    grid = chain.ChainRuns("chain_task")
    sweep = [n for n in grid.names if not n.startswith("asymloop_k3_")]
    figs = [chain.plot_depth(grid, sweep), chain.plot_test_depth(grid, ["asymloop_k2", "asymloop_k3"]),
            chain.plot_context(ctx, list(chain.LABELS)), chain.plot_curves(ctx, ["asymloop_k3"])]
    assert plt.get_fignums() == []
    for fig in figs:
        assert fig._suptitle is not None and fig.axes[0].get_ylabel()
    legend = figs[1].axes[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["trained K=2", "trained K=3"]  # one entry per trained K


def test_live_title_follows_the_run():
    live = {"K=1": [(500, {1: 1.0, 2: 1.0, 3: 0.6})], "K=2": [(625, {1: 1.0, 2: 1.0, 3: 0.995})]}
    title = chain.live_title(live, 3, 1000, 0.99)
    assert "K=2: 3-hop 0.99, converged at step 625" in title and "K=1: 3-hop 0.60;" in title + ";"
    near = chain.live_title({"K=2": [(1000, {1: 1.0, 2: 0.9999, 3: 0.98955})]}, 3, 1000, 0.99)
    assert "K=2: 3-hop 0.99, just short of the bar (3-hop 0.9896 < 0.99)" in near  # 0.9896 does not print as 0.99
    flipped = chain.live_title({"K=1": live["K=2"], "K=2": live["K=1"]}, 3, 1000, 0.99)
    assert "K=1: 3-hop 0.99, converged" in flipped and "converged" not in flipped.split("K=2")[1]  # the run's, not fixed


def test_live_figure_draws_each_variant_and_the_plateau():
    live = {"K=1 (depth 2)": [(125, {1: 0.5, 2: 0.5, 3: 0.5}), (1000, {1: 1.0, 2: 1.0, 3: 0.63})]}
    fig = chain.plot_live(live, "t", plateau={2: 0.62, 3: 0.51})
    ys = [tuple(line.get_ydata()) for line in fig.axes[1].get_lines()]
    assert (0.5, 0.63) in ys and (0.51, 0.51) in ys  # the live 3-hop curve and the 3-hop plateau


def test_uniform_share_matches_untrained_attention(ctx):
    # an untrained model attends about uniformly: its share per statement is close to 4 / (q + 1) on average
    init = chain.untrained_lookups(ctx, seed=0, name="asymloop_k3_no_local")
    _, qhops = chain.lookups(ctx, {})
    u, s = chain.uniform_share(qhops), chain.shares(init, qhops, 3).sum(-1)
    assert 0.1 < u < 0.25 and abs(s[0, 1] - u) < 0.03 and abs(s[0, 2] - u) < 0.03


def test_no_local_claims_fail_on_the_untrained_no_local_model(ctx):
    init = chain.untrained_lookups(ctx, seed=0, name="asymloop_k3_no_local")
    _, qhops = chain.lookups(ctx, {})
    assert not chain.lookup_claims(init, qhops, local=False)


def test_lookup_figure_names_both_uniform_references(ctx):
    # both halves: uniform per half; without Local KV: uniform on Global only; two legend entries, two values
    _, qhops = chain.lookups(ctx, {})
    look = {("asymloop_k3", 0): chain.untrained_lookups(ctx, 0, "asymloop_k3"),
            ("asymloop_k3_no_local", 0): chain.untrained_lookups(ctx, 0, "asymloop_k3_no_local")}
    fig = chain.plot_lookups(look, qhops)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    u = chain.uniform_share(qhops)
    assert f"uniform, one statement: {u / 2:.2f} per half" in labels
    assert f"uniform, one statement: {u:.2f} (summed, or Global only)" in labels
    summed = [ln for ln in fig.axes[0].lines if ln.get_label() == "j=1, both halves summed"]  # both halves' panel only
    b = chain.shares(look[("asymloop_k3", 0)], qhops, 3)
    assert len(summed) == 1 and np.allclose(summed[0].get_ydata(), b[:, 1].sum(-1))
    assert not [ln for ln in fig.axes[1].lines if ln.get_label() == "j=1, both halves summed"]
    assert not [ln for ln in fig.axes[1].lines if "via Local" in ln.get_label()]  # no Local half: no Local line
    assert len([ln for ln in fig.axes[0].lines if "via Local" in ln.get_label()]) == 2


def _resolve(text, passes):  # one pass resolves every statement whose right-hand side is a digit or already resolved
    stmts = [st.split("=") for st in text.split(";") if st]
    known = {}
    for _ in range(passes):
        known = {**known, **{lhs: rhs if rhs.isdigit() else known[rhs] for lhs, rhs in stmts if rhs.isdigit() or rhs in known}}
    return [known.get(lhs) for lhs, _ in stmts]


def test_score_resolver_counts_passes_per_hop(ctx):
    assert chain_build.score_resolver(ctx.task, _resolve, 3, n=64) == {1: 1.0, 2: 1.0, 3: 1.0}
    assert chain_build.score_resolver(ctx.task, _resolve, 2, n=64) == {1: 1.0, 2: 1.0, 3: 0.0}
    wrong = chain_build.score_resolver(ctx.task, lambda text, p: ["0"] * 8, 3, n=64)  # a constant answer: about 1 in 4
    assert 0.1 < wrong[1] < 0.4


def test_accuracy_by_hops_runs_the_batch_on_the_models_device(ctx):
    """A model whose parameters live on another device ("meta" here, as "cuda" on a GPU) gets its batch there."""
    import torch

    from minimal_asymloop.tasks import accuracy_by_hops

    class OnMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1, device="meta"))

        def forward(self, idx, n_iter=None):
            assert idx.device.type == "meta", f"batch on {idx.device}, model on meta"
            return torch.zeros(*idx.shape, len(ctx.task.chars)), None

    assert set(accuracy_by_hops(OnMeta(), ctx.task, n=4)) == {1, 2, 3}


def test_table_columns_line_up_when_five_seeds_converge(ctx, capsys):
    ctx.table(["asymloop_k3", "dense_l4"])  # both 5/5: the longest steps cells
    head, *rows = capsys.readouterr().out.splitlines()
    col = head.index("2-hop accuracy per seed")
    assert all(row[col:col + 4] == "1.00" for row in rows), rows  # a too-narrow steps column shifts the per-seed ones


def test_load_trained_names_missing_weights(ctx):
    with pytest.raises(ValueError, match="no committed weights"):
        chain.load_trained(ctx, keys=[("dense_l4", 0)])


def test_answer_resolves_one_hop_per_round_and_check_rounds_counts_misses(capsys):
    assert [chain_build.answer("a=3;x=1;b=a;c=b;", r) for r in (1, 2, 3)] == [
        ["3", "1", None, None], ["3", "1", "3", None], ["3", "1", "3", "3"]]
    everything_at_once = lambda text, r: chain_build.answer(text, 3)  # noqa: E731 (the sequential pass: no rounds)
    assert chain_build.check_rounds(everything_at_once, "a=3;x=1;b=a;c=b;", label="at_once") == 3  # b, c; then c
    assert chain_build.check_rounds(chain_build.answer, "a=3;x=1;b=a;c=b;") == 0
    out = capsys.readouterr().out
    assert "2 statement(s) differ" in out and "1 round(s): at_once ['3'" in out and "1 round(s): yours" in out


def test_no_chain_rule_is_scored_on_the_check_programs():
    from minimal_asymloop.course import chain_build, tour
    grid = chain.ChainRuns("chain_task")
    rule = chain_build.no_chain_rule(grid)
    assert rule == tour.frequency_rule(grid.task, n=256, seed=1234) != tour.frequency_rule(grid.task)  # not the fresh draw
    live = {"K=1": [(125, {1: 0.5, 2: 0.5, 3: 0.5}), (1000, {1: 1.0, 2: 1.0, 3: 0.63})]}
    ys = [tuple(line.get_ydata()) for line in chain.plot_live(live, "t", rule=rule).axes[1].get_lines()]
    curves = [tuple(line.get_ydata()) for line in chain.plot_curves(grid, ["dense_l1"], rule=rule).axes[0].get_lines()]
    assert (rule[3], rule[3]) in ys and (rule[3], rule[3]) in curves  # the 3-hop rule drawn on both figures


def _resolve_with(text, rounds, step):  # notebook 03's resolve
    stmts, known = [st.split("=") for st in text.split(";") if st], {}
    for _ in range(rounds):
        known = step(stmts, known)
    return [known.get(lhs) for lhs, _ in stmts]


def test_checked_keeps_a_right_step_and_falls_back_on_a_wrong_one(capsys):

    def one_round(stmts, known):  # the reader's unwritten stub: bind only
        return chain_build.bind(stmts, known)

    assert chain_build.checked(_resolve_with, one_round, "a=3;x=1;b=a;c=b;") is chain_build.one_round
    assert "not yet right" in capsys.readouterr().out
    right = lambda stmts, known: chain_build.one_round(stmts, known)  # noqa: E731
    right.__name__ = "one_round"
    assert chain_build.checked(_resolve_with, right, "a=3;x=1;b=a;c=b;") is right
    assert chain_build.score_resolver(chain.ChainRuns("chain_task").task, lambda t, n: _resolve_with(t, n, chain_build.one_round), 3) \
        == {1: 1.0, 2: 1.0, 3: 1.0}


def test_pretty_names_and_program_attention_marks_the_chain(ctx):
    from minimal_asymloop.model import LoopedLM
    assert chain.pretty("asymloop_k3_no_local") == "AsymLoop K=3 without Local KV" and chain.pretty("dense_l4") == "Dense L=4"
    model = LoopedLM(chain.ex.chain_models(ctx.task)["asymloop_k3_no_local"]).eval()
    fig = chain_build.plot_program_attention({"init": model}, ctx.task, seed=3)
    assert len(fig.axes) == 3 + 1 and not plt.get_fignums()  # three iterations and the colour bar; no pyplot
    o, x = fig.axes[0].collections  # o: j = 1, x: j = 2 of "d=0;b=0;h=0;e=h;f=1;a=f;g=e;c=d;"
    assert [tuple(p) for p in x.get_offsets()] == [(2, 6)] and (3, 6) in [tuple(p) for p in o.get_offsets()]


def test_depth_at_test_time_reads_only_the_solved_runs(capsys):
    grid = chain.ChainRuns("chain_task")
    loops = [f"asymloop_k{k}" for k in range(1, 6)]
    td = chain_build.depth_at_test_time(grid, loops)
    solved_k2_up = sum(grid.solved(n).sum() for n in loops[1:])  # trained K >= 2: K = 2..5
    assert len(td["at_k1"]) == solved_k2_up == 11 and len(td["at_k2"]) == solved_k2_up - grid.solved("asymloop_k2").sum()
    assert len(td["gain"]) == 25 and "asymloop_k1" not in td["drop"]  # every run; no solved K=1 run to drop from
    assert "AsymLoop K=2 0.045" in capsys.readouterr().out
    at_k2 = [grid.run(n, s)["acc_by_test_k"]["2"] for n in loops[2:] for s in grid.seeds if grid.run(n, s)["converged"]]
    assert td["solved_k2"] == [min(a.values()) >= 0.99 for a in at_k2] and sum(td["solved_k2"]) == 3  # 3 of 8


def test_both_halves_claim_is_a_multiple_of_the_uniform_share(ctx):
    """lookup_claims(local=True) needs iteration 2's share on j=1 above AGAIN times uniform: a model at 1.4x fails."""
    import torch
    _, qhops = chain.lookups(ctx, {})
    u = chain.uniform_share(qhops)
    stmt = torch.zeros(3, 1, 4, *qhops.shape, 4, 2)  # (K, layer, heads, programs, queries, J, halves)
    stmt[1, 0, :, :, :, 1, 1] = 1.4 * u  # all on Local, nothing on j=2: only the multiple can fail
    assert not chain.lookup_claims({"stmt": stmt}, qhops, local=True)
    stmt[1, 0, :, :, :, 1, 1] = 1.6 * u
    assert chain.lookup_claims({"stmt": stmt}, qhops, local=True)


def test_k1_without_global_kv_is_dense_l2_on_the_task(ctx):
    assert chain_build.k1_without_global_is_dense(ctx.task, seeds=(0,)) == 0


def test_resolver_check_fails_the_in_place_round_and_passes_the_reference():
    from minimal_asymloop.course import build
    check = chain_build.resolver_check(_resolve_with, chain.ChainRuns("chain_task").task, "a=3;x=1;b=a;c=b;")

    def in_place(stmts, known):  # reads what this round already wrote: one pass follows a whole chain
        new = chain_build.bind(stmts, known)
        for lhs, rhs in stmts:
            if rhs in new:
                new[lhs] = new[rhs]
        return new

    assert not build.passes(check, in_place) and not build.passes(check, chain_build.bind)
    assert build.passes(check, chain_build.one_round)


def test_shares_check_takes_the_halves_apart(ctx):
    from minimal_asymloop.course import build
    from minimal_asymloop.model import LoopedLM
    model = LoopedLM(chain.ex.chain_models(ctx.task)["asymloop_k3"]).eval()  # untrained: both halves carry mass
    check = chain_build.shares_check(model, ctx.task, n=2)
    interleaved = lambda a: a.unflatten(-1, (-1, 2)).transpose(-1, -2).unflatten(-1, (-1, 4)).sum(-1)  # noqa: E731
    global_only = lambda a: chain_build.statement_shares(a) * torch.tensor([1.0, 0.0])[:, None]  # noqa: E731
    assert build.passes(check, chain_build.statement_shares)
    assert not build.passes(check, interleaved) and not build.passes(check, global_only)


def test_silence_check_wants_each_heads_own_slice(ctx):
    from minimal_asymloop.course import build
    model = chain.load_trained(ctx, keys=[("asymloop_k3", 1)])[("asymloop_k3", 1)].cpu()
    check = chain_build.silence_check(model, ctx.task, n=2)

    def in_place(m, heads):  # a wrong version: hooks the model itself
        for blk in m.decoder:
            blk.attn.wo.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
        return m

    assert build.passes(check, lambda m, hs: chain_build.without_heads(m, hs))
    assert not build.passes(check, chain_build.silence_strided) and not build.passes(check, lambda m, hs: m)
    assert not build.passes(check, lambda m, hs: in_place(copy.deepcopy(m), hs))  # silences every head: wrong logits
    assert not build.passes(chain_build.silence_check(copy.deepcopy(model), ctx.task, n=2), in_place)


def test_depth_figures_draw_the_plateau():
    grid = chain.ChainRuns("chain_task")
    fig = chain.plot_depth(grid, ["dense_l1", "asymloop_k2"], plateau={2: 0.63, 3: 0.51})
    assert (0.51, 0.51) in [tuple(line.get_ydata()) for line in fig.axes[1].get_lines()]
    assert "plateau (its value on the line)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [[t.get_text() for t in ax.texts if t.get_text().startswith("plateau")] for ax in fig.axes[:2]] == \
        [["plateau 0.63"], ["plateau 0.51"]]  # each panel names its own level


def test_without_heads_is_zeroed_wo_columns_and_at_silences_one_iteration(ctx):
    model = chain.load_trained(ctx, keys=[("asymloop_k3_no_local", 1)])[("asymloop_k3_no_local", 1)].cpu()
    x = ctx.task.batch(4, torch.Generator().manual_seed(0))[0]
    hd = model.config.d_model // model.config.n_head
    cols = copy.deepcopy(model)
    with torch.no_grad():
        for blk in cols.decoder:
            for h in (0, 3):
                blk.attn.wo.weight[:, hd * h:hd * (h + 1)] = 0
        hooked, zeroed, plain = (m(x)[0] for m in (chain_build.without_heads(model, [0, 3]), cols, model))
        at2 = chain_build.without_heads(model, [0, 3], at=2)(x)[0]
        first = [z.clone() for z in chain_build.without_heads(model, [0, 3], at=2).states(x)]
    assert (hooked - zeroed).abs().max() < 1e-5 < 1 < (hooked - plain).abs().max()
    assert (at2 - plain).abs().max() > 1e-3 and (at2 - hooked).abs().max() > 1e-3  # iteration 2 only: neither extreme
    assert torch.equal(first[0], model.states(x)[0])  # iteration 1 untouched
    assert all(not m._forward_pre_hooks for m in model.modules())  # the original keeps no hook
    with torch.no_grad():
        every = chain_build.without_heads(model, [0, 3], at={1, 2, 3})(x)[0]
        two = chain_build.without_heads(model, [0, 3], at={2, 3})(x)[0]
    assert torch.equal(every, hooked)  # a set of every iteration is None's "always"
    assert (two - at2).abs().max() > 1e-3 and (two - hooked).abs().max() > 1e-3  # iterations 2 and 3: another model


def test_no_local_claim_holds_iteration_3_to_j2_as_well(ctx):
    """lookup_claims(local=False): iteration 1 on j=1, iterations 2 and 3 on j=2. A model whose iteration 3 goes back
    to j=1 fails, though iterations 1 and 2 are right."""
    import torch
    _, qhops = chain.lookups(ctx, {})
    stmt = torch.zeros(3, 1, 4, *qhops.shape, 4, 2)  # (K, layer, heads, programs, queries, J, halves)
    stmt[0, 0, :, :, :, 1, 0] = 0.6  # iteration 1 on j=1, through Global
    stmt[1, 0, :, :, :, 2, 0] = 0.6  # iteration 2 on j=2
    stmt[2, 0, :, :, :, 2, 0] = 0.6  # iteration 3 on j=2
    assert chain.lookup_claims({"stmt": stmt}, qhops, local=False)
    stmt[2, 0, :, :, :, 2, 0], stmt[2, 0, :, :, :, 1, 0] = 0.1, 0.6  # iteration 3 back on j=1
    assert not chain.lookup_claims({"stmt": stmt}, qhops, local=False)


def test_train_live_runs_on_one_thread_as_the_stored_runs_and_restores_the_count(monkeypatch):
    """The stored chain runs were made with --threads 1; a live run on more threads rounds otherwise and drifts."""
    seen = []
    monkeypatch.setattr(chain, "train_on_task", lambda *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(chain, "accuracy_by_hops", lambda *a, **k: {1: 0.0, 2: 0.0, 3: 0.0})
    setting = chain.ChainRuns("chain_task").setting
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(IndexError):  # the stub trainer makes no check, so the curve is empty
            chain.train_live(setting, {"K=1": dict(n_iter=1)}, seed=0, max_steps=1)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
