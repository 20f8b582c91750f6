"""Notebook 06's figures and tables: weight spectra against the Marchenko–Pastur bulk, and the ALRS study read from
notebooks/results/alrs.json (`python -m minimal_asymloop.experiments alrs`), so that its cells show the idea."""

import textwrap

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

ARM_LABELS = {"uniform": "uniform LR", "alrs": "ALRS", "alrs_unpinned": "ALRS, embedding/head not pinned",
              "alrs_blocks": "ALRS, embedding/head at 1× (our reading of the paper)",
              "alrs_hill": "ALRS, hill_median fit", "uniform_top": "uniform, embedding/head at 5× only",
              "scaled": "uniform × ALRS's mean multiplier", "decoder_boost": "decoder LR boost (Table 4b)",
              "uniform_top_embed": "uniform, embedding alone at 5×", "uniform_top_head": "uniform, head alone at 5×"}
SRANK_GROUPS = ("encoder attention", "encoder FFN", "decoder attention", "decoder FFN")
PINNED = ("alrs", "alrs_hill", "uniform_top")  # the arms whose embedding and head run at the top multiplier


def live_run(arm: str, res: dict, lr: float, steps: int, device: str = "cpu") -> list[dict]:
    """The first `steps` steps of the study's run of `arm` at base LR `lr`, seed 0, on 1 thread (as the study ran),
    built by the study's own experiments.arm_setup: its logged history. The checkpoint lands in out/nb06_live_<arm>."""
    from minimal_asymloop import experiments as ex
    from minimal_asymloop.paths import OUT
    from minimal_asymloop.trainer import train

    S = res["setting"]
    cfg, cfg_t, hook = ex.arm_setup(arm, lr, S["seeds"][0], S["steps"], OUT / f"nb06_live_{arm}",
                                    res["decoder_boost_mult"] if arm == "decoder_boost" else None,
                                    stop_step=steps, device=device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums depend on the thread count
    try:
        return train(cfg, cfg_t, lr_hook=hook)["history"]
    finally:
        torch.set_num_threads(threads)


def pipeline_figure() -> Figure:
    """ALRS in one picture: a matrix's spectrum -> its alpha -> a multiplier in [lo, hi] -> its learning rate; the
    embedding and head skip the fit and get the top multiplier."""
    ax = (fig := Figure(figsize=(11, 3.0))).subplots()
    ax.set(xlim=(0, 11), ylim=(0, 3), title="ALRS: each weight matrix's learning rate from its spectrum")
    ax.axis("off")
    steps = ["encoder/decoder\nweight matrix W", "eigenvalues of WᵀW\n(its spectrum)", "power-law tail fit:\nalpha",
             "multiplier m in [1, 5],\nlinear in alpha\n(model min → max)", "LR of W =\nbase LR × m\n(ramped, then frozen)"]
    for i, text in enumerate(steps):
        x = 0.2 + i * 2.2
        ax.text(x + 0.9, 2.0, text, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", fc="#DCEAF7" if i < 4 else "#D5F0D5", ec="k"))
        if i:
            ax.annotate("", xy=(x + 0.05, 2.0), xytext=(x - 0.45, 2.0), arrowprops=dict(arrowstyle="->"))
    ax.text(6.6, 0.5, "embedding and head: m = 5 whatever their alpha (He et al.'s code, alrs.TOP_NAMES);\n"
            "their alphas are logged but do not move the other matrices' range\n(He et al. set them to the largest of the others)",
            ha="center", va="center", fontsize=9, bbox=dict(boxstyle="round", fc="#F7E3C8", ec="k"))
    ax.annotate("", xy=(9.9, 1.5), xytext=(9.9, 0.8), arrowprops=dict(arrowstyle="->"))
    return fig


def runs_of(res: dict, arm: str, lr: float | None = None) -> dict[int, dict]:
    """{seed: run} of `arm` at base LR `lr` (None: any LR)."""
    return {r["seed"]: r for r in res["runs"] if r["arm"] == arm and (lr is None or r["lr"] == lr)}


def best_lr(res: dict, arm: str) -> float:
    """The arm's base LR with the lowest mean final val loss over all seeds, among its sweep's LRs that have every seed."""
    seeds, grid = res["setting"]["seeds"], res["setting"]["lr_grids"][arm]
    by_lr = {lr: runs_of(res, arm, lr) for lr in grid}
    full = {lr: np.mean([got[s]["val_loss"] for s in seeds]) for lr, got in by_lr.items() if all(s in got for s in seeds)}
    if not full:
        raise ValueError(f"no base LR of {arm}'s grid {grid} has every seed {seeds}; run the study to the end")
    return min(full, key=full.get)


def control_arms(res: dict) -> dict[str, tuple[str, float]]:
    """{label: (arm, base LR)}: ALRS at its best and the controls, each run at the LR the study gave it."""
    first = res["best_lr_first_seed"]
    arms = {ARM_LABELS["alrs"]: ("alrs", best_lr(res, "alrs"))}
    if "alrs_blocks" in res["setting"]["lr_grids"]:  # its own sweep: at its own best
        arms[ARM_LABELS["alrs_blocks"]] = ("alrs_blocks", best_lr(res, "alrs_blocks"))
    arms |= {ARM_LABELS["scaled"]: ("uniform", res["scaled_uniform_lr"]),
            ARM_LABELS["alrs_unpinned"]: ("alrs_unpinned", first["alrs"]),
            ARM_LABELS["alrs_hill"]: ("alrs_hill", first["alrs"]),
            ARM_LABELS["uniform_top"]: ("uniform_top", first["uniform"])}
    arms |= {ARM_LABELS[a]: (a, first["uniform"]) for a in ("uniform_top_embed", "uniform_top_head") if runs_of(res, a, first["uniform"])}
    if "decoder_boost_mult" in res:
        arms[ARM_LABELS["decoder_boost"] + f", decoder ×{res['decoder_boost_mult']:g}"] = ("decoder_boost", first["uniform"])
    return arms


def control_summary(res: dict) -> str:
    """One line per arm: its mean within-seed difference from uniform LR at its best, and in how many seeds it is lower."""
    lines = []
    for label, (arm, lr) in control_arms(res).items():
        d = within_seed(res, arm, lr)
        lines.append(f"{label:>44}: {d.mean():+.3f} ± {d.std(ddof=1):.3f} nats, lower in {(d < 0).sum()}/{len(d)} seeds")
    return "\n".join(lines)


def within_seed(res: dict, arm: str, lr: float, key: str = "val_loss") -> np.ndarray:
    """(arm at lr) − (uniform at its best base LR), seed by seed, over the seeds both have."""
    base, got = runs_of(res, "uniform", best_lr(res, "uniform")), runs_of(res, arm, lr)
    return np.array([got[s][key] - base[s][key] for s in res["setting"]["seeds"] if s in got and s in base])


def alpha_agreement(res: dict, lr: float) -> tuple[list[float], float]:
    """Does ALRS's allocation among the blocks repeat? Spearman's rank correlation of the block matrices' alphas at
    the last allocation, for each pair of seeds of the arm "alrs" at lr; and the median, over those matrices, of one
    alpha's sd over the allocations of one run (the first seed), each allocation centred on its blocks' mean alpha and
    the one at step 0 (the init) left out, so the blocks' common drift during training does not count. Embedding and
    head (pinned) are left out."""
    from scipy import stats

    from minimal_asymloop import alrs

    runs = runs_of(res, "alrs", lr)
    seeds = sorted(runs)
    names = [k for k in runs[seeds[0]]["alrs_records"][-1]["alpha"] if k not in alrs.TOP_NAMES]
    last = {s: [runs[s]["alrs_records"][-1]["alpha"][k] for k in names] for s in seeds}
    rho = [float(stats.spearmanr(last[a], last[b]).statistic) for i, a in enumerate(seeds) for b in seeds[i + 1:]]
    over_time = np.array([[r["alpha"][k] for k in names] for r in runs[seeds[0]]["alrs_records"] if r["step"] > 0])
    centred = over_time - over_time.mean(1, keepdims=True)
    return rho, float(np.median(centred.std(0, ddof=1)))


def mp_edges(eigenvalues, shape: tuple[int, int]) -> tuple[float, float]:
    """The Marchenko–Pastur bulk [λ−, λ+] of WᵀW for an i.i.d. random W of this shape and the same Frobenius norm."""
    n, m = max(shape), min(shape)
    sigma2 = float(np.sum(eigenvalues)) / (n * m)  # Σλ = ‖W‖_F² = n·m·σ² for i.i.d. entries of variance σ²
    return sigma2 * (np.sqrt(n) - np.sqrt(m)) ** 2, sigma2 * (np.sqrt(n) + np.sqrt(m)) ** 2


def tail_fit(eigenvalues, with_xmin: bool = False) -> tuple:
    """WeightWatcher's power-law fit (as alrs.ww_fit_alpha) and the number of eigenvalues it fitted (those >= xmin);
    with_xmin: xmin too."""
    from minimal_asymloop import alrs

    e = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    alpha, _, xmin, *_ = alrs.weightwatcher_module().WeightWatcher().fit_powerlaw(e, plot=False, savefig=False)
    return (float(alpha), int((e >= xmin).sum())) + ((float(xmin),) if with_xmin else ())


def plot_tail(spectra: dict) -> Figure:
    """Each eigenvalue vector's tail on log-log axes: the fraction of eigenvalues >= λ (dots), WeightWatcher's xmin,
    and its fitted power law p(λ) ∝ λ^−alpha, which this plot shows as a line of slope −(alpha − 1) from xmin up."""
    fig = Figure(figsize=(4 * len(spectra), 3.8))
    axes = fig.subplots(1, len(spectra), squeeze=False)[0]
    for ax, (label, ev) in zip(axes, spectra.items()):
        e = np.sort(np.asarray(ev, dtype=np.float64))
        e = e[e > 1e-5]  # (numerical) zeros dropped, as the package does
        alpha, n_tail, xmin = tail_fit(e, with_xmin=True)
        ccdf = 1 - np.arange(len(e)) / len(e)  # fraction of eigenvalues >= e[i]
        ax.loglog(e, ccdf, ".", color="0.5", ms=4, label="eigenvalues")
        x = np.geomspace(xmin, e.max(), 50)
        ax.loglog(x, n_tail / len(e) * (x / xmin) ** (1 - alpha), "C3-", lw=2, label=f"power law, alpha {alpha:.1f}")
        ax.axvline(xmin, color="C0", ls=":", label=f"xmin: {n_tail} of {len(e)} fitted")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: minor ones overlap
        ax.set(title=label, xlabel="eigenvalue λ of WᵀW")
        ax.legend(fontsize=8, loc="lower left")
    axes[0].set_ylabel("fraction of eigenvalues ≥ λ")
    fig.suptitle("On log-log axes the fitted tail is a line of slope 1 − alpha: a heavier tail is a flatter line (smaller alpha)")
    fig.tight_layout()
    return fig


def plot_alpha_noise(scatter: dict, fits: dict, name: str, spread: float | None = None) -> Figure:
    """Left: alphas of many Gaussian matrices per shape (dots), with the formula's median standard error beside the
    real spread; right: one trained matrix's alpha at init and after each arm, ± `spread` (the measured sd of random
    matrices of its shape) or, without it, ± each fit's formula standard error."""
    fig = Figure(figsize=(11, 3.8))
    ax, ax1 = fig.subplots(1, 2)
    rng = np.random.default_rng(0)
    for i, (a, se) in enumerate(scatter.values()):
        ax.plot(i + rng.uniform(-0.15, 0.15, len(a)), a, ".", color=f"C{i}", alpha=0.4, ms=4)
        ax.errorbar(i + 0.3, np.median(a), yerr=np.median(se), fmt="ks", capsize=5,
                    label="median ± the formula's s.e." if i == 0 else None)
    ax.set_xticks(range(len(scatter)), [f"Gaussian {s}\n(sd {a.std(ddof=1):.1f})" for s, (a, _) in scatter.items()])
    ax.set(ylabel="alpha (WeightWatcher)", title="random matrices: alpha scatters\nfar beyond its formula s.e.")
    ax.legend(fontsize=8)
    for i, (a, n_tail, se) in enumerate(fits.values()):
        ax1.errorbar(i, a, yerr=se if spread is None else spread, fmt="o", color=f"C{i + 2}", capsize=5)
        ax1.annotate(f"{a:.2f} ({n_tail} pts)", (i + 0.08, a), fontsize=8)
    ax1.set_xticks(range(len(fits)), list(fits), fontsize=9)
    bars = "the formula's s.e." if spread is None else f"sd of random matrices of its shape ({spread:.1f})"
    ax1.set(xlim=(-0.5, len(fits) - 0.3), ylabel=f"alpha ± {bars}", title=f"{name}:\nwithin random matrices' scatter")
    fig.suptitle("One alpha fit is noisy: a random matrix's scatter spans one matrix's init, uniform-LR and ALRS fits")
    fig.tight_layout()
    return fig


def random_beyond_edge(shape: tuple[int, int], draws: int = 2000, seed: int = 0) -> np.ndarray:
    """How many eigenvalues of WᵀW lie past mp_edges' λ+ for i.i.d. Gaussian W of this shape, one count per draw."""
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(draws):
        w = rng.standard_normal(shape)
        ev = np.linalg.eigvalsh(w.T @ w)
        counts.append(int((ev > mp_edges(ev, shape)[1]).sum()))
    return np.array(counts)


def mp_density(x, lo: float, hi: float, shape: tuple[int, int]) -> np.ndarray:
    """Marchenko–Pastur density of the eigenvalues of WᵀW with bulk [lo, hi] (zero outside)."""
    q = min(shape) / max(shape)
    sigma2 = (np.sqrt(hi) + np.sqrt(lo)) ** 2 / 4 / max(shape)  # √λ± = σ(√n ± √m), so √λ+ + √λ− = 2σ√n
    x = np.asarray(x, dtype=float)
    inside = (x > lo) & (x < hi)
    out = np.zeros_like(x)
    out[inside] = np.sqrt((hi - x[inside]) * (x[inside] - lo)) / (2 * np.pi * q * sigma2 * max(shape) * x[inside])
    return out


def plot_esd(spectra: dict, name: str, shape: tuple[int, int], tags: dict[str, str]) -> Figure:
    """One matrix's eigenvalues at init and trained (one panel each) over the bulk a random matrix would have."""
    fig = Figure(figsize=(10, 4.0))
    axes = fig.subplots(1, len(tags), sharex=True)  # shared: training grows the spectrum several-fold
    for ax, (tag, label) in zip(axes, tags.items()):
        e = np.array(spectra[tag]["eigenvalues"][name])
        lo, hi = mp_edges(e, shape)
        width = hi / 16  # bins aligned to λ+: no bar straddles the edge, so bars right of it are beyond it
        ax.hist(e, bins=np.arange(0, e.max() + width, width), density=True, color="C0", alpha=0.7,
                label="eigenvalues (histogram)")
        x = np.linspace(0, max(e.max(), hi) * 1.05, 400)
        ax.plot(x, mp_density(x, lo, hi, shape), "k-", lw=1.5, label="random matrix (MP bulk)")
        ax.axvline(hi, color="r", ls=":", lw=1.5, label="bulk edge λ+")
        n_out = int((e > hi).sum())
        ax.set(title=f"{label}\n{n_out} of {len(e)} eigenvalues beyond λ+", xlabel="eigenvalue λ of WᵀW")
    axes[0].set_ylabel("density p(λ)")
    axes[0].legend(fontsize=9)
    fig.suptitle(f"{name} ({shape[0]}×{shape[1]}): training moves eigenvalues out of the random bulk")
    fig.tight_layout()
    return fig


def plot_sweep(res: dict) -> Figure:
    """Final val loss against the base LR for each arm: mean ± sd over seeds, one dot per seed."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for arm, color in (("uniform", "C0"), ("alrs", "C3"), ("alrs_blocks", "C2")):
        if arm not in res["setting"]["lr_grids"]:
            continue
        lrs = sorted(res["setting"]["lr_grids"][arm])
        vals = [[r["val_loss"] for r in runs_of(res, arm, lr).values()] for lr in lrs]
        ax.errorbar(lrs, [np.mean(v) for v in vals], yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in vals],
                    fmt="o-", color=color, capsize=4, label=f"{ARM_LABELS[arm].split(' (')[0]} (mean ± sd)")
        for lr, v in zip(lrs, vals):
            ax.plot([lr] * len(v), v, ".", color=color, alpha=0.4)
    steps = res["setting"]["steps"]
    grid = sorted(set().union(*res["setting"]["lr_grids"].values()))
    both = sorted(set(res["setting"]["lr_grids"]["uniform"]) & set(res["setting"]["lr_grids"]["alrs"]))
    ahead = sum(np.mean([r["val_loss"] for r in runs_of(res, "alrs", lr).values()])
                < np.mean([r["val_loss"] for r in runs_of(res, "uniform", lr).values()]) for lr in both)
    verdict = "at every base LR both tried" if ahead == len(both) else f"at {ahead} of the {len(both)} base LRs both tried"
    ax.set_xscale("log")
    ax.set_xticks(grid, [f"{lr:g}" for lr in grid], fontsize=9)
    ax.minorticks_off()
    ax.set(xlabel="base learning rate", ylabel=f"val loss after {steps} steps (nats/token)",
           title=f"ALRS's mean is below uniform LR's {verdict}\n(dots: seeds; each arm has its own sweep)")
    ax.legend(fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the axes, covering no dot
    fig.tight_layout()
    return fig


def controls_title(res: dict) -> str:
    """The controls figure's takeaway, from the data: which arms beat uniform LR at its best in every seed."""
    n = len(res["setting"]["seeds"])
    wins = {arm for arm, lr in control_arms(res).values() if arm != "uniform" and
            len(d := within_seed(res, arm, lr)) == n and (d < 0).all()}
    scaled = len(d := within_seed(res, "uniform", res["scaled_uniform_lr"])) == n and (d < 0).all()
    alone = {a for a, _ in control_arms(res).values()} & {"uniform_top_embed", "uniform_top_head"}  # one matrix pinned
    if wins == set(PINNED) | alone and not scaled:
        boost = " or decoder" if "decoder_boost_mult" in res else ""
        return (f"The {len(wins)} arms that pin embedding{' or' if alone else ' and'} head at 5× beat uniform LR in every seed;\n"
                f"ALRS without the pin and the arms that only raise the LR (uniform{boost}) do not")
    names = [label for label, (arm, lr) in control_arms(res).items() if arm in wins or (arm == "uniform" and scaled)]
    return "Better than uniform LR at its best in every seed:\n" + (", ".join(names) or "none of the arms")


VERDICTS = {"better": ("C2", "below uniform in every seed (better)"), "worse": ("C3", "above uniform in every seed (worse)"),
            "mixed": ("0.6", "seeds on both sides of 0 (no clear effect)")}


def seed_verdict(d: np.ndarray) -> str:
    """'better' when every within-seed difference is below 0, 'worse' when every one is above, else 'mixed'."""
    return "better" if (d < 0).all() else "worse" if (d > 0).all() else "mixed"


def plot_controls(res: dict) -> Figure:
    """Each arm minus uniform LR at its best, within seed: one dot per seed, the mean as a bar coloured by its verdict."""
    fig = Figure(figsize=(13, 5.2))
    ax = fig.subplots()
    labels = []
    for i, (label, (arm, lr)) in enumerate(control_arms(res).items()):
        d = within_seed(res, arm, lr)
        color, meaning = VERDICTS[seed_verdict(d)]
        ax.bar(i, d.mean(), color=color, alpha=0.6, label=f"mean; {meaning}")
        ax.plot([i] * len(d), d, "ko", ms=5, label="one seed" if i == 0 else None)
        labels.append(textwrap.fill(label, 17) + f"\n(base LR {lr:g})")
    ax.axhline(0, color="k", lw=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8.5)
    ax.set(xlabel="arm (the base LR it ran at)", ylabel="val loss − uniform at its best\n(nats/token, within seed)",
           title=controls_title(res))
    handles, names = ax.get_legend_handles_labels()
    keep = {n: h for h, n in zip(handles, names)}  # one entry per label
    ax.legend(keep.values(), keep.keys(), fontsize=9, loc="upper left")  # the first arms' bars stay low
    fig.tight_layout()
    return fig


def plot_stable_rank(res: dict, arms: dict[str, tuple[str, float]]) -> Figure:
    """Normalized stable rank per group, each arm minus uniform LR at its best within seed (bars: mean, dots: seeds)."""
    fig = Figure(figsize=(10, 4.4))
    ax = fig.subplots()
    w = 0.8 / len(arms)
    x = np.arange(len(SRANK_GROUPS))
    diffs = {label: np.array([within_seed(res, arm, lr, f"srank {g}") for g in SRANK_GROUPS]) for label, (arm, lr) in arms.items()}
    for i, (label, v) in enumerate(diffs.items()):  # v: (group, seed)
        ax.bar(x + i * w, v.mean(1), w, color=f"C{i}", alpha=0.8, label=label)
        for col in v.T:
            ax.plot(x + i * w, col, "k.", ms=4)
    ax.axhline(0, color="k", lw=0.8)
    first, dec = next(iter(diffs)), SRANK_GROUPS.index("decoder FFN")
    lower = int((diffs[first] < 0).all(1).sum())  # groups lower in every seed
    ax.set_xticks(x + w * (len(arms) - 1) / 2, [g.replace(" ", "\n") for g in SRANK_GROUPS])
    ax.set(xlabel="matrix group (local Q/K/V/O for attention, gate/up/down for FFN)",
           ylabel="Δ mean normalized stable rank\n(arm − uniform LR, same seed)",
           title=f"Stable rank lower than under uniform LR in every seed: {first} in {lower} of {len(SRANK_GROUPS)} groups\n"
                 f"decoder FFN: " + ", ".join(f"{k} {v[dec].mean():+.3f}" for k, v in diffs.items()) + " (dots: seeds)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def train_losses(history: list[dict]) -> dict[int, float]:
    """{step: training loss} of a run's logged history."""
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def replay_gaps(history: list[dict], stored: dict) -> dict[int, float]:
    """{step: |live − stored| training loss} at every step the stored run logged up to the live run's last step."""
    live = train_losses(history)
    return {s: abs(live[s] - v) for s, v in stored["train_loss"] if s <= max(live)}


def spike(history: list[dict], after: int = 5) -> tuple[int, float]:
    """(step, loss) of a run's highest training loss after step `after` (the first steps start near ln V)."""
    return max(((s, v) for s, v in train_losses(history).items() if s > after), key=lambda x: x[1])


def plot_live(live: dict[str, list[dict]], stored: dict[str, dict | None], lr: float) -> Figure:
    """The live runs' training loss (lines) over the study's logged losses of the same runs (circles)."""
    fig = Figure(figsize=(10, 4.2))
    ax = fig.subplots()
    for j, (arm, history) in enumerate(live.items()):
        loss = train_losses(history)
        ax.plot(list(loss), list(loss.values()), color=f"C{j}", lw=1.5, ls=("-", "--", "-.", ":")[j % 4],
                label=f"{ARM_LABELS[arm]}, live")
        if stored.get(arm):
            st = [(s, v) for s, v in stored[arm]["train_loss"] if s <= max(loss)]
            ax.plot(*zip(*st), "o", mfc="none", color=f"C{j}", ms=7, label=f"{ARM_LABELS[arm]}, the study's run")
    ax.set(xlabel="training step", ylabel="training loss (nats/token)",
           title=f"Live: the first {max(loss)} steps at base LR {lr:g}, seed 0, beside the study's runs")
    ax.legend(fontsize=9, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below the x label, covering no curve
    fig.tight_layout()
    return fig


def replay(live: dict[str, list[dict]], res: dict, arms, lr: float, device: str) -> tuple[dict, Figure]:
    """Each live run beside the study's run of the same arm, base LR and seed 0, at the study's logged steps. Prints, per
    arm, the largest |live − study| training loss to steps 10, 20 and the end, the gap at the end, and its highest loss after step 5.
    Returns ({arm: the largest gap to step 10, None where nothing is checked}, the figure). Checked only where the study
    has that run and the live one ran on its data, on "cpu" (the study's device and thread count)."""
    from minimal_asymloop.sources import source_identity

    S = res["setting"]
    stored = {arm: runs_of(res, arm, lr).get(S["seeds"][0]) for arm in arms}
    check = source_identity("stdlib", None) == S["data_identity"] and device == "cpu"
    early = {}
    for arm, run in stored.items():
        if run is None:
            print(f"{arm}: the study has no run at LR {lr:g}: nothing to check against")
            early[arm] = None
            continue
        gaps = replay_gaps(live[arm], run)
        to10, to20 = (max(g for s, g in gaps.items() if s <= t) for t in (10, 20))
        early[arm] = to10 if check else None
        verdict = "checked" if check else "NOT checked: needs the study's data and DEVICE 'cpu'"
        (s_hi, v_hi) = spike(live[arm])  # the study logs every 5 steps: a one-step spike can fall between
        print(f"{arm}: largest |live - study| to step 10: {to10:.1g} ({verdict}); to step 20: {to20:.1g}; to step {max(gaps)}: "
              f"{max(gaps.values()):.1g} (at step {max(gaps)} itself: {gaps[max(gaps)]:.1g}); highest training loss after step 5, "
              f"live: {v_hi:.1f} at step {s_hi}")
    return early, plot_live({arm: live[arm] for arm in arms}, stored, lr)


def sweep_table(res: dict) -> str:
    """Every run of the study: arm, base LR, the final val loss of each seed."""
    seeds = res["setting"]["seeds"]
    lines = [f"{'arm':>14} {'base LR':>8}  " + "  ".join(f"seed {s}" for s in seeds) + "    mean"]
    for arm, lr in sorted({(r["arm"], r["lr"]) for r in res["runs"]}):
        got = runs_of(res, arm, lr)
        vals = [f"{got[s]['val_loss']:.4f}" if s in got else "   -  " for s in seeds]
        lines.append(f"{arm:>14} {lr:8.3g}  " + "  ".join(vals) + f"  {np.mean([r['val_loss'] for r in got.values()]):.4f}")
    return "\n".join(lines)


def plot_allocation(run: dict, ramp: int, last_step: int) -> Figure:
    """Left: every matrix's multiplier over the run, replayed from its logged allocations (the paper's Figure 3, left);
    right: alpha -> multiplier at the last allocation, one colour per group (embedding and head pinned at the top)."""
    from minimal_asymloop import alrs

    rows = [{"alrs_step": r["step"], "alrs_multiplier": r["multiplier"]} for r in run["alrs_records"]]
    steps, hist = alrs.multiplier_history(rows, ramp, last_step)
    last = run["alrs_records"][-1]
    fig = Figure(figsize=(13, 4.4))
    ax0, ax = fig.subplots(1, 2)
    for grp in alrs.GROUPS:
        names = [n for n in last["alpha"] if alrs.group_of(n) == grp]
        if names:
            line = ax0.plot(steps, np.mean([hist[n] for n in names], axis=0), lw=2, label=f"{grp} (mean)")[0]
            for n in names:
                ax0.plot(steps, hist[n], color=line.get_color(), lw=0.6, alpha=0.35)
            ax.scatter([last["alpha"][n] for n in names], [last["multiplier"][n] for n in names], label=grp)
    frozen = last["step"] + ramp
    ax0.set(xlabel=f"training step (first {frozen + 2 * ramp} of {last_step}; flat after {frozen})", ylabel="LR multiplier m_i",
            ylim=(0, 5.5), xlim=(0, frozen + 2 * ramp))
    ax0.set_title("Multipliers over the allocation phase\n(thick: group mean; colours as right)", fontsize=10)
    ax.set(xlabel="alpha (ww fit) at the last allocation", ylabel="LR multiplier m_i", ylim=(0, 5.5))
    ax.set_title(f"Allocation at step {last['step']} (seed {run['seed']}, base LR {run['lr']:g}):\n"
                 "a line from the smallest alpha (×1) to the largest (×5)", fontsize=10)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def top_share(model: dict) -> float:
    """The pinned matrices' (embedding and head) share of the parameters of `LoopedLM(ModelConfig(**model))`."""
    from minimal_asymloop import alrs
    from minimal_asymloop.model import LoopedLM, ModelConfig

    sizes = {n: p.numel() for n, p in LoopedLM(ModelConfig(**model)).named_parameters()}
    return sum(sizes[n] for n in alrs.TOP_NAMES) / sum(sizes.values())


def random_alpha_scatter(shape: tuple[int, int], draws: int, generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """WeightWatcher's alpha of `draws` Gaussian matrices of this shape, and each fit's (alpha − 1)/√n standard error."""
    from minimal_asymloop import alrs

    fits = [tail_fit(alrs.eigenvalues(torch.randn(*shape, generator=generator), torch.float64)) for _ in range(draws)]
    a = np.array([f[0] for f in fits])
    return a, (a - 1) / np.sqrt([f[1] for f in fits])
