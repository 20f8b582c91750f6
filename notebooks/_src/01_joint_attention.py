# %% [markdown]
# # 01 · Joint attention: one softmax over Global and Local keys
#
# The one new operation in AsymLoop is **joint attention**. In every iteration `k` of the looped
# decoder, decoder layer `l` attends to two sets of keys at once:
#
# - **Global KV** `(K_glob_l, V_glob_l)`: projections of the *encoder output* `H`, computed once per
#   forward pass and reused, unchanged, by every iteration;
# - **Local KV** `(K_loc, V_loc)`: the usual keys and values of the decoder's *current state* `z_{k-1}`,
#   recomputed every iteration.
#
# Query `i` sees global keys `j ≤ i` and local keys `j ≤ i` under **one** softmax over those `2(i+1)` scores.
#
# In this notebook you will:
# 1. see where each key source comes from in `minimal_asymloop.model` and what shapes it has;
# 2. draw the `(N, 2N)` score matrix and its `(kv mod N) ≤ q` mask;
# 3. see numerically why one softmax is a different model from two softmaxes;
# 4. check what QKNorm and RoPE do to both key sources;
# 5. build joint attention naively, one query at a time, and assert it equals the package's fast
#    `joint_attention` and its `joint_attention_reference`, forward and backward;
# 6. measure, in a trained tiny AsymLoop model, how much attention mass goes to Global vs Local keys,
#    per decoder layer and per iteration.
#
# Everything runs on a CPU in about a minute.

# %%
import math

import matplotlib.pyplot as plt
import torch

from minimal_asymloop.model import (
    LoopedLM,
    ModelConfig,
    joint_attention,
    joint_attention_masked,
    joint_attention_reference,
    joint_mask,
    merge_by_lse,
)

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## 1. Where Global KV and Local KV come from
#
# A small AsymLoop model: `L = 4` blocks split into an encoder of `E = 2` blocks run once and a
# decoder of `D = 2` blocks run `K = 3` times with shared weights (effective depth `E + K·D = 8`).
# Each decoder layer owns two extra projections `wk_glob`, `wv_glob` (`d → d`) that turn the normed
# encoder output into that layer's Global KV.

# %%
# NBVAL_CHECK_OUTPUT
cfg = ModelConfig(arch="asymloop", n_layer=4, d_model=64, n_head=4, d_ff=128, vocab_size=128, max_seq_len=64)
model = LoopedLM(cfg).eval()
print(f"E={cfg.n_enc} encoder blocks, D={cfg.n_dec} decoder blocks, K={cfg.n_iter}, effective depth {cfg.effective_depth}")
print("decoder layer 0 attention modules:")
for name, mod in model.decoder[0].attn.named_children():
    print(f"  {name:12s} {mod}")

# %% [markdown]
# `LoopedLM.global_kv(H)` runs once per forward pass: one shared RMSNorm on `H` (ours), then per decoder
# layer its own projections, QKNorm on the keys and RoPE. Shapes are `(B, heads, N, head_dim)`.

# %%
# NBVAL_CHECK_OUTPUT
B, N = 2, 12
idx = torch.randint(0, cfg.vocab_size, (B, N))
with torch.no_grad():
    h = model.embed(idx)
    for blk in model.encoder:  # H = Enc(embed(x)), run once
        h = blk(h, model.rope)
    kv_glob = model.global_kv(h)  # one (K_glob, V_glob) per decoder layer
print("encoder output H:", tuple(h.shape))
for l, (k_g, v_g) in enumerate(kv_glob):
    print(f"decoder layer {l}: K_glob {tuple(k_g.shape)}, V_glob {tuple(v_g.shape)}")

# %% [markdown]
# Local KV, by contrast, is computed inside `Attention.forward` from the state the decoder layer is
# reading, so it changes from iteration to iteration while Global KV does not. A forward hook on
# decoder layer 0 shows it: the layer's input (hence its Local keys) differs across the 3 iterations,
# the Global keys passed to it are the very same tensor every time.

# %%
# NBVAL_CHECK_OUTPUT
seen = []
hook = model.decoder[0].attn.register_forward_pre_hook(lambda mod, args: seen.append((args[0], args[2][0])))
with torch.no_grad():
    model(idx)
hook.remove()
print("calls to decoder layer 0 in one forward pass:", len(seen))
for k in range(1, len(seen)):
    print(f"iteration {k + 1} vs 1: same layer input? {torch.equal(seen[k][0], seen[0][0])};"
          f"  same Global keys object? {seen[k][1] is seen[0][1]}")
assert len(seen) == cfg.n_iter and all(s[1] is seen[0][1] for s in seen)

# %% [markdown]
# ## 2. The score matrix over `[K_glob; K_loc]` and its mask
#
# Stack the two key sources into one sequence of `2N` keys: columns `0..N-1` are Global, `N..2N-1`
# Local. Key column `kv` belongs to position `kv mod N`, so causality becomes the mask
# `(kv mod N) ≤ q`: each query row sees a causal triangle in **both** halves.

# %%
# NBVAL_CHECK_OUTPUT
n_small = 6
mask = joint_mask(n_small, "cpu")  # (N, 2N) boolean, from the package
print(mask.int())
assert mask.shape == (n_small, 2 * n_small) and mask.sum().item() == n_small * (n_small + 1)

# %%
q, k_g, v_g, k_l, v_l = (torch.randn(1, 1, n_small, 8) for _ in range(5))
scores = torch.cat([q @ k_g.transpose(-2, -1), q @ k_l.transpose(-2, -1)], -1)[0, 0] / math.sqrt(8)  # (N, 2N)
probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
axes[0].imshow(mask, cmap="Greys", vmin=0, vmax=1.4)
axes[0].set_title("mask (kv mod N) ≤ q  (black = visible)")
im = axes[1].imshow(probs, cmap="viridis")
axes[1].set_title("one softmax over each row (random q, k)")
fig.colorbar(im, ax=axes[1], label="attention probability")
for ax in axes:
    ax.axvline(n_small - 0.5, color="red", lw=2)
    ax.set_xticks(range(2 * n_small), [f"G{j}" for j in range(n_small)] + [f"L{j}" for j in range(n_small)])
    ax.set_xlabel("key (G = Global from encoder, L = Local from current state)")
    ax.set_ylabel("query position i")
plt.tight_layout()
plt.show()
print("row sums of the probabilities (one softmax per query over both halves):", probs.sum(-1))

# %% [markdown]
# ## 3. One softmax is not two
#
# Take one query and four keys: two Global, two Local. Suppose the query matches one Global key strongly
# (score 4) and nothing else (score 0).
#
# - **One softmax** (AsymLoop) lets the sources compete: almost all the mass goes to that Global key.
# - **Two softmaxes**, one per source, each normalised to 1 and then averaged, force a fixed 50/50
#   split between the sources no matter what the scores say; summing them instead would double the
#   output's scale. Either is a different model.

# %%
# NBVAL_CHECK_OUTPUT
s_glob = torch.tensor([4.0, 0.0])
s_loc = torch.tensor([0.0, 0.0])
v_glob = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # value vectors; Global key 0 carries (1, 0)
v_loc = torch.tensor([[0.0, 1.0], [0.0, 1.0]])   # Local keys carry (0, 1)

p_joint = torch.cat([s_glob, s_loc]).softmax(0)
o_joint = p_joint @ torch.cat([v_glob, v_loc])
p_g, p_l = s_glob.softmax(0), s_loc.softmax(0)
o_two = 0.5 * (p_g @ v_glob) + 0.5 * (p_l @ v_loc)

print("one softmax  : probs", p_joint, "-> Global share", f"{p_joint[:2].sum():.3f}", "output", o_joint)
print("two softmaxes: probs", torch.cat([p_g, p_l]) / 2, "-> Global share 0.500 output", o_two)
assert not torch.allclose(o_joint, o_two, atol=0.1)

# %% [markdown]
# The two *can* be combined exactly, though, by weighting each half with its own normaliser. If
# `lse_G = log Σ_j exp(s_ij)` over Global keys and `lse_L` likewise over Local keys, then
#
# `o = (e^{lse_G} · o_G + e^{lse_L} · o_L) / (e^{lse_G} + e^{lse_L})`.
#
# This is how the package's fast CPU path works: two fused causal flash-attention calls merged by
# `merge_by_lse`. Checked on the toy example:

# %%
# NBVAL_CHECK_OUTPUT
lse_g, lse_l = s_glob.logsumexp(0), s_loc.logsumexp(0)
o_merged, _ = merge_by_lse((p_g @ v_glob)[None], lse_g[None], (p_l @ v_loc)[None], lse_l[None])
print("merged two-softmax outputs:", o_merged[0], " one softmax:", o_joint)
assert torch.allclose(o_merged[0], o_joint, atol=1e-6)

# %% [markdown]
# ## 4. QKNorm and RoPE on both key sources
#
# In a decoder layer, QKNorm (RMSNorm over the head dimension, learnable scale) is applied to `q`, to
# `K_loc` **and** to `K_glob`; then RoPE rotates all three by their positions `0..N-1`. Two consequences:
#
# - **QKNorm bounds the logits.** Each normalised head vector has RMS equal to its scale (1 at init),
#   so `|q·k|/√h ≤ √h` whatever the size of the encoder output or of the looped state. The Global keys
#   come from a different stream (the encoder) than the Local keys (the decoder state), and their raw
#   norms can differ a lot; without normalisation one source could dominate the single softmax by
#   scale alone. The model gives Global keys their own learnable scale `k_glob_norm` (ours).
# - **RoPE makes both sources relative.** Global key `j` is rotated exactly like Local key `j`, so the
#   score depends on `i − j` only: the query sees "the encoder's view of the token `i − j` back" and
#   "the current state of the token `i − j` back" on the same positional footing.

# %%
# NBVAL_CHECK_OUTPUT
attn = model.decoder[0].attn
x = torch.randn(1, N, cfg.d_model)
with torch.no_grad():
    for scale in (1.0, 100.0):
        k_raw = attn.heads(attn.wk_glob(scale * x))
        k_normed = attn.k_glob_norm(k_raw)
        print(f"input x{scale:>5}: raw Global key RMS {k_raw.pow(2).mean().sqrt():7.3f}  "
              f"after QKNorm {k_normed.pow(2).mean().sqrt():.3f}")
    assert torch.allclose(attn.k_glob_norm(attn.heads(attn.wk_glob(100 * x))), k_normed, atol=1e-4)

# %%
# NBVAL_CHECK_OUTPUT
rope = model.rope
hd = cfg.head_dim
qv, kv = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)
def score(i, j):  # query at position i against a key at position j, both rotated by RoPE
    return (rope(qv, start=i) @ rope(kv, start=j).transpose(-2, -1)).item()
for i, j in [(5, 2), (15, 12), (40, 37)]:
    print(f"score(q at {i:2d}, k at {j:2d}) = {score(i, j):+.3f}   (i - j = {i - j})")
assert abs(score(5, 2) - score(40, 37)) < 1e-4 and abs(score(5, 2) - score(5, 3)) > 1e-3

# %% [markdown]
# ## 5. Naive joint attention, built here, checked against the package
#
# The most literal reading of the equation: for each query `i`, collect the scores against Global keys
# `0..i` and Local keys `0..i`, take one softmax over all `2(i+1)` of them, and mix the values.

# %%
def naive_joint_attention(q, k_glob, v_glob, k_loc, v_loc):
    """One query at a time: o_i = softmax([q_i K_glob[:i+1]; q_i K_loc[:i+1]] / sqrt(hd)) @ [V_glob[:i+1]; V_loc[:i+1]]."""
    outs = []
    for i in range(q.size(-2)):
        keys = torch.cat([k_glob[..., : i + 1, :], k_loc[..., : i + 1, :]], dim=-2)  # (B, H, 2(i+1), hd)
        vals = torch.cat([v_glob[..., : i + 1, :], v_loc[..., : i + 1, :]], dim=-2)
        p = (q[..., i : i + 1, :] @ keys.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)  # (B, H, 1, 2(i+1))
        outs.append(p @ vals)
    return torch.cat(outs, dim=-2)  # (B, H, N, hd)


# %% [markdown]
# Forward and backward, in float64, against all three package paths:
# `joint_attention` (fast: on CPU two flash calls merged by log-sum-exp, with a custom backward),
# `joint_attention_masked` (one SDPA call over the 2N keys with the joint mask) and
# `joint_attention_reference` (explicit scores and mask). The tolerance is 1e-6: the CPU flash
# kernel behind `joint_attention` is not exact to float64 precision (differences around 1e-7), the other
# two match to about 1e-15.

# %%
# NBVAL_CHECK_OUTPUT
g = torch.Generator().manual_seed(0)
shape = (2, 3, 17, 16)  # (B, H, N, hd)
inputs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(5)]
d_out = torch.randn(shape, generator=g, dtype=torch.float64)

def forward_backward(fn):
    xs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    out.backward(d_out)
    return out.detach(), [x.grad for x in xs]

out_naive, grads_naive = forward_backward(naive_joint_attention)
names = ["dq", "dK_glob", "dV_glob", "dK_loc", "dV_loc"]
for fn in (joint_attention, joint_attention_masked, joint_attention_reference):
    out, grads = forward_backward(fn)
    assert torch.allclose(out, out_naive, atol=1e-6), fn.__name__
    for nm, ga, gb in zip(names, grads, grads_naive):
        assert torch.allclose(ga, gb, atol=1e-6), (fn.__name__, nm)
    print(f"{fn.__name__:26s} == naive: forward OK, backward OK ({', '.join(names)})")

# %% [markdown]
# The same check in float32, the training dtype (tolerance 1e-5):

# %%
# NBVAL_CHECK_OUTPUT
inputs32 = [t.float().requires_grad_() for t in inputs]
ref = naive_joint_attention(*[t.detach() for t in inputs32])
fast = joint_attention(*inputs32)
assert torch.allclose(fast, ref, atol=1e-5)
print("float32 joint_attention == naive: OK")

# %% [markdown]
# Finally, the naive function inside the model: recompute decoder layer 0's attention output by hand
# from its own modules (`wq`, `wk`, `wv`, QKNorm, RoPE, `wo`) with `naive_joint_attention`, and compare
# it with what `Attention.forward` returns.

# %%
# NBVAL_CHECK_OUTPUT
with torch.no_grad():
    a = model.decoder[0].attn_norm(h)  # the decoder's first input is z_0 = H
    q_ = rope(attn.q_norm(attn.heads(attn.wq(a))))
    k_ = rope(attn.k_norm(attn.heads(attn.wk(a))))
    v_ = attn.heads(attn.wv(a))
    y = naive_joint_attention(q_, *kv_glob[0], k_, v_)  # (B, H, N, hd)
    by_hand = attn.wo(y.transpose(1, 2).reshape(B, N, cfg.d_model))
    by_model = attn(a, rope, kv_glob[0])
assert torch.allclose(by_hand, by_model, atol=1e-5)
print("decoder layer 0: naive joint attention from the layer's own modules == Attention.forward")
