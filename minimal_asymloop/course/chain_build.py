"""Notebook 03's task and its build: one program as the model sees it, the construction drawn block by block, the
one-lookup-per-round resolver (the package's answer after r rounds on a small program, the check of the reader's
version against it, the reference steps, a resolver's score by hops), the score of a rule that follows no chain (the
plateau's reference), one program's attention, statement by statement, at every decoder iteration, the check of the
reader's head-silencing hook (and its wrong version), and the check that this task's AsymLoop K = 1 without Global KV
is Dense L = 2."""

import copy
from dataclasses import replace

import torch
from matplotlib import patheffects
from matplotlib.figure import Figure

from minimal_asymloop import experiments as ex
from minimal_asymloop.course import chain
from minimal_asymloop.course.tour import CHECK_SEED, frequency_rule
from minimal_asymloop.model import LoopedLM
from minimal_asymloop.probes import attention_maps, chain_back, chain_lookups
from minimal_asymloop.tasks import ChainTask, solve


def example(task: ChainTask, seed: int = 3):
    """Print one program as the model sees it, with the target and hop count at every position that carries a loss."""
    idx, targets, hops = task.batch(1, torch.Generator().manual_seed(seed))
    text = task.decode(idx[0])
    print(f"task: {task.n_stmt} statements, {task.n_vars} variable names, values 0..{task.n_values - 1}, chains of "
          f"1..{task.max_hops} hops; {task.seq_len} tokens, a loss at each right-hand side (positions 2, 6, 10, ...)")
    print("input :", " ".join(text))
    print("target:", " ".join(task.chars[t] if t >= 0 else "." for t in targets[0].tolist()))
    print("hops  :", " ".join(str(h) if h >= 0 else "." for h in hops[0].tolist()))


def score_resolver(task: ChainTask, resolve, passes: int, n: int = 256, seed: int = 0) -> dict[int, float]:
    """{hops: share of statements right} of resolve(text, passes) -> one value per statement (None: unresolved), on n
    programs of the task from the generator seed."""
    g, right = torch.Generator().manual_seed(seed), {}
    for _ in range(n):
        text, values, hops = task.program(g)
        for got, value, h in zip(resolve(text, passes), values, hops):
            right.setdefault(h, []).append(got == value)
    return {h: sum(r) / len(r) for h, r in sorted(right.items())}


def draw_chain(text: str = "a=3;x=1;b=a;c=b;") -> Figure:
    """The lookups a 3-hop statement needs, block by block: block 1 brings each statement's name to its right-hand
    side (gray arrows); block 2 lets every 2-hop statement read the digit of the statement it names; block 3 lets the 3-hop
    statement read the now-resolved value of the statement it names."""
    stmts = [t for t in text.split(";") if t]
    fig = Figure(figsize=(10, 2.8))
    ax = fig.subplots()
    env = {}
    for i, st in enumerate(stmts):
        lhs, rhs = st.split("=")
        env[lhs] = rhs if rhs.isdigit() else env[rhs]
        ax.text(i, 3, st + ";", ha="center", va="center", fontsize=13, family="monospace",
                bbox=dict(boxstyle="round", fc="0.95", ec="0.5"))
        ax.text(i, 3.4, f"target {env[lhs]}", ha="center", fontsize=9, color="0.3")  # what the model must output
        ax.annotate("", xy=(i - 0.22, 2.68), xytext=(i + 0.05, 2.68), arrowprops=dict(arrowstyle="->", color="0.5", lw=1.5))
    names = {st.split("=")[0]: i for i, st in enumerate(stmts)}
    for level, st in enumerate(stmts):
        rhs = st.split("=")[1]
        if rhs in names:
            j = names[rhs]
            hop = 2 if stmts[j].split("=")[1].isdigit() else 3
            y = 2.4  # below the gray arrows, bending down: no crossing
            ax.annotate("", xy=(j, y), xytext=(level, y), arrowprops=dict(arrowstyle="->", color=f"C{hop - 2}", lw=2,
                                                                          connectionstyle="arc3,rad=-0.25"))
            ax.text((level + j) / 2, 1.45, f"block {hop}: '{st}' reads the value of '{stmts[j]}'", ha="center",
                    fontsize=9, color=f"C{hop - 2}")
    ax.text(-0.4, 1.0, "block 1 (gray arrows): each right-hand side takes in its statement's name (two tokens back): the key "
            "a later lookup matches", fontsize=9, color="0.3")
    ax.set(xlim=(-0.6, len(stmts) - 0.4), ylim=(0.8, 3.7))
    ax.axis("off")
    ax.set_title("One construction: a k-hop statement (k >= 2) in k blocks: names to right-hand sides, then one lookup "
                 "per hop after the first",
                 fontsize=10)
    fig.tight_layout()
    return fig


def answer(text: str, rounds: int) -> list:
    """The value of every statement after `rounds` rounds of one lookup each (tasks.solve's value for a statement of
    at most `rounds` hops, None for a longer one): a k-hop statement is resolved in round k."""
    hops = {}
    for stmt in filter(None, text.split(";")):
        lhs, rhs = stmt.split("=")
        hops[lhs] = 1 if rhs.isdigit() else hops[rhs] + 1
    return [v if h <= rounds else None for v, h in zip(solve(text), hops.values())]


def check_rounds(resolve, text: str, rounds=(1, 2, 3), label: str = "yours") -> int:
    """Print resolve(text, r), named `label`, beside the package's answer for each r; return how many statements
    differ, all r together."""
    wrong = 0
    for r in rounds:
        got, want = resolve(text, r), answer(text, r)
        bad = sum(g != w for g, w in zip(got, want, strict=True))
        wrong += bad
        print(f"{r} round(s): {label} {got}, package {want}: {bad} statement(s) differ")
    return wrong


def bind(stmts, known):
    """The reference round 1: a statement whose right-hand side is a digit takes that digit."""
    return {**known, **{lhs: rhs for lhs, rhs in stmts if rhs.isdigit()}}


def one_round(stmts, known):
    """The reference round: bind, then every statement naming a variable that `known` (the last round) holds takes its value."""
    new = bind(stmts, known)
    for lhs, rhs in stmts:
        if rhs in known:
            new[lhs] = known[rhs]
    return new


def checked(resolve, step, text: str, rounds=(1, 2, 3)):
    """The reader's `step` if resolve(text, r, step) matches the package's answer for every r, else this module's
    reference of the same name (said in one line), so that the cells below run either way."""
    if check_rounds(lambda t, r: resolve(t, r, step), text, rounds) == 0:
        print(f"your {step.__name__} passes: the cells below use it")
        return step
    print(f"not yet right: the cells below use the reference chain_build.{step.__name__}; write yours and run the cell again")
    return globals()[step.__name__]


def resolver_check(resolve, task: ChainTask, text: str):
    """A check of a round `step` (raises AssertionError on a wrong one): resolve(text, r, step) matches the package
    after r = 1, 2, 3 rounds, and on 256 programs of the task 3 rounds resolve everything, 2 rounds no 3-hop statement."""
    def check(step):
        wrong = check_rounds(lambda t, r: resolve(t, r, step), text, label=step.__name__)
        score = {r: score_resolver(task, lambda t, n: resolve(t, n, step), r) for r in (2, 3)}
        print(f"{step.__name__}, 256 programs, share right by hops: " + "; ".join(
            f"{r} rounds " + " ".join(f"{h}: {a:.2f}" for h, a in sc.items()) for r, sc in score.items()))
        assert wrong == 0 and min(score[3].values()) == 1.0 and score[2][3] == 0.0, f"{step.__name__} is not one round"
    return check


def statement_shares(a: torch.Tensor) -> torch.Tensor:
    """(..., N queries, 2N keys) joint attention, keys [Global 0..N-1 ; Local 0..N-1] -> (..., N, 2, S): each query's
    share on each statement (its 4 tokens summed), per half."""
    return a.unflatten(-1, (2, -1)).unflatten(-1, (-1, 4)).sum(-1)


def shares_check(model, task: ChainTask, n: int = 4):
    """A check of the reader's statement_shares(a) (raises AssertionError on a wrong one): on n check programs, every
    iteration and head of `model`, each right-hand side's share on the statements j = 0..2 back along its chain, per
    half, must equal the package probe's (probes.chain_lookups)."""
    model = copy.deepcopy(model).cpu()
    idx = task.batch(n, torch.Generator().manual_seed(CHECK_SEED))[0]
    with torch.no_grad():
        maps = attention_maps(model, idx)[:, 0]  # (K, B, H, N, 2N): decoder layer 0
    want = chain_lookups(model, task, idx)["stmt"][:, 0]  # (K, H, B, S, J, 2)
    back = chain_back(task, idx)  # (B, S, J)
    b, s = torch.arange(n)[:, None, None], torch.arange(back.size(1))[None, :, None]

    def check(f):
        got = f(maps)[..., 2::4, :, :].transpose(1, 2)  # (K, H, B, S queries, 2, S statements)
        got = got[:, :, b, s, :, back.clamp(min=0)] * (back >= 0)[..., None, None, None]  # (B, S, J, K, H, 2)
        gap = (got.permute(3, 4, 0, 1, 2, 5) - want).abs().max().item()
        print(f"{getattr(f, '__name__', 'yours')}: largest gap to the package's probe {gap:.1e}")
        assert gap < 1e-5, f"{gap:.2f} off the package's shares"
    return check


def no_chain_rule(runs) -> dict[int, float]:
    """{hops: accuracy} of notebook 00's no-chain rule (a variable gets the digit assigned most often so far in its
    program) on the runs' check programs: the draw that their curves and stored accuracies are measured on."""
    return frequency_rule(runs.task, n=runs.setting["eval_programs"], seed=CHECK_SEED)


def plot_program_attention(models: dict, task, seed: int = 3, shares=statement_shares) -> Figure:
    """One program (task.batch's draw from `seed`), one row per model {label: model}, one panel per decoder iteration:
    the share of each right-hand side's attention on every statement (its 4 tokens, both halves summed, mean over the
    heads of decoder layer 0). Markers: o the statement j = 1 hop back along the query's chain, x j = 2."""
    idx = task.batch(1, torch.Generator().manual_seed(seed))[0]
    text, back = task.decode(idx[0]), chain_back(task, idx)[0]  # back: (S, J)
    stmts = [text[i:i + 4] for i in range(0, len(text), 4)]
    n_iter = next(iter(models.values())).config.n_iter
    fig = Figure(figsize=(3.3 * n_iter + 0.8, 3.1 * len(models)))
    axes = fig.subplots(len(models), n_iter, squeeze=False)
    for row, (label, model) in zip(axes, models.items()):
        with torch.no_grad():
            a = attention_maps(copy.deepcopy(model).cpu(), idx)[:, 0, 0].mean(1)  # (K, N, 2N), mean over heads
        a = shares(a).sum(-2)[:, 2::4]  # (K, S queries, S statements), both halves summed
        for k, ax in enumerate(row):
            im = ax.imshow(a[k].numpy(), vmin=0, vmax=1, cmap="Greys")
            for j, mark in ((1, "o"), (2, "x")):  # red with a white edge: visible on black and on white cells
                s = (back[:, j] >= 0).nonzero().flatten()
                style = {"facecolors": "none", "edgecolors": "red"} if mark == "o" else {"c": "red"}
                ax.scatter(back[s, j], s, marker=mark, s=70, lw=2, **style,
                           path_effects=[patheffects.withStroke(linewidth=4, foreground="white")])
            ax.set(xticks=range(len(stmts)), yticks=range(len(stmts)), title=f"iteration {k + 1}")
            ax.set_xticklabels(stmts, family="monospace", fontsize=10, rotation=90)
            ax.set_yticklabels(stmts if k == 0 else [], family="monospace", fontsize=10)
            ax.title.set_fontsize(9)
        row[0].set_ylabel(f"{label}\nquery: right-hand side of")
    for ax in axes[-1]:
        ax.set_xlabel("key statement (4 tokens)")
    fig.colorbar(im, ax=axes, shrink=0.6, label="share of attention")
    fig.suptitle("One program: where each right-hand side looks, Global and Local halves summed, mean over heads "
                 "(o: j = 1 hop back, x: j = 2)", fontsize=11)
    return fig


def depth_at_test_time(grid, loops) -> dict:
    """Section 3's test-time depth, from the stored accuracies at test-time K = 1 .. trained K + 3 (3-hop, check
    programs), printed: gain = largest rise past the trained K per run (solved and failed); at_k1 / at_k2 = solved runs
    (trained K >= 2 / >= 3) run at K = 1 / 2; solved_k2 = for the latter, whether every hop count still clears the
    convergence bar at K = 2; drop = per model, largest fall of a solved run within 3 iterations past K."""
    by_k = chain.by_test_k(grid, loops)  # {(name, seed): 3-hop accuracy at test-time K = 1 .. trained K + 3}
    K = {key: grid.run(*key)["n_iter"] for key in by_k}
    ok = {key: grid.run(*key)["converged"] for key in by_k}
    gain = {key: by_k[key][K[key]:].max() - by_k[key][K[key] - 1] for key in by_k}
    drop = {n: max(by_k[key][K[key] - 1] - by_k[key][K[key]:].min() for key in by_k if key[0] == n and ok[key])
            for n in loops if grid.solved(n).any()}
    at_k1 = [by_k[key][0] for key in by_k if ok[key] and K[key] >= 2]
    at_k2 = [by_k[key][1] for key in by_k if ok[key] and K[key] >= 3]
    bar = grid.setting["converged"]  # a run at test-time K = 2 is still solved if every hop count clears the bar
    solved_k2 = [min(grid.run(*key)["acc_by_test_k"]["2"].values()) >= bar for key in by_k if ok[key] and K[key] >= 3]
    print(f"largest gain past the trained K: solved runs {max(g for key, g in gain.items() if ok[key]):+.3f}, failed runs "
          f"{max(g for key, g in gain.items() if not ok[key]):+.3f}; solved runs (trained K >= 2) run at K=1: "
          f"{min(at_k1):.2f}-{max(at_k1):.2f} on 3 hops")
    print("largest drop past the trained K, solved runs:", ", ".join(f"{chain.pretty(n)} {d:.3f}" for n, d in drop.items()))
    print(f"solved runs trained at K >= 3, run at K=2: {sum(solved_k2)} of {len(solved_k2)} still solved (every hop "
          f">= {bar}); 3-hop {min(at_k2):.2f}-{max(at_k2):.2f}")
    seed3 = {h: " ".join(f"{grid.acc('asymloop_k1', h, k)[3]:.2f}" for k in range(1, 5)) for h in (2, 3)}
    print(f"failed AsymLoop K=1, seed 3, at test-time K=1..4: 2-hop {seed3[2]}, 3-hop {seed3[3]}")
    return dict(gain=list(gain.values()), drop=drop, at_k1=at_k1, at_k2=at_k2, solved_k2=solved_k2)


@torch.no_grad()
def k1_without_global_is_dense(task: ChainTask, seeds=(0, 1, 2)) -> float:
    """This task's AsymLoop E = D = 1 at K = 1 without Global KV against Dense L = 2, each built from the same seed:
    the largest |logit difference| on 4 check programs (0 where they compute the same function)."""
    cfgs = ex.chain_models(task)
    idx = task.batch(4, torch.Generator().manual_seed(CHECK_SEED))[0]
    gap = 0.0
    for s in seeds:
        built = []
        for cfg in (cfgs["dense_l2"], replace(cfgs["asymloop_k3_no_global"], n_iter=1)):
            torch.manual_seed(s)
            built.append(LoopedLM(cfg).eval())
        gap = max(gap, (built[0](idx)[0] - built[1](idx)[0]).abs().max().item())
    return gap


def without_heads(model: LoopedLM, heads, at: int | set | None = None) -> LoopedLM:
    """A copy of `model` whose decoder attention heads `heads` are silent at iteration `at` (a set: at each of those
    iterations; None: every iteration):
    a forward pre-hook on each decoder layer's output projection `wo` zeroes those heads' slice of its input, which is
    the same as zeroing their columns of `wo.weight`. `at` counts calls, so every forward must run the trained K.
    The model itself is not changed."""
    hd = model.config.d_model // model.config.n_head
    return _zeroed_before_wo(model, [slice(h * hd, (h + 1) * hd) for h in heads], at)


def _zeroed_before_wo(model: LoopedLM, cols, at: int | set | None = None) -> LoopedLM:
    """A copy of `model` in which a forward pre-hook zeroes the columns `cols` (a list of slices) of each decoder
    layer's `wo` input, at iteration `at` (as without_heads)."""
    m2, n_iter = copy.deepcopy(model), model.config.n_iter
    ats = None if at is None else {at} if isinstance(at, int) else set(at)
    for blk in m2.decoder:
        calls = [0]

        def silence(module, args, calls=calls):  # runs before wo, once per decoder iteration
            calls[0] += 1
            if ats is None or (calls[0] - 1) % n_iter + 1 in ats:
                y = args[0].clone()
                for c in cols:
                    y[..., c] = 0
                return (y,)

        blk.attn.wo.register_forward_pre_hook(silence)
    return m2


def silence_check(model: LoopedLM, task: ChainTask, n: int = 4):
    """A check of the reader's silence(model, heads) (raises AssertionError on a wrong one): on n check programs, for
    heads [0], [1, 2] and [3], the copy's logits equal without_heads(model, heads)'s at every iteration, and `model`
    itself is left unchanged."""
    idx = task.batch(n, torch.Generator().manual_seed(CHECK_SEED))[0]

    def check(f):
        with torch.no_grad():
            plain = model(idx)[0]
            gap = max((f(model, hs)(idx)[0] - without_heads(model, hs)(idx)[0]).abs().max().item()
                      for hs in ([0], [1, 2], [3]))
            changed = (model(idx)[0] - plain).abs().max().item()
        print(f"{getattr(f, '__name__', 'yours')}: largest logit gap to the package's without_heads {gap:.1e}")
        assert changed == 0, "the model itself changed: silence a copy (copy.deepcopy) and hook that"
        assert gap < 1e-5, f"logits {gap:.2f} off the package's: not the heads' slices of wo's input"
    return check


def silence_strided(model: LoopedLM, heads) -> LoopedLM:
    """Notebook 03's wrong version of silence(model, heads): it takes head h as every n_head-th column of wo's input
    (y[..., h::n_head]), not as the block of columns h * hd to (h + 1) * hd that the attention writes."""
    return _zeroed_before_wo(model, [slice(h, None, model.config.n_head) for h in heads])
