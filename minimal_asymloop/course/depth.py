"""Figures and tables of notebook 02 (what iterating the decoder does on language): the runs of
notebooks/results/matched_depth.json and global_kv.json beside the paper's tables, each number named with its
table, row and recipe. Every figure is a bare matplotlib Figure (the caller's backend is kept)."""

import json
import math
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from minimal_asymloop import experiments as ex
from minimal_asymloop.course.build import passes  # noqa: F401 (notebook 02 shows wrong versions failing with it)
from minimal_asymloop.course.depth_build import block, dec, global_kv, lens_losses, unroll, unroll_kv_from_state, within  # noqa: F401 (the builds' references, a wrong wiring)
from minimal_asymloop.course.depth_draw import CONTEXT_VARIANTS, context_figure  # noqa: F401 (section 3's drawing)
from minimal_asymloop.flops import count_params
from minimal_asymloop.model import ModelConfig
from minimal_asymloop.paths import RESULTS
from minimal_asymloop.probes import logit_lens
from minimal_asymloop.sources import source_identity

# The paper (Liang et al., 2026), 60M models, 1.68B tokens. Validation perplexity unless said otherwise.
# Table 3 (matched depth): the table names no learning-rate recipe. Section 3.3: "We use the layerwise learning-rate
# method of He et al. (2026) to train AsymLoop" (ALRS), yet its numbers match no uniform-LR or ALRS row of Tables 4a/8.
TABLE3 = {"dense": 23.72, "asymloop_k1": 21.79, "full_loop_k2": 23.03, "asymloop_k3": 21.45, "full_loop_k3": 22.77,
          "asymloop_k5": 21.30}
# Table 7 (context access, K=3; Full Loop K=2): QKNorm and uniform LR in every model.
TABLE7 = {"asymloop_k3": 24.727, "asymloop_k3_no_global": 25.566, "asymloop_k3_additive": 25.116, "full_loop_k2": 25.053}
# Table 4 (a), uniform-LR rows at K=3 and K=5: AsymLoop, "w/o Global KV" and "w/o Local KV".
TABLE4A = {3: {"asymloop": 24.727, "no_global": 25.566, "no_local": 25.656},
           5: {"asymloop": 24.619, "no_global": 25.751, "no_local": 25.465}}
# Table 8 ("under a common evaluation protocol"), uniform LR, CE: its AsymLoop rows are "w/o QKNorm" (Table 4a's
# 24.984 at K=3); whether its Full Loop rows use QKNorm it does not say (K=2: 25.571 here, 25.053 in Table 7).
TABLE8_CE = {"asymloop_k3": 3.218239, "asymloop_k5": 3.205305, "full_loop_k2": 3.241455, "full_loop_k3": 3.229346}
# Table 6: G(K) = validation CE without Global KV minus with it (nats/token), QKNorm and uniform LR.
TABLE6 = {1: 0.021611, 3: 0.033343, 5: 0.044968}
PAIRS = [("dense", "asymloop_k1"), ("full_loop_k2", "asymloop_k3"), ("full_loop_k3", "asymloop_k5")]


def paper_tokens_per_param() -> float:
    """The paper's 60M AsymLoop: 1.68B tokens over every parameter (embedding and untied head included)."""
    return 1.68e9 / count_params(ModelConfig.from_preset("60m", arch="asymloop"))


class LMRuns:
    """The language-model runs of matched_depth and global_kv, by (name, seed)."""

    def __init__(self):
        self.md = json.loads((RESULTS / "matched_depth.json").read_text())
        self.gk = json.loads((RESULTS / "global_kv.json").read_text())
        self.setting, self.seeds = self.md["setting"], self.md["setting"]["seeds"]
        self.runs = {(r["name"], r["seed"]): r for r in self.md["runs"] + self.gk["runs"]}
        # tokens per AsymLoop parameter (every one, embedding and head included): the basis of the paper's 17.6
        self.tpp = self.setting["budget"]["tokens"] / self.runs[("asymloop_k3", self.seeds[0])]["params"]

    def have(self, name):
        return all((name, s) in self.runs for s in self.seeds)

    def loss(self, name) -> np.ndarray:
        """Final validation loss (nats/token), one value per seed."""
        return np.array([self.runs[(name, s)]["val_loss"] for s in self.seeds])

    def lens(self, name) -> np.ndarray:
        """(seeds, k = 1..8): loss when the head reads z_k."""
        return np.array([self.runs[(name, s)]["lens_loss"] for s in self.seeds])

    def n_iter(self, name):
        return self.runs[(name, self.seeds[0])]["n_iter"]

    def warmup(self) -> int:
        """Steps of linear learning-rate warm-up in the stored runs' schedule (optim.py's rule)."""
        return max(1, round(ex.train_config(self.setting["steps"], 0, ".").warmup_frac * self.setting["steps"]))

    def describe(self):
        s = self.setting
        tc = ex.train_config(s["steps"], 0, ".")
        print(f"our runs: L={s['model']['n_layer']} blocks of width {s['model']['d_model']} (AsymLoop E=D=2), "
              f"QKNorm in every model, uniform LR {s['train']['lr']}, {s['steps']} steps x {s['train']['global_batch']} x "
              f"{s['train']['seq_len']} tokens = {self.tpp:.1f} tokens per AsymLoop parameter "
              f"(the paper's 60M: {paper_tokens_per_param():.1f}); seeds {self.seeds}")
        print(f"  schedule: linear warm-up over steps 1-{self.warmup()}, then cosine from the peak {s['train']['lr']} "
              f"down to {tc.min_lr_ratio:g} x peak at step {s['steps']}")
        seen = set()
        for r in (self.md, self.gk):
            new = [x for x in r["runs"] if (x["name"], x["seed"]) not in seen]
            seen |= {(x["name"], x["seed"]) for x in r["runs"]}
            reused = f", {len(r['runs']) - len(new)} of them reused from the line above" if len(new) < len(r["runs"]) else ""
            print(f"  {r['command']}: {len(r['runs'])} runs{reused}; {len(new)} trained "
                  f"({sum(x['seconds'] for x in new) / 60:.0f} min on one thread of a shared 2-core CPU)")


def ms(x, f="+.3f"):
    return f"{np.mean(x):{f}} ± {np.std(x, ddof=1):.3f}"


def paper_matched(base: str, asym: str) -> dict:
    """The paper's AsymLoop minus baseline (ln PPL ratio = ΔCE) for one pair, by source; None where it has no run."""
    t7 = math.log(TABLE7[asym] / TABLE7[base]) if base in TABLE7 and asym in TABLE7 else None
    t6 = -TABLE6[1] if (base, asym) == ("dense", "asymloop_k1") else None  # Table 6, K=1: w/o Global KV is Dense
    t8 = TABLE8_CE[asym] - TABLE8_CE[base] if base in TABLE8_CE and asym in TABLE8_CE else None
    return {"Table 3": math.log(TABLE3[asym] / TABLE3[base]), "Table 6": t6, "Table 7": t7, "Table 8": t8}


def matched_depth(runs: LMRuns) -> dict:
    """Print AsymLoop minus its matched-depth baseline, within seed, beside the paper's differences within one table;
    return {(baseline, asymloop): per-seed differences}."""
    diffs = {(b, a): within(runs, a, b) for b, a in PAIRS if runs.have(a) and runs.have(b)}
    print("ΔCE = AsymLoop minus its matched-depth baseline (nats/token; below 0: AsymLoop better).\n"
          "The paper's columns, each difference within one table (60M: Tables 6-8 do not say it; their AsymLoop\n"
          "  rows equal Table 4a's 60M values; 17.6 tokens/param: Section 4.1's 1.68B tokens over Table 5's 95.4M):\n"
          "  Table 3: effect of recurrent depth; learning-rate recipe not stated\n"
          "  Table 6: Global KV and recurrent depth; uniform LR, QKNorm (our inference, not the paper's words: K = 1\n"
          "    w/o Global KV has Dense's architecture, as ours is, checked; a run other than Table 8's Dense,\n"
          "    CE 3.260346 against 3.271820)\n"
          "  Table 7: context-access variants; uniform LR, QKNorm\n"
          "  Table 8: additional validation results; uniform LR, AsymLoop w/o QKNorm")
    print(f"{'pair (our depth)':>32} | {'Table 3':>7} | {'Table 6':>7} | {'Table 7':>7} | {'Table 8':>7} | "
          f"{'ours: uniform, ' + format(runs.tpp, '.1f') + ' tok/param':>26} | per seed")
    for base, asym in PAIRS:
        depth = runs.runs[(asym, runs.seeds[0])]["effective_depth"] if runs.have(asym) else "?"
        p = {k: ("no run" if v is None else f"{v:+.3f}") for k, v in paper_matched(base, asym).items()}
        d = diffs.get((base, asym))
        ours = ms(d) if d is not None else "not run"
        per = " ".join(f"{x:+.3f}" for x in d) if d is not None else ""
        print(f"{asym + ' - ' + base + f' ({depth})':>32} | {p['Table 3']:>7} | {p['Table 6']:>7} | "
              f"{p['Table 7']:>7} | {p['Table 8']:>7} | {ours:>26} | {per}")
    return diffs


def plot_matched(runs: LMRuns, diffs: dict) -> Figure:
    """Left: validation loss against effective depth. Right: AsymLoop minus its baseline, one dot per seed, beside
    the paper's uniform-LR differences (Tables 6, 7, 8) and Table 3 (recipe not stated), each within one table."""
    fig = Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2)
    ax = axes[0]
    for arch, (color, marker) in {"dense": ("k", "s"), "full_loop": ("tab:orange", "^"), "asymloop": ("tab:blue", "o")}.items():
        names = [n for b, a in PAIRS for n in (b, a) if runs.have(n) and runs.runs[(n, runs.seeds[0])]["arch"] == arch]
        depth = [runs.runs[(n, runs.seeds[0])]["effective_depth"] for n in names]
        y = np.array([runs.loss(n) for n in names])
        ax.errorbar(depth, y.mean(1), yerr=y.std(1, ddof=1), color=color, marker=marker, capsize=4, label=arch)
    deep = min(runs.loss(n).mean() for b, a in PAIRS[1:] for n in (b, a) if runs.have(n))
    shallow = max(runs.loss(n).mean() for n in PAIRS[0] if runs.have(n))
    ax.set(xlabel="effective depth (blocks per token)", ylabel="validation loss (nats/token)",
           title=f"At {runs.tpp:.1f} tokens/param, depth 8 and 12 {'are all' if deep > shallow else 'are not all'} "
                 f"behind depth 4\n(on the mean; mean ± std over {len(runs.seeds)} seeds)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    ax = axes[1]
    for i, ((base, asym), d) in enumerate(diffs.items()):
        ax.plot([i - 0.1] * len(d), d, "o", color="tab:blue", ms=7, alpha=0.7, label="ours, each seed" if i == 0 else None)
        p = paper_matched(base, asym)
        if p["Table 6"] is not None:
            ax.plot(i + 0.1, p["Table 6"], "D", color="k", ms=7, label="paper, Table 6 (uniform LR, QKNorm; K = 1 as Dense: inferred)")
        if p["Table 7"] is not None:
            ax.plot(i + 0.1, p["Table 7"], "s", color="k", mfc="w", ms=8, label="paper, Table 7 (uniform LR, QKNorm)")
        if p["Table 8"] is not None:
            ax.plot(i + 0.1, p["Table 8"], "v", color="k", ms=8,
                    label="paper, Table 8 (uniform LR; its AsymLoop w/o QKNorm)" if i == 1 else None)
        ax.plot(i + 0.1, p["Table 3"], "x", color="0.5", ms=8, mew=2,
                label="paper, Table 3 (recipe not stated)" if i == 0 else None)
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_xticks(range(len(diffs)), [f"{a}\n− {b}" for b, a in diffs], fontsize=9)
    ax.set(xlim=(-0.5, len(diffs) - 0.5), ylabel="AsymLoop − baseline, within seed\n(nats/token; below 0: AsymLoop better)",
           title=f"AsymLoop is ahead of its matched baseline\nin {sum((d < 0).sum() for d in diffs.values())} of "
                 f"{sum(len(d) for d in diffs.values())} (pair, seed) comparisons")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)  # below the axes: no point hidden
    fig.tight_layout()
    return fig


# one colour per model in every figure; additive injection dashed
COLOR = {"asymloop_k1": "tab:blue", "asymloop_k3": "tab:orange", "asymloop_k5": "tab:green", "full_loop_k2": "tab:red",
         "full_loop_k3": "tab:purple", "asymloop_k3_additive": "tab:brown", "asymloop_k5_additive": "tab:pink",
         "asymloop_k3_no_global": "tab:gray", "asymloop_k3_no_local": "tab:olive", "asymloop_k5_no_global": "tab:cyan",
         "asymloop_k5_no_local": "darkolivegreen", "asymloop_k1_no_local": "gold", "dense": "k"}


def lens_names(runs: LMRuns):
    return [n for n in ("asymloop_k1", "asymloop_k3", "asymloop_k5", "full_loop_k2", "full_loop_k3") if runs.have(n)]


def _lens_panel(ax, runs, names, rel=False):
    """Loss when the head reads z_k, mean ± std over seeds (★: the trained K). rel: minus the loss at the trained K,
    drawn from k = K on only. Returns {name: mean change from k = K to k = 8}."""
    ks = np.arange(1, ex.MAX_TEST_K + 1)
    rise = {}
    for j, n in enumerate(names):
        c, k = runs.lens(n), runs.n_iter(n)
        c, x = (c[:, k - 1:] - c[:, k - 1:k], ks[k - 1:]) if rel else (c, ks)
        off = 0.04 * (j - len(names) / 2)
        ax.errorbar(x + off, c.mean(0), yerr=c.std(0, ddof=1), marker="o" if "asym" in n else "^", color=COLOR[n],
                    ls="--" if "additive" in n else "-", capsize=3, label=f"{n} (trained K={k})")
        ax.plot([k + off], [c.mean(0)[x.tolist().index(k)]], "*", color=COLOR[n], ms=16, mec="k")
        rise[n] = c.mean(0)[-1] - c.mean(0)[x.tolist().index(k)]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0.5, ex.MAX_TEST_K + 0.5)
    ax.legend(fontsize=8)
    return rise


def plot_lens(runs: LMRuns, names=None, init=None) -> Figure:
    """Loss when the head reads z_k, k = 1..8, per trained model (★: its trained K), mean ± std over seeds. Left: the
    models with Global KV and Full Loop; right (if any are named): additive injection past its trained K, minus its
    loss there, on its own scale. Each title says only what its panel shows. `init`: an untrained model's lens."""
    names = lens_names(runs) if names is None else names
    add = [n for n in names if "additive" in n]
    rest = [n for n in names if n not in add]
    both = bool(add) and bool(rest)
    fig = Figure(figsize=(13 if both else 8, 4.9))
    axes = list(fig.subplots(1, 2 if both else 1, squeeze=False, gridspec_kw=dict(width_ratios=[1.5, 1]) if both else None)[0])
    xlabel = "iteration k whose state the head reads (★: the trained K)"
    if rest:
        ax = axes.pop(0)
        rise = _lens_panel(ax, runs, rest)
        falls = "lowers" if all((np.diff(runs.lens(n).mean(0)[:runs.n_iter(n)]) < 0).all() for n in rest) \
            else "does not always lower"
        verdict = ("rises in every model" if min(rise.values()) > 0 else "does not rise in every model") + \
            " by k = 8\n(a model trained at larger K has fewer extra iterations there)"
        ref = "" if init is None else f"; untrained: {np.mean(init):.2f}, off scale"
        ax.set(xlabel=xlabel + "\none iteration runs 2 blocks in AsymLoop, 4 in Full Loop",
               ylabel="loss, held-out windows (nats/token)",
               title=f"Each trained iteration after the first {falls} the mean loss;\npast the trained K it {verdict}\n"
                     f"(mean ± std, {len(runs.seeds)} seeds, {runs.tpp:.1f} tokens/param{ref})")
    if add:
        ax = axes.pop(0)
        rise = _lens_panel(ax, runs, add, rel=True)
        ax.axhline(0, color="0.6", lw=0.8)
        lo, hi = min(rise.values()), max(rise.values())
        ax.set(xlabel=xlabel, ylabel="loss minus loss at the trained K\n(nats/token, own scale)",
               title=f"Additive injection past its trained K, own scale:\nfrom k = K to k = 8 the mean loss changes by\n"
                     f"{lo:+.4f} to {hi:+.4f} (mean ± std, {len(runs.seeds)} seeds)")
    fig.tight_layout()
    return fig


def gains(runs: LMRuns) -> dict:
    """G(K) per seed = loss without Global KV minus with it. At K=1 the model without Global KV is Dense (E + D = L)."""
    no_global = {1: "dense", 3: "asymloop_k3_no_global", 5: "asymloop_k5_no_global"}
    return {k: runs.loss(no_global[k]) - runs.loss(f"asymloop_k{k}") for k in (1, 3, 5)
            if runs.have(no_global[k]) and runs.have(f"asymloop_k{k}")}


VARIANTS = {"no_global": "without Global KV", "additive": "additive injection", "no_local": "without Local KV"}


def variant_name(v: str, k: int) -> str:
    """The stored run of variant v at K; at K = 1 without Global KV and additive injection are Dense (checked in 02)."""
    return "dense" if k == 1 and v != "no_local" else f"asymloop_k{k}_{v}"


def paper_variant(v: str, k: int):
    """The paper's variant minus AsymLoop (uniform LR, QKNorm, 60M; nats/token) and its source, or None."""
    if v == "no_global":
        return TABLE6[k], "Table 6"
    if v == "additive" and k == 3:
        return math.log(TABLE7["asymloop_k3_additive"] / TABLE7["asymloop_k3"]), "Table 7"
    if v == "no_local" and k in TABLE4A:
        return math.log(TABLE4A[k]["no_local"] / TABLE4A[k]["asymloop"]), "Table 4a"
    return None


def variant_table(runs: LMRuns, ks=(1, 3, 5)):
    """Each variant minus AsymLoop with Global KV at each K: our mean over seeds (the paper's in brackets)."""
    print(f"variant minus AsymLoop with Global KV (nats/token; above 0: the variant is behind): ours, mean of "
          f"{len(runs.seeds)} seeds (paper)\n{'':>19}" + "".join(f"{'K = ' + str(k):>18}" for k in ks))
    for v, label in VARIANTS.items():
        cells = []
        for k in ks:
            p = paper_variant(v, k)
            d = runs.loss(variant_name(v, k)) - runs.loss(f"asymloop_k{k}")
            cells.append(f"{d.mean():+.3f} ({'—' if p is None else f'{p[0]:+.3f}'})")
        print(f"{label:>19}" + "".join(f"{c:>18}" for c in cells))
    print("paper: Table 6 (without Global KV), Table 7 (additive, K = 3), Table 4a (without Local KV); uniform LR, QKNorm (4a: "
          "uniform LR stated in Section 4.5.1, QKNorm inferred: its w/o Global KV equals Table 7's); Tables 6, 7 state no size (60M "
          f"inferred: AsymLoop rows = 4a's); {paper_tokens_per_param():.1f} tok/param at 60M, ours {runs.tpp:.1f}. At K = 1 two are Dense.")


def plot_variants(runs: LMRuns, ks=(1, 3, 5)) -> Figure:
    """One panel per variant: its loss minus AsymLoop's with Global KV (the 0 line), one dot per seed, beside the paper."""
    fig = Figure(figsize=(12, 4.2))
    axes = fig.subplots(1, len(VARIANTS), sharey=True)
    verdict = {}
    for ax, (v, label) in zip(axes, VARIANTS.items()):
        d = np.array([runs.loss(variant_name(v, k)) - runs.loss(f"asymloop_k{k}") for k in ks])  # (K, seeds)
        for i in range(d.shape[1]):
            ax.plot(ks, d[:, i], "o", color="tab:blue", alpha=0.6, ms=7, label="ours, each seed" if i == 0 else None)
        ax.plot(ks, d.mean(1), "D-", color="tab:blue", ms=8, label=f"ours, mean ({runs.tpp:.1f} tokens/param)")
        paper = [(k, p) for k in ks if (p := paper_variant(v, k)) is not None]
        tables = sorted({p[1] for _, p in paper})  # Table 4's caption states 60M; Tables 6 and 7 give no size
        ax.plot([k for k, _ in paper], [p[0] for _, p in paper], "ks--", ms=7,
                label="paper (" + ", ".join(tables) + ("; 60M" if all(t.startswith("Table 4") for t in tables) else "; 60M inferred")
                + f", {paper_tokens_per_param():.1f} tokens/param)")
        ax.axhline(0, color="0.4", lw=1, label="AsymLoop with Global KV")
        verdict[v] = int((d[1:] > 0).sum())  # K > 1: at K = 1 two variants are Dense
        shown = d if v == "no_local" else d[1:]  # the title counts only where the variant is not Dense
        ax.set(xticks=list(ks), xlabel="decoder iterations K",
               title=f"{label}\nbehind in {int((shown > 0).sum())} of {shown.size} (K{'' if v == 'no_local' else ' > 1'}, seed)")
        if v != "no_local":
            ax.set_xticklabels([f"{k}\n(Dense)" if k == 1 else str(k) for k in ks])
        ax.legend(fontsize=7.5, loc="upper left")
    axes[0].set_ylabel("variant − AsymLoop with Global KV\n(nats/token, within seed; above 0: behind)")
    g = runs.loss("asymloop_k5_no_global") - runs.loss("asymloop_k5") > runs.loss("dense") - runs.loss("asymloop_k1")
    fig.suptitle(("Removing Global KV costs more at K = 5 than at K = 1 in every seed" if g.all() else
                  "The cost of removing Global KV does not grow with K in every seed")
                 + ("; additive injection is ahead in every (K > 1, seed), unlike Table 7" if verdict["additive"] == 0 else ""),
                 fontsize=11)
    fig.tight_layout()
    return fig


def matched_table(runs: LMRuns, diffs: dict):
    """AsymLoop minus its matched-depth baseline: our mean, seeds ahead, and the paper's like-for-like difference."""
    print(f"AsymLoop minus its matched-depth baseline (nats/token; below 0: AsymLoop ahead)\n{'pair':>27} {'depth':>5} "
          f"{'ours, mean ± std':>16} {'ahead in':>9}   paper, uniform LR and QKNorm (60M inferred)")
    for (b, a), d in diffs.items():
        p = paper_matched(b, a)
        src = next((f"{p[t]:+.3f} ({t}{', its K = 1 w/o Global KV as Dense: inferred' if t == 'Table 6' else ''})"
                    for t in ("Table 6", "Table 7") if p[t] is not None), "no like-for-like run")
        depth = runs.runs[(a, runs.seeds[0])]["effective_depth"]
        print(f"{a + ' - ' + b:>27} {depth:>5} {ms(d):>16} {f'{(d < 0).sum()}/{len(d)}':>9}   {src}")


def train_gap(runs: LMRuns, name, ref, seed, window=20) -> np.ndarray:
    """Training loss of `name` minus `ref`'s in one seed, each averaged over the `window` steps up to step window..end."""
    def smooth(n):
        return np.convolve([x[1] for x in runs.runs[(n, seed)]["train_loss"]], np.ones(window) / window, mode="valid")
    return smooth(name) - smooth(ref)


def per_seed_table(runs: LMRuns, names):
    print(f"{'model':>22} {'depth':>5} {'params':>8} " + " ".join(f"{'seed ' + str(s):>8}" for s in runs.seeds)
          + f" {'mean ± std':>16}")
    for n in names:
        if runs.have(n):
            r = runs.runs[(n, runs.seeds[0])]
            print(f"{n:>22} {r['effective_depth']:>5} {r['params'] / 1e6:>7.3f}M "
                  + " ".join(f"{x:>8.4f}" for x in runs.loss(n)) + f" {ms(runs.loss(n), '.4f'):>16}")


# ----------------------------------------------------------------------------- the live run of section 3
LIVE_ARMS = {"asymloop_k3": {}, "asymloop_k3_no_global": ex.CONTEXTS["no_global"]}  # without: Local KV only, z_0 = H
LIVE_LABEL = {"asymloop_k3": "with Global KV", "asymloop_k3_no_global": "without Global KV"}


def train_live(runs: LMRuns, steps: int = 60, seed: int = 0, names=tuple(LIVE_ARMS)) -> dict:
    """Train each model for the first `steps` steps of the stored runs' own schedule (same warm-up and cosine over
    the stored runs' step count, same init seed, same batches), so its losses are the stored run's first steps.
    names: LIVE_ARMS' models and "dense". Returns {name: dict(model, val_loss, train_loss, seconds, cpu_seconds)}."""
    total = runs.setting["steps"]
    if not 1 <= steps <= total:
        raise ValueError(f"steps must be in 1..{total} (the stored runs' schedule), got {steps}")
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # the stored runs' setting, so the live losses retrace them (bit for bit on the same CPU kernels)
    try:
        for name in names:
            out[name] = _train_one(name, total, steps, seed)
    finally:
        torch.set_num_threads(threads)
    return out


def replay_check(runs: LMRuns, live: dict, seed: int, steps: int) -> None:
    """Each live run against its seed's stored run: the largest training-loss gap at steps 1-5 (asserted under 1e-4
    where the corpus is the stored runs') and at steps 1-`steps` (printed: the runs part slowly; why is not traced)."""
    same = source_identity("stdlib", None) == runs.setting["data_identity"]  # the corpus depends on the Python version
    print("the stored runs' corpus:", same, "(if not, the gaps below are not checked)")
    for n in LIVE_ARMS:
        mine, stored = [x[1] for x in live[n]["train_loss"]], [x[1] for x in runs.runs[(n, seed)]["train_loss"][:steps]]
        first, drift = (np.abs(np.subtract(mine[:m], stored[:m])).max() for m in (5, steps))
        print(f"{n:>22}: largest |live - stored| training loss, steps 1-5: {first:.0e}; steps 1-{steps}: {drift:.0e}")
        assert first < 1e-4 or not same, "not the stored run's first steps: another schedule, corpus or torch version"


def _train_one(name: str, total: int, steps: int, seed: int) -> dict:
    """One live run: the stored run `name`'s first `steps` of its `total`-step schedule."""
    cfg = ex.lm_config("dense") if name == "dense" else ex.lm_config("asymloop", n_iter=3, **LIVE_ARMS[name])
    folder = tempfile.mkdtemp(prefix="asymloop-live-")  # the trainer checkpoints; the model is kept in memory
    t0, c0 = time.time(), time.process_time()
    try:
        result, model = ex.train_lm(cfg, ex.train_config(total, seed, folder, stop_step=steps, eval_interval=steps))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = dict(model=model, val_loss=result["val_loss"], seconds=time.time() - t0, cpu_seconds=time.process_time() - c0,
               train_loss=[(r["step"], r["loss"]) for r in result["history"] if "loss" in r])
    print(f"{name:>22}: {steps} of {total} steps, seed {seed}: val loss {result['val_loss']:.3f} "
          f"({out['seconds']:.0f} s, {out['cpu_seconds']:.0f} CPU s)")
    return out


@torch.no_grad()
def lens_from_zero(model, idx, targets, n_iter: int = ex.MAX_TEST_K) -> list[float]:
    """Loss of the head reading z_0, z_1, ..., z_n. z_0 is the decoder's start: H = Enc(Embed(x)) with Global KV and
    without it (context="none"), 0 with additive injection."""
    if model.config.arch != "asymloop":
        raise ValueError(f"lens_from_zero needs arch='asymloop' (got {model.config.arch!r}): only AsymLoop has an encoder output H")
    h = model.embed(idx)
    for blk in model.encoder:
        h = blk(h, model.rope)
    z0 = torch.zeros_like(h) if model.config.context == "additive" else h
    loss0 = F.cross_entropy(model.logits(z0).flatten(0, 1).float(), targets.flatten(), ignore_index=-1).item()
    return [loss0] + logit_lens(model, idx, targets, n_iter)


def plot_live_lens(lens: dict, steps: int, seed: int, n_iter: int = 3) -> Figure:
    """The live models' lens at k = 0..8 (k = 0: the head reads H); the title says which is ahead at the trained K."""
    fig = Figure(figsize=(8.5, 4.3))
    ax = fig.subplots()
    for name, curve in lens.items():
        ax.plot(range(len(curve)), curve, "o-", color=COLOR[name], label=f"{LIVE_LABEL[name]} ({name})")
        ax.plot([n_iter], [curve[n_iter]], "*", color=COLOR[name], ms=16, mec="k")
    a, b = (lens[n][n_iter] for n in LIVE_ARMS)
    ax.set(xlabel="iteration k whose state the head reads (k = 0: the encoder output H; ★: the trained K)",
           ylabel="loss, 32 held-out windows (nats/token)",
           title=f"After {steps} steps (seed {seed}), the model with Global KV is {'ahead' if a < b else 'behind'} at "
                 f"K = {n_iter} by {abs(b - a):.2f} nats on these windows,\nand both predict from H alone (k = 0) worse than after "
                 f"one iteration" if min(c[0] - c[1] for c in lens.values()) > 0 else f"Live lens after {steps} steps")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.tight_layout()
    return fig


def plot_live_gap(runs: LMRuns, live: dict, seed: int = 0, window: int = 20) -> Figure:
    """Training loss without Global KV minus with it (K=3, same seed and batches), smoothed over `window` steps: the
    stored runs, one panel per seed, with the live run drawn over its own seed."""
    a, b = LIVE_ARMS
    smooth = lambda xs: np.convolve([x[1] for x in xs], np.ones(window) / window, mode="valid")
    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, len(runs.seeds), sharey=True)
    final = runs.loss(b) - runs.loss(a)
    for ax, s, d in zip(axes, runs.seeds, final):
        gap = smooth(runs.runs[(b, s)]["train_loss"]) - smooth(runs.runs[(a, s)]["train_loss"])
        ax.plot(np.arange(window, window + len(gap)), gap, color=COLOR[b], lw=2, label="stored run")
        if s == seed:
            g = smooth(live[b]["train_loss"]) - smooth(live[a]["train_loss"])
            ax.plot(np.arange(window, window + len(g)), g, "k--", lw=1.5, label="live run")
        ax.axhline(0, color="0.6", lw=0.8)
        ax.axvline(runs.warmup(), color="0.4", ls=":", lw=1.2, label="end of LR warm-up" if s == runs.seeds[0] else None)
        ax.set(xlabel="training step", title=f"seed {s}\nvalidation gap at step {runs.setting['steps']}: {d:+.3f}")
    axes[0].set_ylabel("training loss without − with\nGlobal KV (nats/token)")
    axes[min(runs.seeds.index(seed), len(axes) - 1)].legend(fontsize=9)
    fig.suptitle(f"Without Global KV, AsymLoop K=3 ends behind in {(final > 0).sum()} of {len(final)} seeds; the live "
                 f"run starts as its seed's stored one\n(training loss averaged over the {window} steps up to each point; above 0: behind)")
    fig.tight_layout()
    return fig
