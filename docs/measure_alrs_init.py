"""The figures of docs/alrs.md about the fits at initialisation, on the `tiny` AsymLoop model as the trainer builds it.

    python docs/measure_alrs_init.py      # a few minutes on a CPU (WeightWatcher's analyze() is the slow part)

Prints: the step-0 decoder/encoder LR ratios of a `ww` allocation, the range of `ww` alphas, the
`hill_median` alphas by matrix shape, how far float32 eigenvalues move alpha, the fit's own error
(alpha - 1)/sqrt(n_tail), and the agreement of `alrs.ww_alpha` (float64) with `WeightWatcher().analyze()`.
"""

import warnings

import numpy as np
import torch

from minimal_asymloop import alrs
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.trainer import TrainConfig


def main():
    torch.set_num_threads(1)  # a few small SVDs: more threads only add contention
    torch.manual_seed(TrainConfig.from_preset("tiny").seed)  # the trainer seeds, then builds the model
    model = LoopedLM(ModelConfig.from_preset("tiny", "asymloop"))
    mats = {k: v.detach() for k, v in alrs.tuned_matrices(model).items()}
    print(f"tiny AsymLoop K=3 at initialisation: {len(mats)} tuned matrices")

    rec = alrs.ALRS(total_steps=200, fit="ww").allocate(0, model)
    ratios = alrs.decoder_encoder_ratios(rec["alrs_multiplier"])
    print("step-0 ww allocation, decoder/encoder mean LR: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    alphas = rec["alrs_alpha"]
    print(f"ww alphas: {min(alphas.values()):.1f} to {max(alphas.values()):.1f}")

    by_shape: dict[tuple, list[float]] = {}
    for name, a in alrs.matrix_alphas(model, "hill_median").items():
        by_shape.setdefault(tuple(mats[name].shape), []).append(a)
    for shape, a in sorted(by_shape.items()):
        print(f"hill_median alphas of the {shape[0]}x{shape[1]} matrices: {min(a):.2f} to {max(a):.2f}")

    watcher = alrs.weightwatcher_module().WeightWatcher()
    rel, err, n_tail = [], [], []
    for w in mats.values():
        e64 = alrs.eigenvalues(w, torch.float64)
        a64 = alrs.ww_fit_alpha(e64)
        rel.append(abs(alrs.ww_fit_alpha(alrs.eigenvalues(w)) - a64) / a64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            alpha, _, xmin, *_ = watcher.fit_powerlaw(e64, plot=False, savefig=False)
        n = int((e64 >= xmin).sum())
        n_tail.append(n)
        err.append((alpha - 1) / np.sqrt(n))
    print(f"float32 vs float64 eigenvalues: alpha moves by at most {max(rel):.1e} relative")
    print(f"fit error (alpha - 1)/sqrt(n_tail): {min(err):.2f} to {max(err):.2f}, median {np.median(err):.2f}; "
          f"median tail {np.median(n_tail):.0f} eigenvalues")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pandas deprecation warnings inside weightwatcher
        details = watcher.analyze(mats, plot=False)
    worst = max(abs(alrs.ww_alpha(mats[r["name"] + ".weight"], torch.float64) - r["alpha"]) / r["alpha"] for _, r in details.iterrows())
    print(f"alrs.ww_alpha (float64) vs WeightWatcher().analyze(): at most {worst:.0e} relative over {len(details)} matrices")


if __name__ == "__main__":
    main()
