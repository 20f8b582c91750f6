"""ALRS: heavy-tail-guided layerwise learning rates (He et al. 2026, as the paper uses it).

Each weight matrix W gets an exponent alpha from a power-law fit to the eigenvalues of
WᵀW. A larger alpha (a lighter tail, a less-trained matrix) earns a larger LR multiplier:
m_i = interp(alpha_i, [min, max], [lo, hi]). Multipliers are re-allocated every `every`
steps during the first `phase` of training, each reached by a linear ramp, then frozen.
The trainer turns a multiplier into an LR as base_lr · m_i · schedule(t).
"""

import functools
import logging
import math
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

FITS = ("ww", "hill_median")
EVALS_THRESH = 1e-5  # eigenvalues at or below this count as zero (weightwatcher's cut, its fit_powerlaw's `thresh`)
MIN_EVALS = 50  # matrices with fewer eigenvalues are not tuned
# Embedding and head get the top multiplier by default, as in the reference code. (ours) Their alphas are
# logged but kept out of the min/max: their multiplier is pinned, so they take no part in the interpolation.
TOP_NAMES = ("embed.weight", "head.weight")
# What ALRS does with them (--alrs-top): "pin" at the top multiplier (He et al.'s code, the default); "base", fitted
# and logged but left at 1x, as we read the paper's words ("individual weight matrices in the encoder and decoder", Section
# 3.3); "fit", allocated by their alphas like every other matrix (ours, a control)
TOP_MODES = {"pin": dict(top=TOP_NAMES), "base": dict(top=(), skip=TOP_NAMES), "fit": dict(top=())}
GROUPS = ("encoder attention", "encoder FFN", "decoder attention", "decoder FFN", "global KV",
          "attention", "FFN", "embedding/head")  # "attention"/"FFN": the `blocks` of dense and full_loop


# ----------------------------------------------------------------------------- alpha per matrix


@torch.no_grad()
def eigenvalues(weight: torch.Tensor, dtype=torch.float32) -> np.ndarray:
    """Eigenvalues of WᵀW (squared singular values), ascending, as float64 numpy.

    Computed with torch.linalg on the weight's own device, on a detached copy in `dtype`
    (float32 by default); only the result goes to the CPU for the fit.
    """
    w = weight.detach().to("cpu" if weight.device.type == "mps" else weight.device, dtype, copy=True)  # MPS has no SVD kernel
    s = torch.linalg.svdvals(w)  # min(rows, cols) singular values, descending
    return np.sort(s.double().square().cpu().numpy())


def hill_median_alpha(eigenvalues, filter_zeros: bool = True) -> float:
    """Hill estimator with xmin at the median eigenvalue, the reference code's pl_fitting="median" (xmin_pos=2):
    alpha = 1 + n / (Σ_{λ≥xmin} ln λ − n·ln xmin) over the n eigenvalues from index N//2 up.

    (ours) filter_zeros=True first drops the eigenvalues <= EVALS_THRESH, as weightwatcher does. The reference code
    has this cut as an option that its default and all its configs leave off: filter_zeros=False is its fit."""
    if isinstance(eigenvalues, torch.Tensor):
        eigenvalues = eigenvalues.detach().cpu().double().numpy()
    e = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    if filter_zeros:
        e = e[e > EVALS_THRESH]
    if len(e) < 2:
        raise ValueError(f"hill_median_alpha needs at least 2 eigenvalues{f' above {EVALS_THRESH}' if filter_zeros else ''}, "
                         f"got {len(e)}")
    i = len(e) // 2  # xmin = e[N//2], the upper median
    if e[i] <= 0:
        raise ValueError(f"the median eigenvalue is {e[i]}: no power law fits a spectrum that is half zeros; "
                         "filter_zeros=True drops the zeros first")
    n, log_e = len(e) - i, np.log(e)
    denom = log_e[i:].sum() - n * log_e[i]
    if denom <= 0:
        raise ValueError("all eigenvalues above the median are equal; the power-law exponent is undefined")
    return float(1 + n / denom)


@functools.cache
def weightwatcher_module():
    """Import weightwatcher without its process-wide side effects: on import it calls
    warnings.simplefilter("ignore") (silencing every warning in the process) and
    logging.basicConfig(level=INFO), and logs a notice about CUDA or SciPy."""
    root, mpl = logging.getLogger(), logging.getLogger("matplotlib")
    levels, quiet = (root.level, mpl.level), logging.NullHandler()
    root.addHandler(quiet)  # makes its basicConfig a no-op and swallows the import notices
    try:
        with warnings.catch_warnings():  # restores the warning filters on exit
            import weightwatcher
    finally:
        root.removeHandler(quiet)
        root.setLevel(levels[0])
        mpl.setLevel(levels[1])
    return weightwatcher


def ww_fit_alpha(eigenvalues) -> float:
    """WeightWatcher's own power-law fit of an eigenvalue vector (xmin by smallest KS distance).

    `WeightWatcher.fit_powerlaw` is the function `analyze()` calls on each layer's
    eigenvalues; we call it with analyze()'s defaults (no fix_fingers, no xmax, its `ww` fitter).
    """
    watcher = weightwatcher_module().WeightWatcher()
    e = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tied eigenvalues divide by zero; we raise below
        alpha, *_, status, _warning = watcher.fit_powerlaw(e, plot=False, savefig=False)
    if status != "success" or not math.isfinite(alpha):
        raise ValueError(f"weightwatcher's power-law fit failed (status {status!r}) on {len(e)} eigenvalues")
    return float(alpha)


def ww_alpha(weight: torch.Tensor, dtype=torch.float32) -> float:
    """WeightWatcher's alpha for one matrix: eigenvalues by torch.linalg (see `eigenvalues`), fit by weightwatcher.

    With dtype=torch.float64 this equals `WeightWatcher().analyze()` on a CPU machine to ~1e-12;
    float32 eigenvalues move alpha by about 1e-5 relative (docs/alrs.md).
    """
    return ww_fit_alpha(eigenvalues(weight, dtype))


FIT_FNS = {"ww": ww_fit_alpha, "hill_median": hill_median_alpha}


# ----------------------------------------------------------------------------- which matrices, which groups


def unwrap(model: nn.Module) -> nn.Module:
    """The LoopedLM inside DDP (`.module`) and/or torch.compile (`._orig_mod`) wrappers."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model._orig_mod
    return model


def tuned_matrices(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every Linear weight (Global KV projections included), the embedding and the head,
    except matrices with fewer than MIN_EVALS eigenvalues (e.g. an MoE router)."""
    out = {}
    for mod_name, mod in unwrap(model).named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) and min(mod.weight.shape) >= MIN_EVALS:
            out[f"{mod_name}.weight"] = mod.weight
    return out


def group_of(name: str) -> str | None:
    """Logging group of a parameter name, one of GROUPS, or None for non-matrix parameters."""
    if name in TOP_NAMES:
        return "embedding/head"
    m = re.match(r"(encoder|decoder|blocks)\.\d+\.(attn|mlp)\.(\w+)", name)
    if m is None:
        return None
    where, part, leaf = m.groups()
    if leaf in ("wk_glob", "wv_glob"):
        return "global KV"
    kind = "attention" if part == "attn" else "FFN"
    return kind if where == "blocks" else f"{where} {kind}"


def group_means(values: dict[str, float]) -> dict[str, float]:
    """Mean value per logging group. (ours) Unweighted over the group's matrices."""
    by_group: dict[str, list] = {}
    for name, v in values.items():
        if (g := group_of(name)) is not None:
            by_group.setdefault(g, []).append(v)
    return {g: float(np.mean(by_group[g])) for g in GROUPS if g in by_group}


# ----------------------------------------------------------------------------- allocation


def multipliers_from_alphas(alphas: dict[str, float], lo=1.0, hi=5.0, top=()) -> dict[str, float]:
    """m_i = interp(alpha_i, [min alpha, max alpha], [lo, hi]); names in `top` get `hi` and do
    not enter min/max. Equal alphas all map to `lo`."""
    if not 0 < lo <= hi:
        raise ValueError(f"ALRS multiplier range needs 0 < lo <= hi, got lo={lo}, hi={hi}; e.g. --alrs-range 1 5")
    bad = [k for k, a in alphas.items() if not math.isfinite(a)]
    if bad:
        raise ValueError(f"non-finite alpha for {bad}; cannot allocate learning rates")
    ranged = {k: a for k, a in alphas.items() if k not in top}
    out = {k: hi for k in alphas if k in top}
    if ranged:
        a_min, a_max = min(ranged.values()), max(ranged.values())
        span = a_max - a_min
        out.update({k: lo + (hi - lo) * (a - a_min) / span if span > 0 else lo for k, a in ranged.items()})
    return {k: out[k] for k in alphas}


def matrix_alphas(model: nn.Module, fit: str = "ww") -> dict[str, float]:
    """alpha of every tuned matrix: eigenvalues on the weight's device, fit on the CPU."""
    fn = FIT_FNS[fit]
    return {name: fn(eigenvalues(w)) for name, w in tuned_matrices(model).items()}


def ramp(start: float, target: float, step: int, ramp_from: int, length: int) -> float:
    """Linear transition from `start` (at ramp_from) to `target` (at ramp_from + length)."""
    frac = 1.0 if length <= 0 else min(1.0, max(0.0, (step - ramp_from) / length))
    return start + (target - start) * frac


class ALRS:
    """The ALRS schedule as a trainer hook: `on_step` sets `group["lr_mult"]` for each
    tuned matrix's own optimizer group and returns the allocation record to log (else None);
    `state_dict` makes resume exact.

    Allocates at step `first_step` and every `every` steps after it while
    step <= phase·total_steps; each allocation ramps linearly over `ramp` steps from the
    current multipliers to the new targets; after the last ramp the multipliers stay fixed.
    """

    per_matrix = True  # tells the trainer to give every matrix its own optimizer group

    def __init__(self, total_steps: int, fit="ww", lo=1.0, hi=5.0, every=100, phase=0.2, ramp=50,
                 first_step=0, top=TOP_NAMES, skip=()):
        if fit not in FITS:
            raise ValueError(f"unknown ALRS fit {fit!r}; choose one of {', '.join(FITS)}")
        if every < 1 or ramp < 0 or not 0 <= phase <= 1 or total_steps < 1:
            raise ValueError(f"ALRS needs every >= 1, ramp >= 0, 0 <= phase <= 1 and total_steps >= 1; "
                             f"got every={every}, ramp={ramp}, phase={phase}, total_steps={total_steps}")
        multipliers_from_alphas({}, lo, hi)  # validates the range
        self.total_steps, self.fit, self.lo, self.hi = total_steps, fit, lo, hi
        self.every, self.phase, self.ramp_len, self.first_step = every, phase, ramp, first_step
        self.top = tuple(top)  # pinned at `hi`, outside the min/max; () allocates embedding and head like the rest
        self.skip = tuple(skip)  # fitted and logged, but left at 1x and outside the min/max (the paper's wording: TOP_NAMES)
        if set(self.top) & set(self.skip):
            raise ValueError(f"a matrix cannot be both pinned and skipped: {sorted(set(self.top) & set(self.skip))}")
        self.alphas: dict[str, float] = {}
        self.start: dict[str, float] = {}  # multipliers when the current ramp began
        self.target: dict[str, float] = {}
        self.ramp_from = first_step
        self.last_alloc: int | None = None

    def allocates_at(self, step: int) -> bool:
        k = step - self.first_step
        return k >= 0 and k % self.every == 0 and step <= self.phase * self.total_steps

    def multipliers(self, step: int) -> dict[str, float]:
        """Current multiplier of every tuned matrix seen so far (1.0 before the first allocation)."""
        return {k: ramp(self.start[k], self.target[k], step, self.ramp_from, self.ramp_len) for k in self.target}

    def retarget(self, step: int, targets: dict[str, float]):
        """Start a ramp at `step` from the current multipliers (1.0 if new) to `targets`."""
        current = self.multipliers(step)
        self.start = {k: current.get(k, 1.0) for k in targets}
        self.target, self.ramp_from = dict(targets), step

    def allocate(self, step: int, model: nn.Module) -> dict:
        """Fit alphas (rank 0 only under DDP, then broadcast), set new targets, start a ramp.
        Returns the record to log; its keys start with "alrs_" (alrs_step is the 0-based step index)."""
        t0 = time.perf_counter()
        names = list(tuned_matrices(model))
        ddp = dist.is_available() and dist.is_initialized()
        alphas = matrix_alphas(model, self.fit) if not ddp or dist.get_rank() == 0 else None
        if ddp and names:  # every rank gets rank 0's alphas, so all ranks use identical LRs
            device = next(unwrap(model).parameters()).device
            buf = torch.tensor([alphas[n] for n in names] if alphas else [0.0] * len(names), dtype=torch.float64, device=device)
            dist.broadcast(buf, src=0)
            alphas = dict(zip(names, buf.tolist()))
        tuned = {k: a for k, a in (alphas or {}).items() if k not in self.skip}
        self.retarget(step, multipliers_from_alphas(tuned, self.lo, self.hi, top=self.top))
        self.alphas, self.last_alloc = alphas or {}, step
        return dict(alrs_step=step, alrs_fit=self.fit, alrs_seconds=round(time.perf_counter() - t0, 3), alrs_alpha=self.alphas,
                    alrs_multiplier=self.target, alrs_group_mean=group_means(self.target), alrs_group_alpha=group_means(self.alphas))

    def describe(self, model: nn.Module) -> str:
        n, last = len(tuned_matrices(model)), int(self.phase * self.total_steps)
        return (f"ALRS: {n} matrices tuned (fewer than {MIN_EVALS} eigenvalues: not tuned), fit {self.fit}, multipliers "
                f"{self.lo:g}-{self.hi:g}, allocated every {self.every} steps up to step {last}, {self.ramp_len}-step ramps")

    def on_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        record = None
        if self.allocates_at(step) and step != self.last_alloc:
            check_groups(optimizer, tuned_matrices(model))
            record = self.allocate(step, model)
        current = self.multipliers(step)
        for group in optimizer.param_groups:
            if group.get("name") in current:
                group["lr_mult"] = current[group["name"]]
        return record

    def state_dict(self) -> dict:
        return dict(alphas=self.alphas, start=self.start, target=self.target, ramp_from=self.ramp_from,
                    last_alloc=self.last_alloc)

    def load_state_dict(self, state: dict):
        self.alphas, self.start, self.target = dict(state["alphas"]), dict(state["start"]), dict(state["target"])
        self.ramp_from, self.last_alloc = state["ramp_from"], state["last_alloc"]


class DecoderLRBoost:
    """The paper's Table 4b baseline that ALRS beats: one constant LR multiplier on every decoder matrix
    (Global KV projections included), no spectra, no schedule of its own; every other parameter keeps 1."""

    per_matrix = True

    def __init__(self, mult: float):
        if not (isinstance(mult, (int, float)) and math.isfinite(mult) and mult > 0):
            raise ValueError(f"the decoder LR multiplier must be a positive number, got {mult!r}; e.g. --dec-lr-mult 1.5")
        self.mult = float(mult)

    def on_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        names = [n for n, p in unwrap(model).named_parameters() if n.startswith("decoder.") and p.dim() >= 2]
        if not names:
            raise ValueError("a decoder LR boost needs a decoder; only arch='asymloop' has one")
        check_groups(optimizer, names)
        for group in optimizer.param_groups:
            group["lr_mult"] = self.mult if group.get("name") in names else 1.0
        return dict(dec_lr_mult=self.mult, dec_lr_matrices=len(names)) if step == 0 else None

    def state_dict(self) -> dict:
        return dict(mult=self.mult)

    def load_state_dict(self, state: dict):
        self.mult = state["mult"]


def check_groups(optimizer: torch.optim.Optimizer, names) -> None:
    """Each tuned matrix must sit alone in an optimizer group named after it."""
    sizes = {g.get("name"): len(g["params"]) for g in optimizer.param_groups}
    missing = [n for n in names if sizes.get(n) != 1]
    if missing:
        raise ValueError(f"ALRS needs one optimizer group per tuned matrix, named after it; none for {missing[:3]}"
                         f"{' ...' if len(missing) > 3 else ''}. Build groups with param_groups(model, wd, per_matrix=True)")


# ----------------------------------------------------------------------------- after training: plots


def multiplier_history(rows: list[dict], ramp_len: int, last_step: int) -> tuple[list[int], dict[str, list[float]]]:
    """Replay the logged allocations (metrics rows with "alrs_multiplier"): multipliers of every
    matrix at each breakpoint of the piecewise-linear schedule (allocations, ramp ends, last_step)."""
    by_step = {r["alrs_step"]: r["alrs_multiplier"] for r in rows if "alrs_multiplier" in r}
    replay = ALRS(total_steps=max(last_step, 1), ramp=ramp_len)
    steps, hist = [], {}
    for s in sorted(set(by_step) | {s + ramp_len for s in by_step} | {last_step}):
        if s in by_step:
            replay.retarget(s, by_step[s])
        for k, v in replay.multipliers(s).items():
            hist.setdefault(k, [1.0] * len(steps)).append(v)
        steps.append(s)
    return steps, hist


def decoder_encoder_ratios(multipliers: dict[str, float]) -> dict[str, float]:
    """Decoder-to-encoder mean LR ratio for attention and FFN (the schedule factor cancels)."""
    g = group_means(multipliers)
    return {kind: g[f"decoder {kind}"] / g[f"encoder {kind}"] for kind in ("attention", "FFN")
            if f"decoder {kind}" in g and f"encoder {kind}" in g}


def plot_alrs(rows: list[dict], ramp_len: int, last_step: int, path) -> dict[str, float]:
    """Plot multipliers over time and the decoder/encoder LR ratios; return the final ratios."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot state, the caller's backend is left alone

    steps, hist = multiplier_history(rows, ramp_len, last_step)
    at = [{k: v[i] for k, v in hist.items()} for i in range(len(steps))]
    means, ratios = [group_means(m) for m in at], [decoder_encoder_ratios(m) for m in at]
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    for v in hist.values():
        ax1.plot(steps, v, color="0.8", lw=0.6)
    for g in GROUPS:
        if g in means[-1]:
            ax1.plot(steps, [m[g] for m in means], lw=2, label=f"{g} (mean)")
    ax1.set(title="ALRS multipliers (grey: each matrix)", xlabel="step", ylabel="LR multiplier m_i")
    ax1.legend(fontsize=8)
    for kind in ("attention", "FFN"):
        if kind in ratios[-1]:
            ax2.plot(steps, [r[kind] for r in ratios], lw=2, label=f"{kind}: decoder / encoder")
    if ratios[-1]:
        ax2.axhline(1.5, color="k", ls="--", lw=1, label="paper: FFN about 1.5")
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no encoder/decoder split\n(dense or full_loop)", ha="center", va="center", transform=ax2.transAxes)
    ax2.set(title="Decoder-to-encoder mean LR ratio", xlabel="step", ylabel="ratio")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:  # a full disk: the path in the one-line error (train_minimal.py)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    return ratios[-1]


def report(out_dir, rows: list[dict], ramp_len: int, last_step: int) -> tuple[str, str] | None:
    """After training: alrs.png in out_dir and a one-line summary, or None if nothing was allocated."""
    if not any(r.get("alrs_multiplier") for r in rows):  # no allocation, or no matrix large enough to tune
        return None
    path = Path(out_dir) / "alrs.png"
    ratios = plot_alrs(rows, ramp_len, last_step, path)
    said = ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) or "n/a (no encoder/decoder)"
    return str(path), f"ALRS: final decoder/encoder mean LR ratio: {said} (the paper saw about 1.5 for FFN); plot {path}"


# ----------------------------------------------------------------------------- normalized stable rank (the paper's Figure 4)


def normalized_stable_rank(weight: torch.Tensor) -> float:
    """||W||_F^2 / (||W||_2^2 * min(rows, cols)), in (0, 1]: 1 for a flat spectrum, near 0 when one direction dominates."""
    w = weight.detach().float().to("cpu" if weight.device.type == "mps" else weight.device)  # MPS has no SVD kernel
    sv = torch.linalg.matrix_norm(w, ord=2)
    return float((w.square().sum() / (sv * sv * min(w.shape))).item())


def stable_rank_summary(model: nn.Module) -> dict[str, float]:
    """Mean normalized stable rank per group, as the paper's Figure 4 averages it: the local Q/K/V/O matrices
    ("... attention") and gate/up/down ("... FFN"), separately for encoder and decoder (Global KV, embedding, head and
    MoE experts excluded). Keys like "srank encoder FFN"; dense and full_loop models report "srank attention"/"srank FFN"."""
    ranks: dict[str, list[float]] = {}
    for name, p in unwrap(model).named_parameters():
        m = re.fullmatch(r"(encoder|decoder|blocks)\.\d+\.(attn|mlp)\.(wq|wk|wv|wo|gate|up|down)\.weight", name)
        if m is not None:
            where, part, _ = m.groups()
            kind = "attention" if part == "attn" else "FFN"
            ranks.setdefault(f"srank {kind}" if where == "blocks" else f"srank {where} {kind}", []).append(normalized_stable_rank(p))
    return {k: float(np.mean(v)) for k, v in sorted(ranks.items())}
