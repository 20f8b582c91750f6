"""The optimizer's parameter groups and the LR schedule: AdamW groups (weight decay on matrices only), the warmup +
cosine schedule, and the run's LR hook (ALRS, the paper's fixed decoder LR boost, or none).
"""

import math

import torch

from minimal_asymloop import alrs
from minimal_asymloop.config import TrainConfig, alrs_hook
from minimal_asymloop.system import ConfigError


def make_alrs(cfg: TrainConfig, arch: str) -> alrs.ALRS | alrs.DecoderLRBoost | None:
    """The run's lr_hook: ALRS (on by default for asymloop only, as in the paper), the fixed decoder
    LR boost of the paper's Table 4b when dec_lr_mult is set, or None (one LR for every matrix)."""
    if cfg.dec_lr_mult is not None:
        if arch != "asymloop":
            raise ConfigError(f"dec_lr_mult boosts the decoder, which only arch='asymloop' has (got {arch!r})")
        return alrs.DecoderLRBoost(cfg.dec_lr_mult)
    return alrs_hook(cfg) if (cfg.alrs if cfg.alrs is not None else arch == "asymloop") else None




def param_groups(model: torch.nn.Module, weight_decay: float, per_matrix: bool = False) -> list[dict]:
    """AdamW groups: weight decay on matrices (dim >= 2) only. per_matrix=True gives every matrix its
    own group (for ALRS). Every group has a "name" and an "lr_mult"; the trainer sets
    group["lr"] = lr_at(step) * group["lr_mult"] each step."""
    matrices = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    if per_matrix:
        groups = [dict(name=n, params=[p], weight_decay=weight_decay, lr_mult=1.0) for n, p in matrices]
    else:
        groups = [dict(name="matrices", params=[p for _, p in matrices], weight_decay=weight_decay, lr_mult=1.0)]
    return groups + [dict(name="vectors", params=vectors, weight_decay=0.0, lr_mult=1.0)]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Peak cfg.lr after a linear warmup over warmup_frac of training, then cosine down to min_lr_ratio x peak."""
    total = cfg.total_steps()
    warmup = max(1, round(cfg.warmup_frac * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - lo)
