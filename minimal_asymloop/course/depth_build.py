"""Notebook 02's build steps: the references for the lines it ships unwritten (course.build.yours_or_reference
hands them back where the reader's version fails its check)."""

import numpy as np
import torch.nn.functional as F

from minimal_asymloop.model import causal_attention, joint_attention


def global_kv(a, h_norm, rope):
    """(K^G_l, V^G_l) of the decoder block whose attention is `a`, from RMSNorm(H): its own W_K^G, W_V^G; QKNorm
    on the keys, followed by RoPE (Section 3.2); the values only projected."""
    return rope(a.k_glob_norm(a.heads(a.wk_glob(h_norm)))), a.heads(a.wv_glob(h_norm))


def block(blk, z, kv_g, rope):
    """One pre-norm decoder block on z_{k-1}: queries and Local KV from z_{k-1}; one softmax over [K^G ; K^L]
    (joint attention), or over Local KV only (causal) where kv_g is None."""
    a, h = blk.attn, blk.attn_norm(z)
    q = rope(a.q_norm(a.heads(a.wq(h))))
    k_loc, v_loc = rope(a.k_norm(a.heads(a.wk(h)))), a.heads(a.wv(h))
    y = causal_attention(q, k_loc, v_loc) if kv_g is None else joint_attention(q, *kv_g, k_loc, v_loc)
    z = z + a.wo(y.transpose(1, 2).flatten(2))
    return z + blk.mlp(blk.mlp_norm(z))


def lens_losses(m, zs, targets) -> list[float]:
    """The logit lens on states zs: the final norm and the head on each (m.logits), cross-entropy to the targets."""
    return [F.cross_entropy(m.logits(z).flatten(0, 1), targets.flatten(), ignore_index=-1).item() for z in zs]


def within(runs, a: str, b: str) -> np.ndarray:
    """Reference for the reader's build: a's final validation loss minus b's, within seed (one value per seed)."""
    return runs.loss(a) - runs.loss(b)


def dec(z, kv, m):
    """z_k = Dec(z_{k-1}; K^G, V^G): decoder block l of model m on z, reading its own Global KV pair kv[l]."""
    for blk, kv_g in zip(m.decoder, kv):
        z = block(blk, z, kv_g, m.rope)
    return z


def unroll(m, H, kv, n_iter: int) -> list:
    """[z_1, ..., z_K]: z_0 = H, then K decoder iterations, each reading the same Global KV `kv`."""
    zs, z = [], H
    for _ in range(n_iter):
        z = dec(z, kv, m)
        zs.append(z)
    return zs


def unroll_kv_from_state(m, H, kv, n_iter: int) -> list:
    """A wrong wiring for notebook 02's check: Global KV remade from the state z_{k-1} at every k, not from H."""
    zs, z = [], H
    for _ in range(n_iter):
        z = dec(z, [global_kv(b.attn, m.enc_norm(z), m.rope) for b in m.decoder], m)
        zs.append(z)
    return zs
