"""The fused kernels behind joint attention, and which one runs where.

Joint attention (model.py) is one softmax over Global and Local keys with the same causal rule,
`(kv mod N) <= q` over the 2N keys [K_glob; K_loc]. Three implementations:

  flash   two causal flash-attention calls, merged by log-sum-exp (model.merge_by_lse), with an exact
          backward; the kernels skip masked blocks, so it costs about 2x one causal call. CPU and CUDA.
  flex    FlexAttention over the 2N keys with the block mask `(kv mod N) <= q`; CUDA, fused only under
          torch.compile (eager runs an unfused reference; on CPU it has no backward).
  masked  one SDPA call with an (N, 2N) boolean mask: exact everywhere, but on CUDA a boolean mask rules
          out the flash kernel and the memory-efficient kernel computes all N x 2N scores.

`joint_attention_impl` picks one, with a logged reason whenever it falls back (see its docstring);
`set_joint_attention("flex")` or MINIMAL_ASYMLOOP_JOINT_ATTENTION=flex overrides it. Benchmark:
`python -m minimal_asymloop.bench gpu`.
"""

import logging
import os

import torch

log = logging.getLogger(__name__)

JOINT_IMPLS = ("auto", "flash", "flex", "masked")
ENV = "MINIMAL_ASYMLOOP_JOINT_ATTENTION"
_choice = {"impl": "auto"}  # a dict, so set_joint_attention needs no `global`
_reported: set = set()


def set_joint_attention(impl: str):
    """Force one implementation ("flash", "flex", "masked") or go back to "auto". Call it before
    torch.compile: a compiled model keeps the implementation it was traced with."""
    if impl not in JOINT_IMPLS:
        raise ValueError(f"unknown joint attention implementation {impl!r}; choose one of {', '.join(JOINT_IMPLS)}")
    _choice["impl"] = impl


if os.environ.get(ENV):
    try:
        set_joint_attention(os.environ[ENV])
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None


def flash_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flash kernels cannot run these inputs, or None when they can."""
    if device.type == "cpu":
        return None if dtype in (torch.float32, torch.bfloat16, torch.float64) else f"the CPU flash kernel has no {dtype}"
    if device.type != "cuda":
        return f"no flash kernel on {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"CUDA flash attention needs bf16 or fp16, got {dtype} (train with --dtype bfloat16, the default on CUDA)"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this PyTorch build has no CUDA flash attention"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"CUDA flash attention needs compute capability >= 8.0 (Ampere), this GPU is {major}.{minor}"
    if head_dim % 8 or head_dim > 256:
        return f"CUDA flash attention needs head_dim a multiple of 8 and <= 256, got {head_dim}"
    return None


@torch.compiler.assume_constant_result  # decided once at trace time: no graph break, no guard on the logging set
def joint_attention_impl(device_type: str, device_index: int, dtype: torch.dtype, head_dim: int) -> str:
    """The implementation joint attention uses for these inputs: the forced one, or "auto":
    flash where its kernels run (CPU fp32/bf16/fp64; CUDA bf16/fp16 on compute capability >= 8.0),
    else masked, with a warning that says why. flex is never chosen automatically (ours: it needs
    torch.compile to be fused; compare with `bench gpu` and force it if it wins on your GPU)."""
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    impl, why = _choice["impl"], None
    if impl == "flex" and device_type != "cuda":
        raise ValueError(f"joint attention 'flex' was forced, but FlexAttention has no backward on {device_type}; "
                         f"use it on CUDA, or set_joint_attention('auto')")
    if impl in ("auto", "flash"):
        why = flash_unsupported(device, dtype, head_dim)
        if impl == "flash" and why:
            raise ValueError(f"joint attention 'flash' was forced but {why}; use set_joint_attention('auto') or 'masked'")
        impl = "masked" if why else "flash"
    key = (device_type, dtype, head_dim, impl)
    if key not in _reported:
        _reported.add(key)
        if impl == "masked" and why:  # a slower path: say so once, visibly
            log.warning("joint attention on %s %s: masked SDPA over 2N keys, because %s", device_type, dtype, why)
        else:
            log.info("joint attention on %s %s: %s", device_type, dtype, impl)
    return impl


def attention_dtype(*tensors) -> torch.dtype:
    """The dtype the fused kernels get: autocast's when it is on, else the inputs' own. The model already
    hands q, k and v over in it (RMSNorm returns its input's dtype, Global KV is cast once per forward), so
    joint attention's cast to it is then free; a caller mixing fp32 and bf16 still gets one dtype."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensors[0].dtype


# ----------------------------------------------------------------------------- causal flash, forward and backward


def causal_flash_forward(q, k, v):
    """Causal flash attention that also returns its log-sum-exp: (out (B, H, N, hd), lse (B, H, N) fp32, state)."""
    if q.device.type == "cuda":
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        return out, lse, (seed, offset)  # RNG state, unused without dropout but part of the backward's signature
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, lse, (None, None)


def causal_flash_backward(d_out, q, k, v, out, lse, state):
    """(dq, dk, dv) of causal flash attention, given the output and log-sum-exp of the softmax it belongs to."""
    if q.device.type == "cuda":
        seed, offset = state
        n_q, n_k = q.size(-2), k.size(-2)  # max sequence lengths; no cumulative lengths without varlen
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_out, q, k, v, out, lse, None, None, n_q, n_k, 0.0, True, seed, offset)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(d_out, q, k, v, out, lse, 0.0, True)


# ----------------------------------------------------------------------------- FlexAttention


def joint_attention_flex(q, k_glob, v_glob, k_loc, v_loc):
    """Joint attention as one FlexAttention call over [K_glob; K_loc] with the block mask (kv mod N) <= q.
    Blocks where the mask is all False are skipped. Wrap it (or the model) in torch.compile to fuse it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.size(-2)

    def joint(b, h, q_idx, kv_idx):  # key j of either source is visible to query i iff j <= i
        return (kv_idx % n) <= q_idx

    block_mask = create_block_mask(joint, None, None, n, 2 * n, device=q.device)
    k, v = torch.cat([k_glob, k_loc], dim=-2), torch.cat([v_glob, v_loc], dim=-2)  # (B, H, 2N, hd)
    return flex_attention(q, k, v, block_mask=block_mask)
