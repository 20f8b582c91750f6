"""Notebook 06's build steps: the references `course.build.yours_or_reference` falls back on (the bulk edges, Hill's
alpha, the multipliers, the ramp), the wrong versions its checks must fail, and the optimizer step where ALRS's
multipliers meet AdamW: every matrix has its own parameter group, and each step the trainer sets
group["lr"] = base LR x group["lr_mult"] (trainer.optimizer_step). Adam's first step moves every entry with a gradient
by about its LR (m/√v = g/|g|), so one step shows each matrix's multiplier directly. Also section 6's table, ours
beside the paper's (beside_paper)."""

import copy

import numpy as np
import torch

from minimal_asymloop import alrs
from minimal_asymloop.optim import param_groups


def ref_set_lrs(optimizer, multipliers: dict, base_lr: float) -> None:
    """The reference: each group's LR = base LR x its matrix's multiplier (1 for a group with none, e.g. the vectors)."""
    for group in optimizer.param_groups:
        group["lr"] = base_lr * multipliers.get(group["name"], 1.0)


def first_step_sizes(model, tokens, set_lrs, multipliers: dict, base_lr: float = 1e-3, per_matrix: bool = True) -> dict:
    """{matrix name: median |ΔW| / base_lr over its entries with a gradient} after one AdamW step (no weight decay) on a
    copy of `model`, with LRs set by set_lrs(optimizer, multipliers, base_lr); the model itself is not changed."""
    net = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in net.named_parameters() if p.dim() >= 2}
    opt = torch.optim.AdamW(param_groups(net, 0.0, per_matrix), lr=base_lr)
    set_lrs(opt, multipliers, base_lr)
    _, loss = net(tokens[:, :-1], tokens[:, 1:], return_logits=False)
    loss.backward()
    opt.step()
    out = {}
    for n, p in net.named_parameters():
        if n in before:
            moved = (p.detach() - before[n]).abs()[p.grad != 0]
            out[n] = float(moved.median()) / base_lr
    return out


def check_step_sizes(set_lrs, model, tokens, multipliers: dict, per_matrix: bool = True) -> None:
    """Every tuned matrix moves by its multiplier x the base LR on Adam's first step (within 1%)."""
    got = first_step_sizes(model, tokens, set_lrs, multipliers, per_matrix=per_matrix)
    worst = max(multipliers, key=lambda n: abs(got[n] / multipliers[n] - 1))
    assert abs(got[worst] / multipliers[worst] - 1) < 0.01, \
        f"{worst}: moved {got[worst]:.2f} x the base LR, its multiplier is {multipliers[worst]:.2f}"


def ref_mp_edges(sigma2: float, n: int, m: int) -> tuple[float, float]:
    """The Marchenko–Pastur bulk [λ−, λ+] of WᵀW for W (n × m) with i.i.d. entries of variance σ²."""
    return sigma2 * (n ** 0.5 - m ** 0.5) ** 2, sigma2 * (n ** 0.5 + m ** 0.5) ** 2


def ref_hill(e, i: int) -> float:
    """The Hill estimator of a power-law tail with xmin = e[i] (e sorted ascending)."""
    tail = np.asarray(e[i:], dtype=np.float64)
    return float(1 + len(tail) / np.log(tail / e[i]).sum())


def ref_multipliers(alphas: dict, top=None, lo: float = 1.0, hi: float = 5.0) -> dict:
    """ALRS's map, the package's own (alrs.multipliers_from_alphas): a line from the smallest block alpha (lo) to the
    largest (hi); the `top` names (default: the pinned embedding and head) are set to hi and stay out of the min and max."""
    return alrs.multipliers_from_alphas(alphas, lo, hi, top=alrs.TOP_NAMES if top is None else top)


def no_pin(alphas: dict, lo: float = 1.0, hi: float = 5.0) -> dict:
    """A wrong allocation for notebook 06's check: every matrix on the line by its own alpha, the pinned names too."""
    r = [v for k, v in alphas.items() if k not in alrs.TOP_NAMES]
    return {k: lo + (hi - lo) * (v - min(r)) / (max(r) - min(r)) for k, v in alphas.items()}


def ref_ramp(start: float, target: float, step: int, ramp_from: int, length: int) -> float:
    """Linear from start (at ramp_from) to target over `length` steps, then flat at target: the package's alrs.ramp."""
    return alrs.ramp(start, target, step, ramp_from, length)


def wrong_fails(check, wrong, label: str) -> None:
    """Run a build step's `check` on a wrong version: print the line it fails with; raise if the check lets it pass."""
    try:
        check(wrong)
    except AssertionError as err:
        print(f"wrong version, {label}: fails the check ({err})")
        return
    raise AssertionError(f"{label}: the check let a wrong version pass")


def noise_and_signal(gen: torch.Generator, n: int = 384, m: int = 128, r: int = 32) -> list:
    """Section 1's pair, drawn from `gen`: the eigenvalues of a Gaussian n x m matrix (entries of variance 1/n) and of
    the same matrix plus a "learned" signal of r directions, direction i of strength 3/√i (a power law)."""
    noise = torch.randn(n, m, generator=gen) / n ** 0.5
    strengths = 3 * torch.arange(1, r + 1) ** -0.5
    signal = (torch.randn(n, r, generator=gen) * strengths) @ torch.randn(r, m, generator=gen) / (n * m) ** 0.5
    return [alrs.eigenvalues(W, torch.float64) for W in (noise, noise + signal)]


def beside_paper(res: dict, diff, at1x) -> str:
    """Section 6's rows: layerwise minus uniform LR in the paper (Table 4 at 60M, PPL; Table 8's Dense, CE) beside ours
    (diff: pinned ALRS minus uniform per seed; at1x: ALRS at 1x minus uniform), each with its setting."""
    import math

    ppl = lambda a, b: f"PPL {b:.3f} -> {a:.3f}: {math.log(a / b):+.4f} nats"  # noqa: E731
    b = res["setting"]["budget"]
    rows = [("paper, Table 4, 60M AsymLoop K=3", "QKNorm, FineWeb-Edu, 'the default base learning rate'", ppl(23.751, 24.727)),
            ("paper, Table 4, 60M AsymLoop K=5", "as above", ppl(23.580, 24.619)),
            ("paper, Table 8, Dense, depth 6", "'a common evaluation protocol' (Appendix C.3)", f"CE {3.209192 - 3.271820:+.4f} nats"),
            ("ours, AsymLoop K=3, ALRS pinned", f"{b['tokens'] / 1e6:.2f}M tokens ({b['tokens_per_param']:.2f}/param), QKNorm, "
             "Python stdlib code, base LR tuned per arm", f"val loss {diff.mean():+.4f} ± {diff.std(ddof=1):.4f} nats ({len(diff)} seeds)"),
            ("ours, ALRS at 1×", "as above", f"val loss {at1x.mean():+.4f} ± {at1x.std(ddof=1):.4f} nats")]
    return "\n".join(f"{who}: layerwise - uniform {result}\n  ({setting})" for who, setting, result in rows)
