"""Figures and tables of notebook 00 (the tour): the three architectures side by side, the paper's Table 9 and
Table 10 reproduced from the package's own counts, and the live and precomputed results of the depth demo
(experiments.depth_demo: AsymLoop K = 1 against K = 3 on binding chains)."""

import inspect
from collections import Counter

import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from minimal_asymloop.course.draw import COLORS, NotebookFigure
from minimal_asymloop.flops import count_params, flops_per_token
from minimal_asymloop.model import Block, LoopedLM, ModelConfig

CHANCE = 0.25  # one of the chain task's 4 values, guessed
CONVERGED = 0.99  # a run has converged when every hop count is at least this accurate (experiments.chain)
CHECK_SEED = 1234  # generator seed of the 256 check programs of the early stop (tasks.accuracy_by_hops' default)

# The paper's Table 9 (Appendix D.1): forward GFLOPs per input position at N = 1024, V = 32128, Full Loop K = 2 and
# AsymLoop K = 3; then the additional cost of AsymLoop in % of Full Loop: Global KV projections, global attention, total
TABLE9 = {"60m": (0.256967, 0.292356, 2.75, 11.02, 13.77), "135m": (0.464585, 0.535364, 3.05, 12.19, 15.23),
          "350m": (1.476657, 1.677984, 3.41, 10.23, 13.63), "1b": (5.365891, 5.869208, 3.75, 5.63, 9.38)}
# The paper's Table 10: parameters (millions) of Full Loop K = 2 and AsymLoop K = 3, FFN 2048 (the two sizes it lists)
TABLE10_PARAMS = {"60m": (91.83, 95.37), "135m": (134.30, 141.38)}


def table9(seq_len: int = 1024) -> list[dict]:
    """One row per size: the package's forward FLOPs per token beside Table 9's, and the Global KV overhead
    (relative to Full Loop K = 2) and share (of AsymLoop K = 3's own total)."""
    rows = []
    for size, paper in TABLE9.items():
        full, asym = (flops_per_token(ModelConfig.from_preset(size, arch), seq_len) for arch in ("full_loop", "asymloop"))
        rows.append(dict(size=size, full=full["total"] / 1e9, asym=asym["total"] / 1e9,
                         proj=100 * asym["global_kv_proj"] / full["total"], attn=100 * asym["global_attn"] / full["total"],
                         overhead=100 * (asym["total"] / full["total"] - 1),
                         share=100 * (asym["global_kv_proj"] + asym["global_attn"]) / asym["total"], paper=paper))
    return rows


def table9_markdown(rows: list[dict]) -> str:
    """Table 9 as the paper prints it, each of our values with the paper's in brackets, and the share column added."""
    out = ["| size | Full Loop K=2 GFLOPs | AsymLoop K=3 GFLOPs | Global KV proj. % | global attn. % | overhead % "
           "(of Full Loop) | share % (of AsymLoop) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["paper"]
        out.append(f"| {r['size']} | {r['full']:.6f} ({p[0]:.6f}) | {r['asym']:.6f} ({p[1]:.6f}) | {r['proj']:.2f} ({p[2]:.2f}) "
                   f"| {r['attn']:.2f} ({p[3]:.2f}) | {r['overhead']:.2f} ({p[4]:.2f}) | {r['share']:.2f} (not in the paper) |")
    return "\n".join(out)


def table10_markdown() -> str:
    """Parameters of Full Loop K = 2 and AsymLoop K = 3 (every parameter counted), beside Table 10's."""
    out = ["| size | Full Loop K=2 | AsymLoop K=3 | Global KV adds |", "|---|---|---|---|"]
    for size, (full_p, asym_p) in TABLE10_PARAMS.items():
        full, asym = (count_params(ModelConfig.from_preset(size, arch)) for arch in ("full_loop", "asymloop"))
        out.append(f"| {size} | {full / 1e6:.2f}M ({full_p:.2f}M) | {asym / 1e6:.2f}M ({asym_p:.2f}M) | "
                   f"{(asym - full) / 1e6:.2f}M = {asym / full - 1:.1%} |")
    return "\n".join(out)


def _stack(ax, x, names, colors, title, loop=None, global_kv=None):
    """Boxes bottom to top; loop=(first, last, label) draws the weight-tied return arrow; global_kv=(src, dsts)."""
    w, hgt = 1.6, 0.55
    ys = [0.9 + i * 0.75 for i in range(len(names))]
    for y, name, c in zip(ys, names, colors):
        ax.add_patch(Rectangle((x - w / 2, y), w, hgt, facecolor=c, alpha=0.55, edgecolor="k"))
        ax.text(x, y + hgt / 2, name, ha="center", va="center", fontsize=11)
    ax.text(x, 0.35, "embed(x)", ha="center", fontsize=11)
    ax.text(x, ys[-1] + hgt + 0.35, "norm → head", ha="center", fontsize=11)
    for y0, y1 in zip([0.55] + [y + hgt for y in ys], ys + [ys[-1] + hgt + 0.3]):
        ax.annotate("", (x, y1), (x, y0), arrowprops=dict(arrowstyle="->", lw=1))
    if loop:
        a, b, label = loop
        ax.add_patch(FancyArrowPatch((x + w / 2, ys[b] + hgt / 2), (x + w / 2, ys[a] + hgt / 2),
                                     connectionstyle="arc3,rad=-0.6", arrowstyle="->", mutation_scale=15, lw=2, color=COLORS["loop"]))
        ax.text(x + w / 2 + 0.45 + 0.15 * (b - a + 1), (ys[a] + ys[b] + hgt) / 2, label, color=COLORS["loop"], fontsize=12,
                va="center")  # outside the arc, which bulges more the more blocks it spans
    if global_kv:
        src, dsts = global_kv
        gkv = COLORS["global_kv"]
        for d in dsts:
            ax.add_patch(FancyArrowPatch((x - w / 2, ys[src] + hgt), (x - w / 2, ys[d] + hgt / 2),
                                         connectionstyle="arc3,rad=0.5", arrowstyle="->", mutation_scale=12, lw=1.5, color=gkv))
        ax.text(x - w / 2 - 0.85, (ys[src] + ys[dsts[-1]]) / 2 + 0.3, "Global KV\n(once)", color=gkv, fontsize=11, ha="center")
    ax.text(x, -0.25, title, ha="center", fontsize=12, weight="bold")


def architectures_figure() -> NotebookFigure:
    """Dense, Full Loop and AsymLoop on the 60M layout's six physical blocks (E = D = 3), with their effective depths."""
    fig = NotebookFigure(figsize=(10, 6.5))
    ax = fig.subplots()
    grey, enc, dec = "0.8", COLORS["encoder"], COLORS["loop"]  # the colours of course.draw's figure
    blocks = [f"block {i}" for i in range(1, 7)]
    _stack(ax, 1.5, blocks, [grey] * 6, "Dense (L=6)\neffective depth 6")
    _stack(ax, 5.0, blocks, [grey] * 6, "Full Loop (L=6, K=2)\neffective depth K·L = 12", loop=(0, 5, "× K"))
    _stack(ax, 9.3, [f"enc {i}" for i in (1, 2, 3)] + [f"dec {i}" for i in (1, 2, 3)], [enc] * 3 + [dec] * 3,
           "AsymLoop (E=3, D=3, K=3)\neffective depth E + K·D = 12", loop=(3, 5, "× K"), global_kv=(2, [3, 4, 5]))
    ax.set_xlim(-0.5, 11.5)
    ax.set_ylim(-0.8, 6.4)
    ax.axis("off")
    ax.set_title("Six physical blocks (the 60M layout), three ways to run them\n"
                 "(arrows: data flow; green: weight-tied loop; orange: Global KV, computed once)")
    return fig


def forward_excerpt() -> str:
    """The AsymLoop path of LoopedLM.states, then LoopedLM.logits, printed from the package's source; the lines of the
    additive-injection ablation (its `z = z + h`) are left out, every other line is as it runs."""
    src = inspect.getsource(LoopedLM.states)
    lines = src[src.index("        for i, blk in enumerate(self.encoder)"):].splitlines()
    keep = [ln for i, ln in enumerate(lines) if '"additive":' not in ln and '"additive":' not in lines[i - 1]]
    return "\n".join(keep) + "\n\n" + inspect.getsource(LoopedLM.logits)


def executed_blocks(cfg: ModelConfig, n_iter: int | None = None) -> dict:
    """Count, with forward hooks, the transformer blocks and the Global KV projections (wk_glob) that one forward
    pass of a model built from cfg executes."""
    model, calls = LoopedLM(cfg).eval(), {"blocks": 0, "global_kv": 0}
    for name, m in model.named_modules():
        key = "blocks" if isinstance(m, Block) else "global_kv" if name.endswith("wk_glob") else None
        if key:
            m.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    model(torch.zeros(1, 4, dtype=torch.long), n_iter=n_iter)
    return calls


def my_states(m, idx, K, recompute=False):
    """Notebook 00's build step, the reference: AsymLoop's decoder states z_1..z_K from the package's modules (encoder
    once, Global KV once from H, the decoder K times), equal bit for bit to LoopedLM.states. recompute=True is the
    deliberate mistake the notebook shows failing: from k = 2 on, Global KV is taken from the state z_{k-1}."""
    h = m.embed(idx)
    for blk in m.encoder:  # H = Enc(embed(x)): once
        h = blk(h, m.rope)
    kv = [blk.attn.global_kv(m.enc_norm(h), m.rope) for blk in m.decoder]  # Global KV: once, per decoder layer
    z, out = h, []  # z_0 = H
    for _ in range(K):  # the decoder, K times, the same weights
        if recompute and out:  # WRONG on purpose: Global KV from z_{k-1}
            kv = [blk.attn.global_kv(m.enc_norm(z), m.rope) for blk in m.decoder]
        for blk, kv_l in zip(m.decoder, kv):
            z = blk(z, m.rope, kv_l)  # queries and Local KV from z; Global KV fixed
        out.append(z)
    return out


def frequency_rule(task, n: int = 1024, seed: int = 4321) -> dict[int, float]:
    """{hops: accuracy} of a rule that follows no chain: a statement `x=y` gets the value that literal statements
    (`v=3`) assigned most often so far in its program (ties: the earliest), `x=3` gets 3; on n programs from the generator seed."""
    g, right = torch.Generator().manual_seed(seed), {}
    for _ in range(n):
        text, values, hops = task.program(g)
        seen = Counter()
        for stmt, value, h in zip(filter(None, text.split(";")), values, hops):
            rhs = stmt.split("=")[1]
            if rhs.isdigit():  # a literal: 1 hop, its own value
                guess, seen[rhs] = rhs, seen[rhs] + 1
            else:
                guess = seen.most_common(1)[0][0]  # a chain's first statement is a literal, so `seen` is not empty
            right.setdefault(h, []).append(guess == value)
    return {h: sum(r) / len(r) for h, r in sorted(right.items())}


def live_figure(runs: dict, rule: dict | None = None) -> NotebookFigure:
    """Accuracy by hop count during training, one panel per hop count, one line per K (the live demo; a run's init_iter,
    if not its K, is named in its label); rule: the {hops: accuracy} of frequency_rule, drawn as a dashed line."""
    hops = sorted(int(h) for h in next(iter(runs.values()))["curve"][0][1])
    fig = NotebookFigure(figsize=(11, 3.6))
    axes = fig.subplots(1, len(hops), sharey=True)
    for ax, h in zip(axes, hops):
        for k, run in sorted(runs.items()):  # K = 1 drawn wide beneath, so it shows where the two lines coincide
            ax.plot([s for s, _ in run["curve"]], [a[str(h)] for _, a in run["curve"]], "o-", ms=3 if k > 1 else 7,
                    lw=1.5 if k > 1 else 4, alpha=1 if k > 1 else 0.5, color=K_COLORS[k], label=f"K = {k} (effective depth {1 + k})"
                    + (f", K = {run['init_iter']}'s init" if run.get("init_iter", k) != k else ""))
        ax.axhline(CONVERGED, color="0.5", ls=":", lw=1, label=f"converged: every hop count ≥ {CONVERGED}")
        if rule:
            ax.axhline(rule[h], color="0.3", ls="--", lw=1, label=RULE_LABEL)
        ax.axhline(CHANCE, color="0.6", ls="-.", lw=1, label=f"chance: {CHANCE} (one of 4 values)")
        ax.set_title(f"{h}-hop statements")
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 1.03)
    axes[0].set_ylabel("accuracy (check programs)")
    axes[0].legend(loc="center right", fontsize=8, framealpha=1)  # between the 1-hop line and the chance line
    fig.suptitle("Live: the same model trained at K = 1 and at K = 3 (one seed)")
    fig.tight_layout()
    return fig


K_COLORS = {1: "C0", 2: "C2", 3: "C1"}
SAME_INIT_COLOR = "C9"  # K = 1 trained from K = 3's initial weights
RULE_LABEL = "no-chain rule: a literal answers itself,\nx=y the most frequent literal so far"


def demo_steps(result: dict) -> dict[int, list]:
    """{K: [steps to converge (None: not within the budget), one per seed, in seed order]} of a depth_demo result."""
    out = {}
    for run in sorted(result["runs"], key=lambda r: (r["n_iter"], r["seed"])):
        out.setdefault(run["n_iter"], []).append(run["converged_at"])
    return out


def final_accuracy(result: dict, hops: int) -> dict[int, list[float]]:
    """{K: [accuracy at `hops` at the run's last check, one per seed, in seed order]} of a depth_demo result: on the 256
    held-out programs the early stop checks, the programs chain_task's final scores use too."""
    out = {}
    for run in sorted(result["runs"], key=lambda r: (r["n_iter"], r["seed"])):
        out.setdefault(run["n_iter"], []).append(run["curve"][-1][1][str(hops)])
    return out


def same_run(live: dict, result: dict, tol: float = 0.01) -> bool:
    """Whether a live demo_train run retraces the stored depth_demo run of its K and seed: the same accuracy (within
    tol) at every check the live run made, and the same convergence step if it converged."""
    stored = next((r for r in result["runs"] if (r["n_iter"], r["seed"]) == (live["n_iter"], live["seed"])), None)
    if stored is None:
        return False
    at = {s: a for s, a in stored["curve"]}
    same_curve = all(s in at and all(abs(a[h] - at[s][h]) <= tol for h in a) for s, a in live["curve"])
    return same_curve and (live["converged_at"] is None or live["converged_at"] == stored["converged_at"])


def trained_weights(check_every: int | None, steps: int = 20, seed: int = 1, n_iter: int = 3) -> dict:
    """The depth demo model's weights after `steps` optimizer steps of demo_train's recipe, with its held-out check
    every `check_every` steps (None: no check), so that runs checked at different intervals can be compared bit for bit."""
    from minimal_asymloop.experiments.chain import CHAIN_BATCH, CHAIN_EVAL, CHAIN_LR, CHAIN_STEPS, CHAIN_TASK
    from minimal_asymloop.experiments.depth_demo import demo_model
    from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, train_on_task

    task, model = ChainTask(**CHAIN_TASK), demo_model(n_iter, seed)

    def check(step, m):  # what demo_train's check does, then stop at `steps`
        accuracy_by_hops(m, task, n=CHAIN_EVAL)
        return step >= steps

    train_on_task(model, task, steps=CHAIN_STEPS, batch_size=CHAIN_BATCH, lr=CHAIN_LR, seed=seed,
                  check_every=check_every or steps, check=check if check_every else lambda *_: True)
    return model.state_dict()


def chain_seeds(result: dict, names=("asymloop_k1", "asymloop_k3", "full_loop_k2"), hops: int = 3) -> dict[str, list]:
    """{arm: [(final `hops` accuracy, steps, converged) per seed, in seed order]} of chain_task.json's arms."""
    out = {n: [] for n in names}
    for r in sorted(result["runs"], key=lambda r: r["seed"]):
        if r["name"] in out:
            out[r["name"]].append((r["acc_by_test_k"][str(r["n_iter"])][str(hops)], r["steps"], r["converged"]))
    return out


def seeds_summary(demo: dict, arms: dict) -> str:
    """One line per arm: each seed's 3-hop accuracy at the run's end (on the check programs), then the converged
    seeds. demo: a depth_demo result; arms: {label: chain_seeds-style runs}."""
    rows = {f"depth_demo K={k}": list(zip(final_accuracy(demo, 3)[k], s, [x is not None for x in s]))
            for k, s in demo_steps(demo).items()}
    if demo.get("same_init"):  # K = 1 from K = 3's initial weights
        same = dict(runs=demo["same_init"])
        rows["depth_demo K=1, K=3's init"] = list(zip(final_accuracy(same, 3)[1], demo_steps(same)[1],
                                                      [x is not None for x in demo_steps(same)[1]]))
    lines = []
    for label, runs in {**rows, **arms}.items():
        won = [f"{i} ({s:,})" for i, (_, s, c) in enumerate(runs) if c]
        lines.append(f"{label:<27} 3 hops at the end " + " ".join(f"{a:.2f}" for a, _, _ in runs)
                     + f" | converged {len(won)}/{len(runs)}" + (f": seed (step) {', '.join(won)}" if won else ""))
    return "\n".join(lines)


def _dots(ax, x, accs, steps, color):
    """One dot per seed at x, in seed order left to right (filled: converged; seeds_summary prints the steps)."""
    for j, (a, s) in enumerate(zip(accs, steps)):
        xj = x + 0.11 * (j - (len(accs) - 1) / 2)
        ax.scatter([xj], [a], s=40, zorder=2, color=color if s else "white", edgecolor=color, lw=1.5)


def seeds_figure(demo: dict, chain: dict, rule: dict | None = None) -> NotebookFigure:
    """Left: depth_demo's 5 seeds at K = 1, K = 1 from K = 3's initial weights (if stored) and K = 3 (at most the
    demo's budget). Right: runs of up to 6,000 steps,
    one column per arm of chain: chain_seeds' dict (arms dense_l2, dense_l4, asymloop_k1, asymloop_k3, full_loop_k2).
    Both panels:
    3-hop accuracy at the run's end on the 256 held-out programs of the early stop."""
    fig = NotebookFigure(figsize=(13, 4.8))
    n_left = 2 + bool(demo.get("same_init"))
    left, right = fig.subplots(1, 2, sharey=True, gridspec_kw=dict(width_ratios=[n_left, 2 + len(chain)]))
    acc, steps = final_accuracy(demo, 3), demo_steps(demo)
    own = "\n(own init)" if demo.get("same_init") else ""
    cols = [(f"AsymLoop\nK = {k}{own if k == 1 else ''}\n(depth {1 + k})", acc[k], steps[k], K_COLORS[k]) for k in sorted(acc)]
    if demo.get("same_init"):  # K = 1 from K = 3's initial weights first, beside K = 3: only K differs; own init last
        same = dict(runs=demo["same_init"])
        cols = [("K = 1,\nK = 3's init\n(depth 2)", final_accuracy(same, 3)[1], demo_steps(same)[1], SAME_INIT_COLOR),
                cols[1], cols[0]]
    for i, (_, a, st, color) in enumerate(cols):
        _dots(left, i, a, st, color)
    init = [r["curve"][0][1]["3"] for r in demo["runs"]]  # the untrained models (step 0)
    for ax in (left, right):
        ax.axhline(sum(init) / len(init), color="0.4", ls=":", lw=1, label="untrained (depth_demo's mean)")
        if rule:
            ax.axhline(rule[3], color="0.3", ls="--", lw=1, label=RULE_LABEL)
    left.set_xticks(range(len(cols)), [c[0] for c in cols])  # 3 lines: no overlap
    left.set_title(f"at most {demo['setting']['steps']:,} steps (depth_demo)")
    left.set_ylabel("3-hop accuracy at the run's end\n(check programs)")
    left.legend(loc="lower left", fontsize=8, framealpha=1, title="both panels", title_fontsize=8)
    labels = {"dense_l2": ("Dense L = 2\n(depth 2)", "0.3"), "dense_l4": ("Dense L = 4\n(depth 4)", "0.3"),
              "asymloop_k1": ("AsymLoop K = 1\n(depth 2)", K_COLORS[1]), "asymloop_k3": ("AsymLoop K = 3\n(depth 4)", K_COLORS[3]),
              "full_loop_k2": ("Full Loop\nL = 2, K = 2\n(depth 4)", "C4")}
    for i, (name, runs) in enumerate(chain.items()):
        _dots(right, i, [a for a, _, _ in runs], [s if c else None for _, s, c in runs], labels[name][1])
    right.set_xticks(range(len(chain)), [labels[n][0] for n in chain])
    right.set_title("at most 6,000 steps (chain_task)")
    for ax in (left, right):
        ax.set_xlim(-0.5, ax.get_xticks()[-1] + 0.5)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("model (effective depth)")
    n3, n1 = (sum(s is not None for s in steps[k]) for k in (3, 1))
    won = {n: f"{sum(c for _, _, c in chain[n])}/{len(chain[n])}" for n in ("asymloop_k3", "asymloop_k1") if n in chain}
    line = f"Converged seeds, AsymLoop K = 3: {n3}/{len(steps[3])} within {demo['setting']['steps']:,} steps (left)"
    if {"asymloop_k3", "asymloop_k1"} <= set(won):
        line += f", {won['asymloop_k3']} within 6,000 (chain_task)"
        line += f". K = 1: {n1}/{len(steps[1])} and {won['asymloop_k1']}, the same budgets"
    else:
        line += f". K = 1: {n1}/{len(steps[1])}"
    if demo.get("same_init"):
        line += f"; from K = 3's init, {sum(r['converged_at'] is not None for r in demo['same_init'])}/{len(demo['same_init'])}"
    fig.suptitle(f"{line}\n(one dot per seed, 0-4 left to right; filled: converged, every hop count ≥ {CONVERGED}; steps printed below)",
                 fontsize=11)
    fig.tight_layout()
    return fig


def trained_chain_model(seed: int):
    """The AsymLoop (E = D = 1) trained at K = 3 on binding chains to convergence by the chain_context experiment (the
    runs notebook 03 probes), from its committed weights (notebooks/results/chain_weights/asymloop_k3-s<seed>.safetensors;
    seeds 0, 1 and 3)."""
    from safetensors.torch import load_file

    from minimal_asymloop.experiments.chain import CHAIN_TASK, chain_models
    from minimal_asymloop.model import LoopedLM
    from minimal_asymloop.paths import RESULTS
    from minimal_asymloop.tasks import ChainTask

    path = RESULTS / "chain_weights" / f"asymloop_k3-s{seed}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; committed seeds: 0, 1, 3 (python -m minimal_asymloop.experiments chain_context)")
    model = LoopedLM(chain_models(ChainTask(**CHAIN_TASK))["asymloop_k3"])
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def test_time_figure(acc: dict, rule: dict | None = None, ylim: tuple = (0, 1.03),
                     title: str = "The same trained weights: 3 hops need the iterations") -> NotebookFigure:
    """3-hop accuracy (and, in grey, 2-hop) of trained K = 3 models run with k iterations: acc = {seed: {k: {hops:
    accuracy}}}; chance and the no-chain rule's 3-hop accuracy (frequency_rule) as reference lines, drawn only where
    they fall inside ylim; ylim zooms. The legend sits outside the axes, clear of the curves and the "trained K" mark."""
    fig = NotebookFigure(figsize=(8.5, 4))
    ax = fig.subplots()
    for j, (seed, by_k) in enumerate(sorted(acc.items())):
        ks = sorted(by_k)
        ax.plot(ks, [by_k[k][3] for k in ks], "o-", color=f"C{j}", label=f"seed {seed}: 3 hops")
    for j, by_k in enumerate(acc.values()):  # after the 3-hop lines, so the legend lists the seeds first
        ax.plot(ks, [by_k[k][2] for k in ks], "s:", color="0.6", ms=3, lw=1, label="2 hops (each seed)" if j == 0 else None)
    refs = [(CHANCE, "-.", "0.6", f"chance: {CHANCE}")]
    if rule:
        refs.append((rule[3], "--", "0.3", f"no-chain rule, 3 hops: {rule[3]:.2f}"))
    for y, ls, color, label in refs:
        if ylim[0] <= y <= ylim[1]:  # a line outside the zoomed axis gets no legend entry
            ax.axhline(y, color=color, ls=ls, lw=1, label=label)
    ax.axvline(3, color="0.5", ls=":", lw=1)
    ax.text(3.05, 0.03, "trained K", color="0.4", transform=ax.get_xaxis_transform())  # low: the curves are high at k = 3
    ax.set_xticks(ks)
    ax.set_xlabel("iterations k at test time (effective depth 1 + k)")
    ax.set_ylabel("accuracy on fresh programs")
    ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside the axes
    fig.tight_layout()
    return fig
