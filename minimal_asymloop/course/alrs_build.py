"""Notebook 06's optimizer build: where ALRS's multipliers meet AdamW. Every matrix has its own parameter group; each
step the trainer sets group["lr"] = base LR x group["lr_mult"] (trainer.optimizer_step). Adam's first step moves every
entry with a gradient by about its LR (m/√v = g/|g|), so one step shows each matrix's multiplier directly."""

import copy

import torch

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
