"""Asymmetric Looped Transformers (AsymLoop): the model.

Reads like Section 3 of the paper: config, backbone pieces (RMSNorm, RoPE,
SwiGLU, attention), joint attention, encoder + Global KV, the looped decoder,
and the three architectures (dense, full_loop, asymloop) in `LoopedLM`.
KV-cached generation lives in generate.py, parameter and FLOP counts (Appendix D) in flops.py.
Spec: the paper (Section 3 for the model). Choices the paper leaves open are marked "(ours)".
"""

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from minimal_asymloop import generate as generation
from minimal_asymloop import kernels
from minimal_asymloop.loss import linear_cross_entropy

ARCHS = ("dense", "full_loop", "asymloop")
CONTEXTS = ("global_kv", "additive", "none")
BACKBONES = ("llama", "olmo2")
DEFAULT_N_ITER = {"dense": 1, "full_loop": 2, "asymloop": 3}

# The paper's LLaMA-style sizes (the paper's model configurations); "tiny" is ours, sized for a 2-core CPU.
PRESETS = {
    "tiny": dict(n_layer=4, d_model=192, n_head=6, d_ff=512, vocab_size=8192, max_seq_len=256),
    "60m": dict(n_layer=6, d_model=768, n_head=6, d_ff=2048),
    "135m": dict(n_layer=12, d_model=768, n_head=12, d_ff=2048),
    "350m": dict(n_layer=24, d_model=1024, n_head=16, d_ff=2736),
    "1b": dict(n_layer=24, d_model=2048, n_head=32, d_ff=5461),
    # the paper's Appendix G OLMo-style model: 8 pre-norm blocks (as in He et al.'s OLMo-60M config), d 512, 8 heads,
    # SwiGLU 2048, RMSNorm, RoPE, the SmolLM tokenizer's 49152 tokens; Full Loop K=2 vs AsymLoop K=3 (E=D=4), depth 16
    "olmo8": dict(n_layer=8, d_model=512, n_head=8, d_ff=2048, vocab_size=49152),
}
# Appendix E: Full Loop K=2 with its FFN widened 2048 -> 2656 to match AsymLoop K=3's training FLOPs (60m, 135m)
WIDE_FULL_LOOP_D_FF = 2656
# `--moe`: the paper's sparse FFN, 8 SwiGLU experts, top-2. moe_d_ff defaults to d_ff // top_k
# (1024 at 60m/135m), so the active expert parameters equal the dense FFN's at every size.
PAPER_MOE = dict(moe_experts=8, moe_top_k=2)


# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    arch: str = "asymloop"  # dense: L blocks once | full_loop: L blocks K times | asymloop: E encoder blocks, then D decoder blocks K times
    n_layer: int = 6  # L physical blocks (E + D for asymloop)
    n_enc: int | None = None  # E, the encoder blocks of asymloop; None -> n_layer // 2 for asymloop, 0 otherwise
    n_iter: int | None = None  # K, loop iterations; None -> 1 dense, 2 full_loop, 3 asymloop
    d_model: int = 768  # model width
    n_head: int = 6  # attention heads (head dim = d_model / n_head, even for RoPE)
    d_ff: int = 2048  # SwiGLU hidden width
    vocab_size: int = 32128  # embedding rows: at least the tokenizer's (the paper pads T5's 32100 to 32128)
    max_seq_len: int = 1024  # longest sequence the RoPE tables cover
    rope_theta: float = 10000.0  # RoPE base, (ours) LLaMA's default; the paper does not state it
    qk_norm: bool | None = None  # RMSNorm on queries and keys; None -> auto: on for asymloop and the olmo2 backbone (ours)
    context: str | None = None  # asymloop context access: global_kv | additive | none; None -> global_kv (asymloop), none otherwise
    local_kv: bool = True  # the decoder's own keys and values each iteration; false: the "without Local KV" ablation
    norm_eps: float = 1e-6  # RMSNorm epsilon (ours)
    init_std: float = 0.02  # std of the normal weight init (ours), see LoopedLM.init_weights
    # (ours) an OLMo-2 option, not what the paper ran: "olmo2" puts each RMSNorm on its sublayer's output,
    # x + Norm(Attn(x)), x + Norm(MLP(x)), and turns QKNorm on by default. See Block.
    backbone: str = "llama"  # llama: pre-norm blocks (the paper) | olmo2: norm on each sublayer's output (ours)
    # Table 4a's parameter-matched "without Global KV" gives the Global KV projections' parameters to a wider
    # FFN; (ours) only the decoder's widens: see matched_dec_d_ff
    dec_d_ff: int | None = None  # asymloop's decoder FFN width; None -> d_ff
    # sparse MoE FFN (the paper's MoE extension)
    moe_experts: int = 0  # SwiGLU experts per FFN, top-k routed; 0 -> a dense SwiGLU FFN
    moe_top_k: int = 2  # experts each token is routed to
    moe_d_ff: int | None = None  # expert width; None -> d_ff // moe_top_k (ours: active params = dense FFN)
    moe_balance_weight: float = 0.01  # load-balancing loss weight (paper)
    moe_z_weight: float = 0.001  # router z-loss weight (paper)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(msg)

        if self.arch not in ARCHS:
            bad(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        asym = self.arch == "asymloop"
        if self.n_iter is None:
            self.n_iter = DEFAULT_N_ITER[self.arch]
        if self.backbone not in BACKBONES:
            bad(f"unknown backbone {self.backbone!r}; choose one of {', '.join(BACKBONES)}")
        if self.qk_norm is None:
            self.qk_norm = asym or self.backbone == "olmo2"
        if self.context is None:
            self.context = "global_kv" if asym else "none"
        if self.n_enc is None:
            self.n_enc = self.n_layer // 2 if asym else 0
        for name in ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name, zero_ok in (("rope_theta", False), ("norm_eps", False), ("init_std", False), ("moe_balance_weight", True),
                              ("moe_z_weight", True)):  # nan, inf and negatives would surface as a non-finite loss at step 1
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v if zero_ok else 0 < v) or not math.isfinite(v):
                bad(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v!r}; e.g. {getattr(type(self), name)}")
        if not isinstance(self.n_iter, int) or self.n_iter < 1:
            bad(f"n_iter (K) must be an integer >= 1, got {self.n_iter!r}")
        if self.d_model % self.n_head:
            bad(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; pick n_head dividing d_model")
        if (self.d_model // self.n_head) % 2:
            bad(f"head dim d_model/n_head={self.d_model // self.n_head} must be even for RoPE")
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            bad(f"moe_experts must be an integer >= 0 (0 = dense FFN), got {self.moe_experts!r}")
        if self.moe_experts:
            if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.moe_experts:
                bad(f"moe_top_k={self.moe_top_k!r} must be in 1..moe_experts={self.moe_experts}")
            if self.moe_d_ff is None:
                self.moe_d_ff = max(1, self.d_ff // self.moe_top_k)
            if not isinstance(self.moe_d_ff, int) or self.moe_d_ff < 1:
                bad(f"moe_d_ff must be a positive integer, got {self.moe_d_ff!r}")
        elif self.moe_d_ff is not None:
            bad(f"moe_d_ff={self.moe_d_ff} applies only with moe_experts > 0; set moe_experts (e.g. 8) or leave moe_d_ff unset")
        if self.dec_d_ff is not None:
            if not asym:
                bad(f"dec_d_ff applies only to arch='asymloop' (got arch={self.arch!r}); use d_ff to widen every FFN")
            if not isinstance(self.dec_d_ff, int) or self.dec_d_ff < 1:
                bad(f"dec_d_ff must be a positive integer, got {self.dec_d_ff!r}")
            if self.moe_experts:
                bad("dec_d_ff applies to the dense SwiGLU FFN only; with moe_experts set moe_d_ff instead")
        if self.context not in CONTEXTS:
            bad(f"unknown context {self.context!r}; choose one of {', '.join(CONTEXTS)}")
        if asym:
            if not 1 <= self.n_enc <= self.n_layer - 1:
                bad(f"n_enc={self.n_enc} must be in 1..{self.n_layer - 1} (n_layer={self.n_layer}) so encoder and decoder are non-empty")
            if not self.local_kv and self.context != "global_kv":
                bad(f"local_kv=False needs context='global_kv' (got {self.context!r}): the decoder would have nothing to attend to")
        else:
            if self.context != "none":
                bad(f"context={self.context!r} applies only to arch='asymloop' (got arch={self.arch!r}); leave context unset")
            if not self.local_kv:
                bad(f"local_kv=False applies only to arch='asymloop' (got arch={self.arch!r})")
            if self.n_enc:
                bad(f"n_enc applies only to arch='asymloop' (got arch={self.arch!r}, n_enc={self.n_enc}); leave it unset")

    @property
    def n_dec(self) -> int:
        return self.n_layer - self.n_enc if self.arch == "asymloop" else 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def effective_depth(self) -> int:
        """Blocks executed per forward pass: L, K·L or E + K·D."""
        return {"dense": self.n_layer, "full_loop": self.n_iter * self.n_layer,
                "asymloop": self.n_enc + self.n_iter * self.n_dec}[self.arch]

    @classmethod
    def from_preset(cls, size: str, arch: str = "asymloop", **overrides) -> "ModelConfig":
        if size not in PRESETS:
            raise ValueError(f"unknown size {size!r}; choose one of {', '.join(PRESETS)}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {', '.join(sorted(names))}")
        return cls(**{**PRESETS[size], "arch": arch, **overrides})

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- backbone pieces


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 (fp64 input: in fp64) and returned in its input's dtype, with or without autocast.

    CUDA autocast in recent torch (2.13; not 2.11) has an fp32 rule for rms_norm (CPU autocast has none), so a plain
    nn.RMSNorm hands bf16 input back in fp32 on a GPU only: QKNorm's q and k would then reach RoPE and attention in fp32."""

    def forward(self, x):
        dt = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(dt), self.normalized_shape, self.weight.to(dt), self.eps).to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables (rotate-half convention) for positions 0..max_seq_len-1."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        if self.cos.is_meta:
            return
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
        angles = torch.cat([angles, angles], dim=-1).to(self.cos.device)  # (T, hd)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x, start: int = 0):
        """Rotate x (B, H, N, hd) as if it sat at positions start..start+N-1."""
        n = x.size(-2)
        cos, sin = self.cos.narrow(0, start, n).to(x.dtype), self.sin.narrow(0, start, n).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Sparse mixture of SwiGLU experts (the paper's MoE extension): a linear router sends each token to its
    top-k experts, weighted by a softmax over the k chosen logits. No capacity limit: no token dropped.

    Each call adds its load-balancing loss, router z-loss and expert loads to running sums, so an
    expert layer looped K times accumulates K calls; LoopedLM.forward resets them and reads them out.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.d_model, cfg.moe_d_ff) for _ in range(cfg.moe_experts))
        self.reset_stats()

    def reset_stats(self):
        self.n_calls, self.balance_sum, self.z_sum, self.load = 0, 0.0, 0.0, 0

    def route(self, x):
        """x (T, d) -> router logits (T, E), gates (T, k) summing to 1, chosen expert ids (T, k)."""
        logits = self.router(x).float()  # (ours) routing math in fp32, also under autocast
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        gates = top_logits.softmax(dim=-1)  # (ours) renormalized over the top-k: the full softmax's top-k probabilities / their sum
        return logits, gates, top_ids

    def aux_losses(self, logits, top_ids):
        """Load balancing E·Σ_e f_e·P_e (Switch Transformer; 1 at a uniform router, up to E/k collapsed)
        and router z-loss mean_t logsumexp(logits_t)² (ST-MoE). f_e: share of the T·k assignments
        that went to expert e (no gradient); P_e: mean router probability of e."""
        counts = torch.bincount(top_ids.flatten(), minlength=self.n_experts)  # (E,) tokens per expert
        f = counts.float() / top_ids.numel()
        balance = self.n_experts * (f * logits.softmax(dim=-1).mean(0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return balance, z, counts

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, d), T = B·N tokens
        logits, gates, top_ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # readable loop; cost: `python -m minimal_asymloop.bench moe`
            tok, slot = torch.where(top_ids == e)  # the tokens that chose expert e, and in which of their k slots
            # an expert with no tokens still runs on an empty batch, so every parameter gets a gradient (DDP needs it)
            y = expert(x.index_select(0, tok)) * gates[tok, slot].unsqueeze(-1)  # (T_e, d)
            out.index_add_(0, tok, y.to(out.dtype))
        balance, z, counts = self.aux_losses(logits, top_ids)
        self.n_calls += 1
        self.balance_sum, self.z_sum = self.balance_sum + balance, self.z_sum + z
        self.load = self.load + counts
        return out.view(shape)


def causal_attention(q, k, v):
    """Plain causal attention (B, H, N, hd) through PyTorch's fused SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_after_prefix(q, sources):
    """Decoding: the n queries sit at the last n of T positions; each source (K, V), each
    (B, H, T, hd), shows key j to query i iff j <= T-n+i, all sources under ONE softmax."""
    n, t = q.size(-2), sources[0][0].size(-2)
    mask = None if n == 1 else torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n).repeat(1, len(sources))
    k, v = torch.cat([k for k, _ in sources], dim=-2), torch.cat([v for _, v in sources], dim=-2)  # (B, H, T·S, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ----------------------------------------------------------------------------- joint attention


def joint_attention_reference(q, k_glob, v_glob, k_loc, v_loc):
    """Naive joint attention: explicit scores, mask and ONE softmax over [K_glob; K_loc]."""
    n = q.size(-2)
    scores = torch.cat([q @ k_glob.transpose(-2, -1), q @ k_loc.transpose(-2, -1)], dim=-1)  # (B, H, N, 2N)
    scores = scores / math.sqrt(q.size(-1))
    kv, qi = torch.arange(2 * n, device=q.device), torch.arange(n, device=q.device)
    allowed = (kv[None, :] % n) <= qi[:, None]  # (N, 2N): key j of either source is visible iff j <= i
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs @ torch.cat([v_glob, v_loc], dim=-2)  # (B, H, N, hd)


def joint_mask(n: int, device) -> torch.Tensor:
    """Boolean (N, 2N) mask `(kv mod N) <= q`. Built on each call, not cached in a module-level dict: torch.compile
    guards on such a dict and recompiles once it fills; the build costs two aranges and a compare."""
    kv, qi = torch.arange(2 * n, device=device), torch.arange(n, device=device)
    return (kv[None, :] % n) <= qi[:, None]


def joint_attention_masked(q, k_glob, v_glob, k_loc, v_loc):
    """Joint attention as one fused SDPA call over the concatenated 2N keys with the joint mask."""
    k, v = torch.cat([k_glob, k_loc], dim=-2), torch.cat([v_glob, v_loc], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=joint_mask(q.size(-2), q.device))


def merge_by_lse(o_a, lse_a, o_b, lse_b):
    """Combine two attention outputs over disjoint key sets into one softmax over their union."""
    lse = torch.logaddexp(lse_a, lse_b)  # (B, H, N)
    w_a, w_b = (lse_a - lse).exp().unsqueeze(-1), (lse_b - lse).exp().unsqueeze(-1)
    dt = torch.promote_types(o_a.dtype, torch.float32)  # bf16/fp16 merged in fp32, fp64 stays fp64
    out = w_a * o_a.to(dt) + w_b * o_b.to(dt)
    # cast only when needed: torch 2.11 under torch.compile zeroes _JointFlash's gradients when its output is a no-op .to()
    return (out if out.dtype == o_a.dtype else out.to(o_a.dtype)), lse


class _JointFlash(torch.autograd.Function):
    """Two causal flash-attention calls merged by log-sum-exp, with an exact backward (CPU and CUDA).

    The flash kernels' logsumexp carries no gradient, so a naive merge is wrong in backward.
    Flash backward only needs (dO, O, LSE): given the *merged* O and LSE, each half's
    backward reproduces its share of the one joint softmax, and dq is their sum.
    """

    @staticmethod
    def forward(ctx, q, k_glob, v_glob, k_loc, v_loc):
        o_g, lse_g, state_g = kernels.causal_flash_forward(q, k_glob, v_glob)
        o_l, lse_l, state_l = kernels.causal_flash_forward(q, k_loc, v_loc)
        out, lse = merge_by_lse(o_g, lse_g, o_l, lse_l)
        ctx.save_for_backward(q, k_glob, v_glob, k_loc, v_loc, out, lse, *state_g, *state_l)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k_glob, v_glob, k_loc, v_loc, out, lse, *state = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq_g, dk_g, dv_g = kernels.causal_flash_backward(d_out, q, k_glob, v_glob, out, lse, state[:2])
        dq_l, dk_l, dv_l = kernels.causal_flash_backward(d_out, q, k_loc, v_loc, out, lse, state[2:])
        return dq_g + dq_l, dk_g, dv_g, dk_l, dv_l


def joint_attention_flash(q, k_glob, v_glob, k_loc, v_loc):
    """Joint attention as two causal flash calls merged by log-sum-exp (about 2x one causal call)."""
    return _JointFlash.apply(q, k_glob, v_glob, k_loc, v_loc)


def joint_attention(q, k_glob, v_glob, k_loc, v_loc):
    """One softmax over Global keys j<=i and Local keys j<=i. All tensors (B, H, N, hd).

    Runs `joint_attention_flash` where the flash kernels exist (CPU; CUDA in bf16/fp16), else the
    masked SDPA call with a logged reason; `kernels.joint_attention_impl` decides, and
    `kernels.set_joint_attention` overrides it (e.g. "flex"). See `bench attention` and `bench gpu`.
    """
    dtype = kernels.attention_dtype(q, k_glob, v_glob, k_loc, v_loc)  # under autocast: one dtype for the kernel
    q, k_glob, v_glob, k_loc, v_loc = (t.to(dtype) for t in (q, k_glob, v_glob, k_loc, v_loc))
    impl = kernels.joint_attention_impl(q.device.type, q.device.index, dtype, q.size(-1))
    if impl == "flash":
        return joint_attention_flash(q, k_glob, v_glob, k_loc, v_loc)
    if impl == "flex":
        return kernels.joint_attention_flex(q, k_glob, v_glob, k_loc, v_loc)
    return joint_attention_masked(q, k_glob, v_glob, k_loc, v_loc)


# ----------------------------------------------------------------------------- attention and blocks


class Attention(nn.Module):
    """Causal multi-head attention with RoPE; in an AsymLoop decoder layer it also owns
    the layer's Global KV projections and attends jointly to Global and Local KV."""

    def __init__(self, cfg: ModelConfig, global_kv: bool = False, local_kv: bool = True):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.n_head, self.has_global, self.has_local = cfg.n_head, global_kv, local_kv
        self.wq = nn.Linear(d, d, bias=False)
        if local_kv:
            self.wk = nn.Linear(d, d, bias=False)
            self.wv = nn.Linear(d, d, bias=False)
        if global_kv:  # K_glob_l = Hn·Wk_glob_l, V_glob_l = Hn·Wv_glob_l, each d -> d
            self.wk_glob = nn.Linear(d, d, bias=False)
            self.wv_glob = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        # QKNorm (ours: its form): RMSNorm over the head dim, a learnable gain per channel. (ours) Global keys get
        # their own scale, like their own projections, so the two sources can be weighed.
        self.q_norm = RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm and local_kv else nn.Identity()
        self.k_glob_norm = RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm and global_kv else nn.Identity()

    def heads(self, x):  # (B, N, d) -> (B, H, N, hd)
        b, n, _ = x.shape
        return x.view(b, n, self.n_head, -1).transpose(1, 2)

    def global_kv(self, h_norm, rope, start: int = 0):
        """This layer's Global KV from the normed encoder output: QKNorm + RoPE once, reused by every iteration."""
        k = rope(self.k_glob_norm(self.heads(self.wk_glob(h_norm))), start)
        return k, self.heads(self.wv_glob(h_norm))

    def forward(self, x, rope, kv_glob=None, cache=None, start: int = 0):
        q = rope(self.q_norm(self.heads(self.wq(x))), start)  # (B, H, N, hd) at positions start..start+N-1
        if self.has_local:
            k = rope(self.k_norm(self.heads(self.wk(x))), start)
            v = self.heads(self.wv(x))
            if cache is not None:  # generation: append this call's keys to the earlier tokens' keys
                k, v = cache.append(k, v)  # (B, H, start+N, hd)
        if start:  # queries after a cached prefix: no is_causal / joint mask, they assume start 0
            sources = ([kv_glob] if kv_glob is not None else []) + ([(k, v)] if self.has_local else [])
            y = attention_after_prefix(q, sources)
        elif kv_glob is None:
            y = causal_attention(q, k, v)  # dense, full_loop, encoder, or decoder without Global KV
        elif not self.has_local:
            y = causal_attention(q, *kv_glob)  # "without Local KV" ablation
        else:
            y = joint_attention(q, *kv_glob, k, v)
        b, h, n, hd = y.shape
        return self.wo(y.transpose(1, 2).reshape(b, n, h * hd))


class Block(nn.Module):
    """LLaMA-style pre-norm block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).

    backbone="olmo2" moves the same two RMSNorms onto the sublayer outputs (OLMo-2's reordered norm):
    x + RMSNorm(Attn(x)), then x + RMSNorm(MLP(x)). Same parameters, nothing else changes here.
    """

    def __init__(self, cfg: ModelConfig, global_kv: bool = False, local_kv: bool = True):
        super().__init__()
        self.norm_on_output = cfg.backbone == "olmo2"
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, global_kv, local_kv)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.moe_experts else SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x, rope, kv_glob=None, cache=None, start: int = 0):
        if self.norm_on_output:  # OLMo-2
            x = x + self.attn_norm(self.attn(x, rope, kv_glob, cache, start))
            return x + self.mlp_norm(self.mlp(x))
        x = x + self.attn(self.attn_norm(x), rope, kv_glob, cache, start)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------- the three architectures


class LoopedLM(nn.Module):
    """Dense, Full Loop or AsymLoop language model (the paper's Section 3); `forward` returns (logits, loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        if cfg.arch == "asymloop":
            glob = cfg.context == "global_kv"
            self.encoder = nn.ModuleList(Block(cfg) for _ in range(cfg.n_enc))
            if glob:  # (ours) one shared RMSNorm on the encoder output feeds every layer's Global KV
                self.enc_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
            dec_cfg = cfg if cfg.dec_d_ff is None else replace(cfg, d_ff=cfg.dec_d_ff)  # Table 4a's wider decoder FFN
            self.decoder = nn.ModuleList(Block(dec_cfg, glob, cfg.local_kv) for _ in range(cfg.n_dec))
        else:
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from embed
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(ours) GPT-2 style: N(0, init_std) for every matrix; residual output projections
        (wo, mlp.down) scaled by 1/sqrt(2·effective_depth), the number of residual adds per pass."""
        std, depth = self.config.init_std, self.config.effective_depth
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1:
                nn.init.ones_(p)  # RMSNorm scales
            elif name.endswith(("wo.weight", "down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * depth))
            else:
                nn.init.normal_(p, 0.0, std)
        self.rope.reset_parameters()

    def global_kv(self, h, start: int = 0, cache=None):
        """Per decoder layer (K_glob, V_glob) from the encoder output H, computed once per forward and cast
        once to the dtype joint attention runs in, so no iteration casts them again."""
        h_norm = self.enc_norm(h)
        kv = [blk.attn.global_kv(h_norm, self.rope, start) for blk in self.decoder]
        dtype = kernels.attention_dtype(h_norm)  # autocast's dtype when it is on, else the activations'
        kv = [(k.to(dtype), v.to(dtype)) for k, v in kv]
        if cache is not None:  # generation: appended once per new token, shared by all K iterations
            kv = [cache.layer("global", i).append(*kv_i) for i, kv_i in enumerate(kv)]
        return kv

    def states(self, idx, n_iter: int | None = None, cache=None, backprop_depth: int | None = None) -> list[torch.Tensor]:
        """Residual states [z_1, ..., z_K] after each iteration (one entry for dense).

        z_k does not depend on the total K, so one call at the largest K gives every
        smaller K's state: the per-iteration logit lens is `model.logits(z_k)`.
        With a KVCache, idx holds only the tokens after those already cached.
        backprop_depth n (ours, after Huginn): the first K - n iterations run without a graph (depth.py); None: all K.
        """
        cfg, n_iter = self.config, n_iter or self.config.n_iter
        if n_iter < 1:
            raise ValueError(f"n_iter must be >= 1, got {n_iter}")
        start = 0 if cache is None else cache.pos  # position of idx[:, 0]
        if start + idx.size(1) > cfg.max_seq_len:
            raise ValueError(f"sequence length {start + idx.size(1)} exceeds max_seq_len={cfg.max_seq_len}; "
                             f"shorten the input or build the model with a larger max_seq_len")
        if cache is not None:
            cache.advance(idx.size(1), n_iter)
        lc = (lambda *key: None) if cache is None else cache.layer  # this call's per-layer KV cache
        x = self.embed(idx)  # (B, N, d)
        if cfg.arch == "dense":
            for i, blk in enumerate(self.blocks):
                x = blk(x, self.rope, cache=lc("block", 0, i), start=start)
            return [x]
        no_grad_iters = max(n_iter - backprop_depth, 0) if backprop_depth else 0  # truncated backprop through the loop
        if cfg.arch == "full_loop":  # z_0 = embed(x), z_k = Stack(z_{k-1})
            out = []
            for k in range(n_iter):
                with torch.no_grad() if k < no_grad_iters else nullcontext():
                    for i, blk in enumerate(self.blocks):
                        x = blk(x, self.rope, cache=lc("block", k, i), start=start)
                out.append(x)
            return out
        for i, blk in enumerate(self.encoder):  # H = Enc(embed(x)), run once
            x = blk(x, self.rope, cache=lc("enc", i), start=start)
        h = x
        kv = self.global_kv(h, start, cache) if cfg.context == "global_kv" else [None] * cfg.n_dec
        z = torch.zeros_like(h) if cfg.context == "additive" else h  # z_0
        out = []
        for k in range(n_iter):  # z_k = Dec(z_{k-1}), decoder weights shared across k
            with torch.no_grad() if k < no_grad_iters else nullcontext():
                if cfg.context == "additive":
                    z = z + h  # additive injection: z_k = Dec(z_{k-1} + H)
                for i, (blk, kv_l) in enumerate(zip(self.decoder, kv)):
                    # Local KV per (iteration, layer): the decoder state differs at each iteration
                    z = blk(z, self.rope, kv_l, lc("local", k, i), start)
            out.append(z)
        return out

    def logits(self, z):
        return self.head(self.norm(z))  # (B, N, V)

    def forward(self, idx, targets=None, n_iter: int | None = None, return_logits: bool = True,
                backprop_depth: int | None = None):
        """(logits, loss). The loss (with targets; -1 ignored) is the cross-entropy of the logits when they are
        returned (one output head), else, with return_logits=False (training and validation), it comes from the
        final norm's output through `linear_cross_entropy`, which never holds all the fp32 logits, and (None, loss)
        is returned. With MoE, loss adds the routers' aux losses in training mode only, so in eval mode it is the
        plain cross-entropy (validation excludes them)."""
        moe = self.moe_layers()
        for m in moe.values():
            m.reset_stats()
        h = self.norm(self.states(idx, n_iter, backprop_depth=backprop_depth)[-1])  # (B, N, d)
        logits = self.head(h) if return_logits or targets is None else None  # (B, N, V)
        loss = None
        if targets is not None:
            if logits is not None:  # the logits exist already: no second pass through the head
                loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-1)
            else:
                loss = linear_cross_entropy(h, self.head.weight, targets)
            if moe and self.training:
                loss = loss + sum(self.moe_aux_losses().values())
        return logits, loss

    # ------------------------------------------------------------------------- MoE bookkeeping

    def moe_layers(self) -> dict[str, MoE]:
        return {name: m for name, m in self.named_modules() if isinstance(m, MoE)}

    def moe_aux_losses(self) -> dict[str, torch.Tensor]:
        """The last forward's weighted aux losses, as added to the training loss: load balancing and router
        z-loss, each averaged over every executed MoE call (layers × iterations; ours: a mean, not a sum,
        so the weights keep their meaning at any depth or K). Empty for a dense FFN."""
        cfg, moe = self.config, self.moe_layers().values()
        calls = sum(m.n_calls for m in moe)
        if not calls:
            return {}
        return {"moe_balance_loss": cfg.moe_balance_weight * sum(m.balance_sum for m in moe) / calls,
                "moe_z_loss": cfg.moe_z_weight * sum(m.z_sum for m in moe) / calls}

    @torch.no_grad()
    def moe_load_entropy(self) -> dict[str, torch.Tensor]:
        """Entropy (nats, a 0-dim tensor on the model's device) of each MoE layer's expert load in the last forward,
        summed over its iterations: log(moe_experts) = perfectly balanced, 0 = every token on one expert."""
        out = {}
        for name, m in self.moe_layers().items():
            if m.n_calls:
                share = m.load.float() / m.load.sum()
                out[f"moe_load_entropy/{name.removesuffix('.mlp')}"] = torch.special.entr(share).sum()
        return out

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 n_iter: int | None = None, use_cache: bool = True, stop_id: int | None = None,
                 exit_threshold: float | None = None, max_iter: int | None = None):
        """Append up to max_new_tokens sampled tokens to idx (B, T), KV-cached (see minimal_asymloop.generate);
        exit_threshold: adaptive depth per token, up to max_iter iterations."""
        return generation.generate(self, idx, max_new_tokens, temperature, top_k, n_iter, use_cache, stop_id,
                                   exit_threshold, max_iter)
