"""Analytical cost of a `ModelConfig`: exact parameters and forward FLOPs per token (the paper's Appendix D),
and the size and matched-baseline tables that `python -m minimal_asymloop.flops` prints.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from minimal_asymloop.model import ARCHS, WIDE_FULL_LOOP_D_FF, LoopedLM, ModelConfig
from minimal_asymloop.system import ConfigError


def count_params(cfg: ModelConfig) -> int:
    """Exact parameter count, from a model built on the meta device (no memory used)."""
    with torch.device("meta"):
        return sum(p.numel() for p in LoopedLM(cfg).parameters())


def matched_dec_d_ff(cfg: ModelConfig) -> int:
    """Table 4a: the decoder FFN width at which AsymLoop *without* Global KV has AsymLoop's parameter count.
    Each decoder layer's Global KV projections (2·d², plus their QKNorm scale) become 3·d·Δ wider-FFN weights.
    (ours) Only the decoder's FFN is widened, where the projections were; the paper says only "a wider FFN"."""
    with_gkv, without = replace(cfg, context="global_kv", dec_d_ff=None), replace(cfg, context="none", dec_d_ff=None)
    return cfg.d_ff + round((count_params(with_gkv) - count_params(without)) / (3 * cfg.d_model * cfg.n_dec))


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict:
    """Forward FLOPs per token, the paper's Appendix D convention (the paper's Appendix D).

    Each executed block 8d² + 6·d·d_ff + 4·N·d (full N×N scores), with MoE 6·d·d_ff becomes
    top_k·6·d·moe_d_ff + 2·d·moe_experts (active experts + router); head 2·d·V; AsymLoop adds
    4d² per decoder layer for the Global KV projections (once) and 4·N·d per decoder layer
    per iteration for global attention. Training is about 3x this.
    """
    n, d, dff = seq_len or cfg.max_seq_len, cfg.d_model, cfg.d_ff
    ffn = 6 * d * dff
    if cfg.moe_experts:  # active experts only: top_k SwiGLUs of width moe_d_ff, plus the d x E router
        ffn = cfg.moe_top_k * 6 * d * cfg.moe_d_ff + 2 * d * cfg.moe_experts
    block = 8 * d * d + ffn + 4 * n * d
    glob_proj = glob_attn = 0
    if cfg.arch == "asymloop":
        dec_block = block + 6 * d * (cfg.dec_d_ff - dff) if cfg.dec_d_ff else block
        # without Local KV the decoder computes no K_loc, V_loc and no local scores
        dec_block = dec_block if cfg.local_kv else dec_block - 4 * d * d - 4 * n * d
        blocks = cfg.n_enc * block + cfg.n_iter * cfg.n_dec * dec_block
        if cfg.context == "global_kv":
            glob_proj = 4 * d * d * cfg.n_dec
            glob_attn = 4 * n * d * cfg.n_dec * cfg.n_iter
    else:
        blocks = cfg.effective_depth * block
    head = 2 * d * cfg.vocab_size
    total = blocks + head + glob_proj + glob_attn
    return dict(total=total, blocks=blocks, head=head, global_kv_proj=glob_proj, global_attn=glob_attn)


def train_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, depth_pmf: dict | None = None,
                          backprop_depth: int | None = None) -> float:
    """Training FLOPs per token: 3x forward (Appendix D's convention), averaged over the K that training runs, depth_pmf
    ({K: probability}, depth.DepthSampler.pmf; None: the config's n_iter). (ours) The iterations that truncated backprop
    runs without a graph (all but the last backprop_depth) cost 1x forward, not 3x."""
    total = 0.0
    for k, p in (depth_pmf or {cfg.n_iter: 1.0}).items():
        fwd = flops_per_token(replace(cfg, n_iter=k), seq_len)["total"]
        no_grad = max(k - backprop_depth, 0) if backprop_depth and cfg.arch != "dense" else 0
        per_iter = fwd - flops_per_token(replace(cfg, n_iter=k - 1), seq_len)["total"] if no_grad else 0
        total += p * (3 * fwd - 2 * no_grad * per_iter)
    return total


def sizes_table(seq_len: int = 1024) -> str:
    """Markdown table of parameters and forward FLOPs/token for the paper's sizes."""
    rows = ["| size | arch | K | eff. depth | params | fwd GFLOPs/token | Global KV share |",
            "|---|---|---|---|---|---|---|"]
    for size in ("60m", "135m", "350m", "1b", "olmo8"):
        for arch in ARCHS:
            cfg = ModelConfig.from_preset(size, arch)
            f = flops_per_token(cfg, seq_len)
            share = (f["global_kv_proj"] + f["global_attn"]) / f["total"]
            rows.append(f"| {size} | {arch} | {cfg.n_iter} | {cfg.effective_depth} | {count_params(cfg) / 1e6:.1f}M "
                        f"| {f['total'] / 1e9:.3f} | {share:.1%} |")
    return "\n".join(rows)


def ablation_configs(size: str) -> dict[str, ModelConfig]:
    """The paper's parameter/FLOP-matched baselines at one size, beside AsymLoop K=3 and Full Loop K=2."""
    asym = ModelConfig.from_preset(size)
    return {"asymloop K=3": asym,
            "full_loop K=2": ModelConfig.from_preset(size, "full_loop"),
            f"full_loop K=2, FFN {WIDE_FULL_LOOP_D_FF} (App. E)": ModelConfig.from_preset(size, "full_loop", d_ff=WIDE_FULL_LOOP_D_FF),
            f"asymloop K=3 without Global KV, decoder FFN {matched_dec_d_ff(asym)} (Table 4a)":
                ModelConfig.from_preset(size, context="none", dec_d_ff=matched_dec_d_ff(asym))}


def ablations_table(seq_len: int = 1024) -> str:
    """Markdown table: parameters and training FLOPs of the matched baselines, relative to AsymLoop K=3."""
    rows = ["| size | model | params | vs AsymLoop | fwd GFLOPs/token | vs AsymLoop |", "|---|---|---|---|---|---|"]
    for size in ("60m", "135m"):
        cfgs = ablation_configs(size)
        p0, f0 = count_params(cfgs["asymloop K=3"]), flops_per_token(cfgs["asymloop K=3"], seq_len)["total"]
        for name, cfg in cfgs.items():
            p, f = count_params(cfg), flops_per_token(cfg, seq_len)["total"]
            rows.append(f"| {size} | {name} | {p / 1e6:.2f}M | {p / p0 - 1:+.2%} | {f / 1e9:.3f} | {f / f0 - 1:+.1%} |")
    return "\n".join(rows)


def main():
    print(f"Parameters and forward FLOPs per token at seq_len=1024 (the paper's Appendix D):\n\n{sizes_table()}")
    print(f"\nMatched baselines (the paper's Table 4a and Appendix E; training FLOPs = 3 x forward):\n\n{ablations_table()}")


def training_bytes_at_least(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, bytes) a lower bound on what training `cfg` holds, from the config alone (building even a meta model
    of a million layers takes hours): fp32 weights, gradients and AdamW's two moments (16 bytes a parameter) and the
    RoPE tables. Attention, FFNs and one of embedding/head only; activations not counted."""
    d, ffn = cfg.d_model, (cfg.moe_experts * cfg.moe_d_ff if cfg.moe_experts else cfg.d_ff)
    params = cfg.n_layer * (4 * d * d + 3 * d * ffn) + cfg.vocab_size * d
    return params, 16 * params + 2 * 4 * cfg.max_seq_len * cfg.head_dim


def check_fits(cfg: ModelConfig, device: torch.device):
    """Refuse, before any data is prepared, a model whose training state alone exceeds the device's memory."""
    params, need = training_bytes_at_least(cfg)
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this machine's {device.type} memory"
    if need > have:
        raise ConfigError(f"this model needs at least {need / 1e9:,.1f} GB to train ({params / 1e9:,.2f}B parameters x 16 bytes for "
                          f"weights, gradients and AdamW state, and the RoPE tables of max_seq_len={cfg.max_seq_len:,}), but "
                          f"{where} has {have / 1e9:,.1f} GB; lower --n-layer, --d-model, --d-ff, --vocab-size or --max-seq-len")


if __name__ == "__main__":
    main()

