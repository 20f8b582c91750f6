"""Probes into a trained LoopedLM for the notebooks and experiments (read-only, no model changes).

    logit_lens(model, idx, targets, n_iter)      # loss when the head reads z_k, k = 1..K
    state_norms(model, idx, n_iter)              # ||z_k|| and ||z_k - z_{k-1}|| per iteration (and their ratio)
    state_change(model, idx, n_iter)             # the ratio ||z_k - z_{k-1}|| / ||z_k|| alone
    global_attention_share(model, idx, n_iter)   # (K, D) attention mass on Global KV per iteration, layer
    attention_maps(model, idx, n_iter)           # (K, D, B, H, N, 2N) every decoder attention, keys [Global; Local]
    chain_lookups(model, task, idx, n_iter)      # on ChainTask programs: where each right-hand side's query looks
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
def attention_maps(model, idx, n_iter: int | None = None) -> torch.Tensor:
    """(K, D, B, H, N, 2N) attention probabilities of every decoder layer at every iteration, over the keys
    [Global 0..N-1; Local 0..N-1]; a half the model lacks holds zeros (context none or additive: no Global keys;
    local_kv=False: no Local keys).

    Hooks each decoder layer's attention input and recomputes its scores from the layer's own
    modules (wq, wk, QKNorm, RoPE) and the Global keys it was handed, so the probe reads exactly what the
    model computes. Needs arch='asymloop'.
    """
    cfg = model.config
    if cfg.arch != "asymloop":
        raise ValueError(f"attention_maps needs arch='asymloop' (got {cfg.arch!r}): it reads the looped decoder's attention")
    maps = []

    def hook(attn, args):  # Attention.forward(x, rope, kv_glob, ...): a full forward from position 0
        x, rope, kv_glob = args[:3]
        q = rope(attn.q_norm(attn.heads(attn.wq(x))))  # (B, H, N, hd)
        n = q.size(-2)
        no_keys = q.new_full((*q.shape[:-1], n), float("-inf"))  # a missing half: no mass after the softmax
        k_glob = kv_glob[0] if kv_glob is not None else None
        k_loc = rope(attn.k_norm(attn.heads(attn.wk(x)))) if attn.has_local else None
        scores = torch.cat([no_keys if k is None else q @ k.transpose(-2, -1) for k in (k_glob, k_loc)], -1)
        scores = scores / math.sqrt(q.size(-1))  # (B, H, N, 2N)
        maps.append(scores.masked_fill(~joint_mask(n, q.device), float("-inf")).softmax(-1))

    handles = [blk.attn.register_forward_pre_hook(hook) for blk in model.decoder]
    try:
        model.states(idx, n_iter)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(maps).unflatten(0, (-1, cfg.n_dec))  # hooks fire layer by layer, iteration by iteration


def global_attention_share(model, idx, n_iter: int | None = None) -> torch.Tensor:
    """(K, D) mean share of each query's joint-softmax mass that lands on Global keys.

    Averaged over batch, heads and query positions. Needs arch='asymloop' with Global and Local KV.
    """
    cfg = model.config
    if cfg.arch != "asymloop" or cfg.context != "global_kv" or not cfg.local_kv:
        raise ValueError("global_attention_share needs arch='asymloop' with context='global_kv' and local_kv=True")
    maps = attention_maps(model, idx, n_iter)
    return maps[..., : idx.size(1)].sum(-1).mean((2, 3, 4))


def chain_back(task, idx) -> torch.Tensor:
    """(B, S, max_hops) on ChainTask programs: for statement s, the statement that defines the variable j hops back
    along its chain (j = 0: s itself; j = 1: the statement defining s's right-hand side; ...), -1 past the chain's start."""
    b, n = idx.shape
    s_count = n // 4  # "x=y;" per statement
    is_var = torch.tensor([c not in "0123456789" for c in task.chars])[idx[:, 2::4]]  # (B, S) right-hand side a variable?
    back = torch.full((b, s_count, task.max_hops), -1, dtype=torch.long)
    for i in range(b):
        defined_at = {v: s for s, v in enumerate(idx[i, 0::4].tolist())}  # each variable assigned once
        for s in range(s_count):
            t = s
            for j in range(task.max_hops):
                back[i, s, j] = t
                if not is_var[i, t]:
                    break
                t = defined_at[idx[i, 4 * t + 2].item()]
    return back


@torch.no_grad()
def chain_lookups(model, task, idx, n_iter: int | None = None) -> dict[str, torch.Tensor]:
    """Where each right-hand side's query (position 4s+2) looks, per iteration, decoder layer and head, on ChainTask
    programs idx (B, N):

        half:  (K, D, H, B, S, 2)      share on the Global and on the Local keys
        back:  (K, D, H, B, S, J, 2)   share on the right-hand side (position 4t+2) of statement t, the statement j
                                       hops back along the chain (chain_back), per half; j = 0 is the query's own
                                       position (at 1 hop: its own literal); 0 where the chain is shorter than j + 1
        stmt:  (K, D, H, B, S, J, 2)   the same for all four positions of statement t ("x=y;"; for j = 0 the query
                                       sees the first three, up to itself)

    Average over the statements of one hop count (task.batch's `hops` at the right-hand sides).
    """
    maps = attention_maps(model, idx, n_iter)  # (K, D, B, H, N, 2N)
    n = idx.size(1)
    q = maps[..., 2::4, :].unflatten(-1, (2, n)).transpose(2, 3)  # (K, D, H, B, S, 2, N): half, key position
    back = chain_back(task, idx)  # (B, S, J)
    b_idx, s_idx = torch.arange(idx.size(0))[:, None, None], torch.arange(n // 4)[None, :, None]
    valid = (back >= 0)[..., None, None, None, None]
    per_key = q.permute(3, 4, 6, 0, 1, 2, 5)  # (B, S, N, K, D, H, 2)
    rhs = per_key[b_idx, s_idx, 4 * back.clamp(min=0) + 2] * valid  # (B, S, J, K, D, H, 2)
    per_stmt = per_key.unflatten(2, (n // 4, 4)).sum(3)  # (B, S, S', K, D, H, 2)
    stmt = per_stmt[b_idx, s_idx, back.clamp(min=0)] * valid
    return dict(half=q.sum(-1), back=rhs.permute(3, 4, 5, 0, 1, 2, 6), stmt=stmt.permute(3, 4, 5, 0, 1, 2, 6))
