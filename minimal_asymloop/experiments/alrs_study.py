"""The ALRS study of notebook 06, fairly: a base-LR sweep for uniform LR and for ALRS, then controls at the best LRs
(the uniform LR scaled by ALRS's mean multiplier, embedding/head unpinned, the hill_median fit, uniform LR with
only embedding and head at ALRS's top multiplier, and the paper's Table 4b decoder LR boost), at >= 3 seeds each; and
ALRS as we read the paper's words (encoder and decoder matrices only, embedding and head at 1x), with its own sweep.
"""

import time

import numpy as np
import torch

from minimal_asymloop.alrs import TOP_NAMES
from minimal_asymloop.checkpoint import load_model
from minimal_asymloop.config import TrainConfig
from minimal_asymloop.experiments import common
from minimal_asymloop.experiments.common import RUNS, committed, describe_budget, train_lm, write_json
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.paths import DATA_CACHE, RESULTS
from minimal_asymloop.sources import source_identity

# (ours) the LM setting of the ALRS study, sized so that 3 seeds x (2 arms x 3 base LRs + 3 controls) runs of >= 2 tokens
# per parameter fit about an hour of one shared CPU core: AsymLoop K=3, d_model 64 (so every matrix has >= 64 eigenvalues,
# enough to fit), L = 4 (E = D = 2), d_ff 128, a 512-token BPE, batch 16 x seq 128, QKNorm on; 246,560 parameters
ALRS_LM = dict(n_layer=4, d_model=64, n_head=4, d_ff=128, vocab_size=512, max_seq_len=128, qk_norm=True)
ALRS_TRAIN = dict(data="stdlib", tokenizer="bpe", bpe_vocab=512, data_cache=DATA_CACHE, seq_len=128, global_batch=16,
                  eval_batches=16, quiet=True, device="cpu", dtype="float32")
# (ours) the paper's schedule (allocate every 100 steps, 50-step ramps, freeze after 20% of training) scaled to a
# 250-step run: allocations at steps 0, 10, ..., 50, each reached by a 5-step ramp, then frozen
ALRS_SCHEDULE = dict(alrs_every=10, alrs_ramp=5, alrs_phase=0.2)
ALRS_STEPS = 250  # (ours) 16 x 128 x 250 = 512K tokens: 2.08 tokens/param at this setting
# base-LR grids (ours): ALRS multiplies the base LR by 1-5, so its grid sits one octave lower; an arm whose best LR
# lands on the edge of its grid gets one more LR beyond that edge before the controls run
ALRS_LRS = {"uniform": (2.5e-3, 5e-3, 1e-2), "alrs": (1.25e-3, 2.5e-3, 5e-3), "alrs_blocks": (1.25e-3, 2.5e-3, 5e-3)}
SPECTRA = ("decoder.0.mlp.up.weight", "encoder.0.attn.wq.weight")  # matrices whose eigenvalues are stored


def alrs_records(rows: list[dict]) -> list[dict]:
    """The allocations logged in a run's metrics, as {step, alpha, multiplier}."""
    return [dict(step=r["alrs_step"], alpha=r["alrs_alpha"], multiplier=r["alrs_multiplier"]) for r in rows if "alrs_multiplier" in r]


class PinnedTop:
    """Control (ours): uniform LR for every matrix except embedding and head, which get ALRS's top multiplier,
    reached by ALRS's ramp from step 0 and then kept; the one thing ALRS does that needs no spectrum."""

    per_matrix = True

    def __init__(self, hi: float, ramp_len: int, names=TOP_NAMES):
        self.hi, self.ramp_len, self.names = hi, ramp_len, tuple(names)

    def on_step(self, step, model, optimizer):
        from minimal_asymloop import alrs

        mult = alrs.ramp(1.0, self.hi, step, 0, self.ramp_len)
        for group in optimizer.param_groups:
            if group.get("name") in self.names:
                group["lr_mult"] = mult
        return dict(pinned_top=self.hi) if step == 0 else None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict):
        pass


ARMS = ("uniform", "alrs", "alrs_hill", "alrs_unpinned", "alrs_blocks", "uniform_top", "decoder_boost", "uniform_top_embed",
        "uniform_top_head")
PINS = {"uniform_top": TOP_NAMES, "uniform_top_embed": TOP_NAMES[:1], "uniform_top_head": TOP_NAMES[1:]}  # the matrices pinned


def arm_setup(arm: str, lr: float, seed: int, steps: int, out_dir, dec_mult: float | None = None, **train):
    """(ModelConfig, TrainConfig, lr_hook) of one arm of the study at base LR `lr` and `seed`, `steps` long, writing
    to `out_dir`; `train` overrides TrainConfig fields (notebook 06's live runs: stop_step, device). The lr_hook is None
    for the arms the trainer builds itself (uniform, every ALRS arm through alrs_fit and alrs_top, decoder_boost through
    dec_lr_mult); the pins' (uniform_top: embedding and head; uniform_top_embed, uniform_top_head: one of them) is PinnedTop."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    on = arm not in ("uniform", "decoder_boost", *PINS)
    # alrs_unpinned: embedding and head allocated by their alphas; alrs_blocks: left at 1x, the paper's wording (Section
    # 3.3: "individual weight matrices in the encoder and decoder"); the other ALRS arms pin them, as He et al.'s code
    top = {"alrs_unpinned": "fit", "alrs_blocks": "base"}.get(arm, "pin")
    extra = dict(alrs=True, **ALRS_SCHEDULE, alrs_fit="hill_median" if arm == "alrs_hill" else "ww", alrs_top=top) if on \
        else dict(alrs=False)
    if arm == "decoder_boost":  # the trainer builds alrs.DecoderLRBoost from dec_lr_mult
        extra["dec_lr_mult"] = dec_mult
    train_cfg = TrainConfig(**{**ALRS_TRAIN, **extra, "lr": lr, "max_steps": steps, "eval_interval": steps, "seed": seed,
                               "out_dir": str(out_dir), **train})
    # uniform LR, except what ALRS pins: embedding and head at its top multiplier
    hook = PinnedTop(train_cfg.alrs_hi, ALRS_SCHEDULE["alrs_ramp"], PINS[arm]) if arm in PINS else None
    return ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM), train_cfg, hook


def alrs_arm(arm: str, lr: float, seed: int, steps: int, dec_mult: float | None = None) -> dict:
    """One run of the ALRS study: arm is uniform, alrs (ww fit), alrs_hill (hill_median fit), alrs_unpinned
    (embedding and head allocated like every other matrix), alrs_blocks (embedding and head left at 1x), uniform_top
    (uniform LR with embedding and head at the top multiplier; uniform_top_embed, uniform_top_head: one of the two)
    or decoder_boost (every decoder matrix at dec_mult x the
    base LR, the rest at 1x: Table 4b's baseline). Cached in out/experiments/ by arm, LR and seed."""
    from minimal_asymloop import alrs

    out_dir = RUNS / f"alrs_study-{arm}{'' if dec_mult is None else f'{dec_mult:.3g}'}-lr{lr:.3g}-s{seed}"
    cfg, train_cfg, hook = arm_setup(arm, lr, seed, steps, out_dir, dec_mult)
    result, model = train_lm(cfg, train_cfg, hook, reuse=True)
    history = result["history"]
    records = alrs_records(history)
    final = records[-1]["multiplier"] if records else {}
    sizes = {n: w.numel() for n, w in alrs.tuned_matrices(model).items()}
    row = dict(arm=arm, lr=lr, seed=seed, **({} if dec_mult is None else dict(dec_lr_mult=dec_mult)),
               val_loss=result["val_loss"], seconds=result["seconds"],
               train_loss=[(r["step"], r["loss"]) for r in history if "loss" in r and r["step"] % 5 == 0],
               **describe_budget(cfg, train_cfg), **alrs.stable_rank_summary(model))
    if final:
        row.update(final_multiplier=final, group_multiplier=alrs.group_means(final), ratios=alrs.decoder_encoder_ratios(final),
                   mean_multiplier=float(np.mean(list(final.values()))),
                   param_weighted_multiplier=float(sum(final[n] * sizes[n] for n in final) / sum(sizes[n] for n in final)),
                   alrs_records=records, alloc_seconds=sum(r.get("alrs_seconds", 0.0) for r in history))
    print(f"  {arm:>14} lr {lr:.3g} seed {seed}: val loss {row['val_loss']:.4f}  ({row['seconds']:.0f}s)", flush=True)
    return row


def best_lr(runs: list[dict], arm: str, seeds, grid=None) -> float | None:
    """The arm's base LR with the lowest mean val loss over `seeds`, among the LRs of `grid` (None: any) that have every seed."""
    by_lr: dict[float, dict] = {}
    for r in runs:
        if r["arm"] == arm and (grid is None or r["lr"] in grid):
            by_lr.setdefault(r["lr"], {})[r["seed"]] = r["val_loss"]
    full = {lr: np.mean([v[s] for s in seeds]) for lr, v in by_lr.items() if all(s in v for s in seeds)}
    return min(full, key=full.get) if full else None


def beyond_edge(best: float, grid) -> float | None:
    """One base LR past the grid's edge when `best` sits on it (half the lowest, twice the highest), else None."""
    return best / 2 if best == min(grid) else best * 2 if best == max(grid) else None


def alrs_experiment(quick=False):
    """AsymLoop K=3, uniform LR vs ALRS: base-LR sweep for each, then controls at the best LRs, >= 3 seeds each."""

    steps, seeds = (30, common.SEEDS[:1]) if quick else (common.STEPS_SET or ALRS_STEPS, common.SEEDS)
    lrs = {arm: grid[1:2] if quick else grid for arm, grid in ALRS_LRS.items()}
    runs: list[dict] = []
    state: dict = {}  # best LRs, spectra, the scaled-uniform LR: filled in as the queue gets there
    t_start = time.time()
    # runs committed at this setting are reused (the grids may have grown at an edge, and runs are per seed)
    old = None if quick else committed("alrs", setting_of(steps, seeds, lrs), ignore=("lr_grids", "seeds", "regenerate"))
    if old:
        runs += old["runs"]
        lrs.update({arm: tuple(grid) for arm, grid in old["setting"]["lr_grids"].items()})  # a new arm keeps its grid

    def result(partial=False):
        best = {arm: best_lr(runs, arm, seeds, lrs[arm]) for arm in ("uniform", "alrs")}  # the sweep's LRs with every seed
        return dict(setting=setting_of(steps, seeds, lrs), best_lr=best, **state, runs=runs, partial=partial,
                    seconds=time.time() - t_start)

    def run(arm, lr, seed, **kw):
        if not any((r["arm"], r["lr"], r["seed"]) == (arm, lr, seed) for r in runs):
            runs.append(alrs_arm(arm, lr, seed, steps, **kw))
            if not quick:  # a partial result after every run, so finished groups can be used before the rest is done
                write_json(RESULTS / "alrs.json", result(partial=True))

    # The order (ours) puts first what a cut-short queue most needs: (a) every LR of both grids at the first seed (plus
    # one LR beyond an edge that wins), then the other seeds at each arm's best LR of the first seed, so the arms can be
    # compared at their own best over every seed; (b) the uniform LR scaled by ALRS's mean multiplier, then embedding/head
    # unpinned; (a) every LR at every seed, nearest each arm's best first; (b) the hill_median fit.
    first = seeds[:1]
    for arm in ("uniform", "alrs"):
        for lr in lrs[arm]:
            run(arm, lr, first[0])
    for arm in ("uniform", "alrs"):  # a best LR on the grid's edge: one more LR beyond it
        if not quick and (extra := beyond_edge(best_lr(runs, arm, first, lrs[arm]), lrs[arm])):
            lrs[arm] = tuple(sorted((*lrs[arm], extra)))
            run(arm, extra, first[0])
    best0 = {arm: best_lr(runs, arm, first, lrs[arm]) for arm in ("uniform", "alrs")}
    state["best_lr_first_seed"] = best0
    for seed in seeds[1:]:
        for arm in ("uniform", "alrs"):
            run(arm, best0[arm], seed)
    reuse_spectra = old and old.get("best_lr_first_seed") == best0 and "spectra" in old
    state["spectra"] = old["spectra"] if reuse_spectra else alrs_spectra(best0, first[0])
    mean_mult = float(np.mean([r["mean_multiplier"] for r in runs if r["arm"] == "alrs" and r["lr"] == best0["alrs"]]))
    state.update(mean_multiplier=mean_mult, scaled_uniform_lr=float(f"{best0['alrs'] * mean_mult:.3g}"))
    for seed in seeds:
        run("uniform", state["scaled_uniform_lr"], seed)
    for seed in seeds:
        run("alrs_unpinned", best0["alrs"], seed)
    rest = sorted(((arm, lr) for arm in ("uniform", "alrs") for lr in lrs[arm]), key=lambda a: abs(np.log(a[1] / best0[a[0]])))
    for arm, lr in rest:  # both arms' LRs, nearest to each arm's best first
        for seed in seeds:
            run(arm, lr, seed)
    for seed in seeds:
        run("alrs_hill", best0["alrs"], seed)
    for seed in seeds:  # is the gain ALRS's spectra, or only its pinned embedding/head LR?
        run("uniform_top", best0["uniform"], seed)
    # (ours) Table 4b's fixed decoder LR boost; the paper gives no multiplier, so the decoder gets ALRS's mean multiplier
    # (the scaled-uniform control's factor), the encoder, embedding and head 1x: the decoder's LR rise without the spectra
    state["decoder_boost_mult"] = float(f"{mean_mult:.3g}")
    for seed in seeds:
        run("decoder_boost", best0["uniform"], seed, dec_mult=state["decoder_boost_mult"])
    # ALRS as we read the paper's words ("individual weight matrices in the encoder and decoder", Section 3.3): embedding and
    # head fitted and logged but left at 1x; its own sweep, since the other arms' best LRs need not be its own
    for lr in lrs["alrs_blocks"]:
        for seed in seeds:
            run("alrs_blocks", lr, seed)
    if not quick and (extra := beyond_edge(best_lr(runs, "alrs_blocks", seeds, lrs["alrs_blocks"]), lrs["alrs_blocks"])):
        lrs["alrs_blocks"] = tuple(sorted((*lrs["alrs_blocks"], extra)))  # its best on the edge: one more LR, every seed
        for seed in seeds:
            run("alrs_blocks", extra, seed)
    for arm in ("uniform_top_embed", "uniform_top_head"):  # which of the two pinned matrices carries the pin's gain?
        for seed in seeds:
            run(arm, best0["uniform"], seed)
    return result()


def setting_of(steps: int, seeds, lrs: dict) -> dict:
    """The ALRS study's setting, as recorded in its JSON."""
    cfg = ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM)
    budget = describe_budget(cfg, TrainConfig(**{**ALRS_TRAIN, "max_steps": steps}))
    return dict(model=dict(ALRS_LM, arch="asymloop", n_iter=3, n_enc=cfg.n_enc),
                train={k: v for k, v in ALRS_TRAIN.items() if k != "data_cache"}, steps=steps, seeds=list(seeds),
                schedule=ALRS_SCHEDULE, lr_grids=lrs, budget=dict(budget, steps=steps),
                data_identity=source_identity("stdlib", None),
                regenerate=f"python -m minimal_asymloop.experiments alrs --seeds {' '.join(map(str, seeds))} --steps {steps}")


def alrs_spectra(best: dict, seed: int) -> dict:
    """Alphas (both fits), two matrices' eigenvalues and the stable rank at init and after training at each arm's best LR."""
    from minimal_asymloop import alrs

    cfg = ModelConfig(arch="asymloop", n_iter=3, **ALRS_LM)
    torch.manual_seed(seed)
    models = {"init": LoopedLM(cfg)}
    for arm in ("uniform", "alrs"):
        models[arm], _, _ = load_model(RUNS / f"alrs_study-{arm}-lr{best[arm]:.3g}-s{seed}")
    out = {}
    for tag, model in models.items():
        mats = alrs.tuned_matrices(model)
        out[tag] = dict(alpha_ww={n: alrs.ww_alpha(w) for n, w in mats.items()},
                        alpha_hill={n: alrs.hill_median_alpha(alrs.eigenvalues(w)) for n, w in mats.items()},
                        eigenvalues={n: alrs.eigenvalues(mats[n]).tolist() for n in SPECTRA},
                        stable_rank=alrs.stable_rank_summary(model), best_lr=best.get(tag))
    return out
