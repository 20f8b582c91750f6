"""Probes into a trained LoopedLM for the notebooks and experiments (read-only, no model changes).

    logit_lens(model, idx, targets, n_iter)      # loss when the head reads z_k, k = 1..K
    state_norms(model, idx, n_iter)              # ||z_k|| and ||z_k - z_{k-1}|| per iteration (and their ratio)
    state_change(model, idx, n_iter)             # the ratio ||z_k - z_{k-1}|| / ||z_k|| alone
    global_attention_share(model, idx, n_iter)   # (K, D) attention mass on Global KV per iteration, layer
"""

import math

import torch
import torch.nn.functional as F

from minimal_asymloop.model import joint_mask


@torch.no_grad()
def logit_lens(model, idx, targets, n_iter: int | None = None) -> list[float]:
    """Cross-entropy (nats) of the head applied to each iteration's state z_1..z_K.

    One forward at the largest K gives every smaller K: z_k does not depend on the total K.
    """
    losses = []
    for z in model.states(idx, n_iter):
        logits = model.logits(z).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1).item())
    return losses


@torch.no_grad()
def state_norms(model, idx, n_iter: int | None = None) -> dict[str, list[float]]:
    """Absolute sizes of the decoder state and of each iteration's update, mean over tokens:
    norm[k] = ||z_k|| for k = 0..K (z_0 is the decoder input) and step[k-1] = ||z_k - z_{k-1}|| for k = 1..K.

    Read them in absolute terms: a falling ratio step/norm can come from a growing ||z_k|| alone, so only a
    falling `step` says that the iterations move the state less and less.
    """
    cfg = model.config
    if cfg.arch == "dense":
        raise ValueError("state_norms needs a looped model (arch full_loop or asymloop); dense has one state")
    zs = model.states(idx, n_iter)
    if cfg.arch == "full_loop":
        z0 = model.embed(idx)
    else:
        h = model.embed(idx)
        for blk in model.encoder:
            h = blk(h, model.rope)
        z0 = torch.zeros_like(h) if cfg.context == "additive" else h
    zs = [z0, *zs]
    return dict(norm=[z.norm(dim=-1).mean().item() for z in zs],
                step=[(b - a).norm(dim=-1).mean().item() for a, b in zip(zs[:-1], zs[1:])],
                relative=[((b - a).norm(dim=-1) / b.norm(dim=-1)).mean().item() for a, b in zip(zs[:-1], zs[1:])])


def state_change(model, idx, n_iter: int | None = None) -> list[float]:
    """Relative change ||z_k - z_{k-1}|| / ||z_k|| for k = 1..K, mean over tokens (see state_norms for why the
    absolute sizes matter more)."""
    return state_norms(model, idx, n_iter)["relative"]


@torch.no_grad()
def global_attention_share(model, idx, n_iter: int | None = None) -> torch.Tensor:
    """(K, D) mean share of each query's joint-softmax mass that lands on Global keys.

    Hooks each decoder layer's attention input and recomputes its scores from the layer's own
    modules (wq, wk, QKNorm, RoPE), so the probe reads exactly what the model computes.
    Averaged over batch, heads and query positions. Needs arch='asymloop' with Global and Local KV.
    """
    cfg = model.config
    if cfg.arch != "asymloop" or cfg.context != "global_kv" or not cfg.local_kv:
        raise ValueError("global_attention_share needs arch='asymloop' with context='global_kv' and local_kv=True")
    shares = []

    def hook(attn, args):  # Attention.forward(x, rope, kv_glob, ...): a full forward from position 0
        x, rope, (k_glob, _) = args[:3]
        q = rope(attn.q_norm(attn.heads(attn.wq(x))))  # (B, H, N, hd)
        k_loc = rope(attn.k_norm(attn.heads(attn.wk(x))))
        n = q.size(-2)
        scores = torch.cat([q @ k_glob.transpose(-2, -1), q @ k_loc.transpose(-2, -1)], -1) / math.sqrt(q.size(-1))
        probs = scores.masked_fill(~joint_mask(n, q.device), float("-inf")).softmax(-1)  # (B, H, N, 2N)
        shares.append(probs[..., :n].sum(-1).mean().item())

    handles = [blk.attn.register_forward_pre_hook(hook) for blk in model.decoder]
    try:
        model.states(idx, n_iter)
    finally:
        for h in handles:
            h.remove()
    return torch.tensor(shares).view(-1, cfg.n_dec)  # hooks fire layer by layer, iteration by iteration
