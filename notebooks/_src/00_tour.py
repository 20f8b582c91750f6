# %% [markdown]
# # 00 · A tour of the three architectures
#
# *Asymmetric Looped Transformers* (AsymLoop) split a transformer of `L` blocks into an **encoder** of `E`
# blocks that runs once and a **decoder** of `D` blocks that runs `K` times with shared weights. Every
# decoder iteration reads the encoder's output through per-layer **Global KV**, so the fixed global
# representation stays available however deep the loop goes.
#
# In this notebook you will:
# 1. see Dense, Full Loop and AsymLoop side by side, as a diagram;
# 2. compute their effective depth;
# 3. count parameters and analytical FLOPs per token for every size the paper trains, and the cost of
#    Global KV in %;
# 4. train a tiny AsymLoop model for about a minute on Python source code and plot its loss;
# 5. generate text from it.
#
# Everything here comes from the package `minimal_asymloop`; nothing is re-implemented.

# %%
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyArrowPatch, Rectangle

from minimal_asymloop.model import ARCHS, PRESETS, ModelConfig, count_params, flops_per_token, sizes_table

torch.manual_seed(0)

# %% [markdown]
# ## 1. The three architectures
#
# All three share one LLaMA-style block (pre-norm RMSNorm, attention with RoPE, SwiGLU MLP, no biases):
#
# | arch | what runs | effective depth |
# |---|---|---|
# | `dense` | the `L` blocks once | `L` |
# | `full_loop` | the whole `L`-block stack `K` times, weights shared | `K·L` |
# | `asymloop` | encoder of `E` blocks once, then a weight-tied decoder of `D` blocks `K` times | `E + K·D` |

# %%
def draw_stack(ax, x, names, colors, title, loop=None, global_kv=None):
    """Boxes bottom-to-top; loop=(first, last, label) draws a return arrow; global_kv=(src, dsts)."""
    w, hgt = 1.6, 0.55
    ys = [0.9 + i * 0.75 for i in range(len(names))]
    for y, name, c in zip(ys, names, colors):
        ax.add_patch(Rectangle((x - w / 2, y), w, hgt, facecolor=c, edgecolor="k"))
        ax.text(x, y + hgt / 2, name, ha="center", va="center", fontsize=9)
    ax.text(x, 0.35, "embed(x)", ha="center", fontsize=9)
    ax.text(x, ys[-1] + hgt + 0.35, "norm → head", ha="center", fontsize=9)
    for y0, y1 in zip([0.55] + [y + hgt for y in ys], ys + [ys[-1] + hgt + 0.3]):
        ax.annotate("", (x, y1), (x, y0), arrowprops=dict(arrowstyle="->", lw=1))
    if loop:
        a, b, label = loop
        ax.add_patch(FancyArrowPatch((x + w / 2, ys[b] + hgt / 2), (x + w / 2, ys[a] + hgt / 2),
                                     connectionstyle="arc3,rad=-0.6", arrowstyle="->", mutation_scale=15, lw=2, color="C3"))
        ax.text(x + w / 2 + 0.8, (ys[a] + ys[b] + hgt) / 2, label, color="C3", fontsize=10, va="center")
    if global_kv:
        src, dsts = global_kv
        for d in dsts:
            ax.add_patch(FancyArrowPatch((x - w / 2, ys[src] + hgt), (x - w / 2, ys[d] + hgt / 2),
                                         connectionstyle="arc3,rad=0.5", arrowstyle="->", mutation_scale=12, lw=1.5, color="C0"))
        ax.text(x - w / 2 - 0.85, (ys[src] + ys[dsts[-1]]) / 2 + 0.3, "Global KV\n(once)", color="C0", fontsize=9, ha="center")
    ax.text(x, -0.25, title, ha="center", fontsize=11, weight="bold")


fig, ax = plt.subplots(figsize=(12, 5.5))
grey, enc, dec = "0.85", "#9ecae1", "#fdae6b"
draw_stack(ax, 1.5, [f"block {i}" for i in range(4)], [grey] * 4, "Dense (L=4)\neffective depth 4")
draw_stack(ax, 5.0, [f"block {i}" for i in range(4)], [grey] * 4, "Full Loop (L=4, K=2)\neffective depth 8", loop=(0, 3, "× K"))
draw_stack(ax, 9.3, ["enc 0", "enc 1", "dec 0", "dec 1"], [enc, enc, dec, dec], "AsymLoop (E=2, D=2, K=3)\neffective depth 2 + 3·2 = 8",
           loop=(2, 3, "× K"), global_kv=(1, [2, 3]))
ax.set_xlim(-0.5, 11.5)
ax.set_ylim(-0.8, 4.9)
ax.axis("off")
ax.set_title("Three architectures on one LLaMA-style block (arrows: data flow; red: weight-tied loop; blue: Global KV)")
plt.show()

# %% [markdown]
# ## 2. Effective depth
#
# `ModelConfig.effective_depth` counts the blocks executed per forward pass. The paper compares at matched
# effective depth: Dense vs AsymLoop `K=1` (`L`), Full Loop `K=2` vs AsymLoop `K=3` (`2L`), Full Loop `K=3`
# vs AsymLoop `K=5` (`3L`).

# %%
# NBVAL_CHECK_OUTPUT
pairs = [("dense", None, "asymloop", 1), ("full_loop", 2, "asymloop", 3), ("full_loop", 3, "asymloop", 5)]
print(f"{'baseline':>14} {'depth':>6}   {'AsymLoop':>12} {'depth':>6}   (L=6: E=3, D=3)")
for a, ka, b, kb in pairs:
    ca = ModelConfig.from_preset("60m", a, n_iter=ka)
    cb = ModelConfig.from_preset("60m", b, n_iter=kb)
    print(f"{a + f' K={ca.n_iter}':>14} {ca.effective_depth:>6}   {b + f' K={kb}':>12} {cb.effective_depth:>6}")
    assert ca.effective_depth == cb.effective_depth

# %% [markdown]
# ## 3. Parameters and FLOPs per token
#
# `count_params` builds the model on the meta device (no memory), `flops_per_token` follows the paper's
# Appendix D convention: each executed block `8d² + 6·d·d_ff + 4·N·d`, the head `2·d·V`, and for AsymLoop
# `4d²` per decoder layer for the Global KV projections (once) plus `4·N·d` per decoder layer per iteration
# for the global attention scores. Sequence length `N = 1024`, the paper's vocabulary 32128.

# %%
# NBVAL_CHECK_OUTPUT
print(sizes_table(seq_len=1024))

# %% [markdown]
# Weight tying means looping adds compute, not parameters: Full Loop has exactly Dense's parameters. Global KV
# adds `2d²` parameters per decoder layer (`wk_glob`, `wv_glob`), plus two tiny norm scales: the shared
# encoder-output RMSNorm (`d`) and each layer's Global-key QKNorm (`head_dim`). The overhead against the same
# AsymLoop without Global KV:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'size':>5} {'params +':>9} {'params +%':>9} {'fwd FLOPs +%':>13}")
for size in ("60m", "135m", "350m", "1b"):
    with_g = ModelConfig.from_preset(size, "asymloop")
    without = ModelConfig.from_preset(size, "asymloop", context="none")
    dp = count_params(with_g) - count_params(without)
    df = flops_per_token(with_g, 1024)["total"] / flops_per_token(without, 1024)["total"] - 1
    assert dp == 2 * with_g.d_model ** 2 * with_g.n_dec + with_g.d_model + with_g.head_dim * with_g.n_dec
    print(f"{size:>5} {dp / 1e6:>8.2f}M {dp / count_params(without):>9.1%} {df:>13.1%}")
    assert count_params(ModelConfig.from_preset(size, "full_loop")) == count_params(ModelConfig.from_preset(size, "dense"))
