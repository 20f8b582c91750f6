"""Joint attention's implementations (flash LSE merge, FlexAttention, masked SDPA) and which one runs.

CPU checks values; FakeTensorMode traces the CUDA path (shapes, dtypes, op signatures) without a GPU;
the tests marked `cuda` check values on a GPU when one is present.
"""

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from minimal_asymloop import kernels
from minimal_asymloop import model as M
from minimal_asymloop.model import (
    _JointFlash,
    joint_attention,
    joint_attention_flash,
    joint_attention_masked,
    joint_attention_reference,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
IMPLS = {"flash": joint_attention_flash, "flex": kernels.joint_attention_flex, "masked": joint_attention_masked,
         "auto": joint_attention}


@pytest.fixture(autouse=True)
def _auto_choice():
    kernels.set_joint_attention("auto")
    kernels._reported.clear()
    yield
    kernels.set_joint_attention("auto")


def inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_() for _ in range(5)]


def recording_dtypes(fn, calls):
    """fn, appending the dtypes of its tensor arguments to `calls` at each call."""
    def wrapped(*ts):
        calls.append(tuple(t.dtype for t in ts))
        return fn(*ts)
    return wrapped


def forward_backward(fn, xs, d_out):
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, d_out)
    return out, grads


@pytest.mark.parametrize("impl", ["flash", "masked", "auto"])
@pytest.mark.parametrize("n", [1, 37])
def test_joint_attention_impls_equal_reference(impl, n):
    """Forward and all five gradients (q, K_glob, V_glob, K_loc, V_loc) against the naive reference, float64."""
    xs = inputs((2, 3, n, 16), torch.float64)
    d_out = torch.randn(2, 3, n, 16, dtype=torch.float64)
    ref, ref_grads = forward_backward(joint_attention_reference, xs, d_out)
    out, grads = forward_backward(IMPLS[impl], xs, d_out)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for name, g, r in zip(("dq", "dK_glob", "dV_glob", "dK_loc", "dV_loc"), grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{impl} {name}: {m}")


@pytest.mark.parametrize("n", [1, 37, 200])
def test_flex_forward_equals_reference_on_cpu(n):
    """FlexAttention's block mask (kv mod N) <= q; on CPU it runs forward only (no backward there), unfused."""
    xs = [x.detach() for x in inputs((2, 3, n, 16), torch.float64)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = kernels.joint_attention_flex(*xs)
    torch.testing.assert_close(out, joint_attention_reference(*xs), atol=1e-6, rtol=1e-6)


def test_merged_lse_is_needed_in_backward():
    """The exact backward must see the MERGED log-sum-exp: each half's own would give wrong gradients."""
    xs = inputs((1, 2, 9, 8), torch.float64)
    d_out = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    _, ref_grads = forward_backward(joint_attention_reference, xs, d_out)
    q, kg, vg = (x.detach() for x in xs[:3])
    o_g, lse_g, state = kernels.causal_flash_forward(q, kg, vg)
    dq_own, *_ = kernels.causal_flash_backward(d_out, q, kg, vg, o_g, lse_g, state)  # its own softmax only
    assert not torch.allclose(dq_own, ref_grads[0], atol=1e-3)


def test_compiled_flash_path_has_no_graph_break_and_matches():
    """torch.compile (fullgraph, aot_eager so it runs on CPU) traces the autograd.Function, the dtype rule and
    the implementation choice without a graph break, and gives the same values and gradients."""
    xs = inputs((2, 2, 24, 16), torch.float32)
    d_out = torch.randn(2, 2, 24, 16)
    ref, ref_grads = forward_backward(joint_attention, xs, d_out)
    compiled = torch.compile(joint_attention, backend="aot_eager", fullgraph=True)
    out, grads = forward_backward(compiled, xs, d_out)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_autocast_casts_fp32_qk_to_the_autocast_dtype():
    """QKNorm/RoPE-style fp32 q, k next to bf16 v: the kernel gets one dtype (bf16), gradients return in fp32."""
    xs = inputs((2, 2, 32, 16), torch.float32)
    xs[2], xs[4] = (x.detach().bfloat16().requires_grad_() for x in (xs[2], xs[4]))  # values arrive in bf16
    d_out = torch.randn(2, 2, 32, 16)
    ref, ref_grads = forward_backward(joint_attention_reference, [x.detach().double().requires_grad_() for x in xs], d_out.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = joint_attention(*xs)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, xs, d_out.bfloat16())
    assert [g.dtype for g in grads] == [x.dtype for x in xs]
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=6e-2, rtol=6e-2)


def test_implementation_choice_is_explicit(caplog):
    cpu = ("cpu", None)
    with caplog.at_level(logging.INFO, logger="minimal_asymloop.kernels"):
        assert kernels.joint_attention_impl(*cpu, torch.float32, 64) == "flash"
        assert kernels.joint_attention_impl(*cpu, torch.float16, 64) == "masked"  # no CPU flash kernel in fp16
    fallback = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(fallback) == 1 and "masked SDPA" in fallback[0].getMessage() and "float16" in fallback[0].getMessage()
    kernels.set_joint_attention("flex")
    assert kernels.joint_attention_impl("cuda", 0, torch.bfloat16, 64) == "flex"
    with pytest.raises(ValueError, match="FlexAttention has no backward on cpu"):
        kernels.joint_attention_impl(*cpu, torch.float32, 64)
    kernels.set_joint_attention("flash")
    with pytest.raises(ValueError, match="'flash' was forced but the CPU flash kernel has no torch.float16"):
        kernels.joint_attention_impl(*cpu, torch.float16, 64)
    with pytest.raises(ValueError, match="unknown joint attention implementation 'fast'; choose one of auto, flash, flex, masked"):
        kernels.set_joint_attention("fast")


def test_environment_variable_forces_an_implementation():
    def choice_with(value):
        code = "from minimal_asymloop import kernels; print(kernels._choice['impl'])"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, kernels.ENV: value})

    assert choice_with("masked").stdout.strip() == "masked"
    bad = choice_with("fastest")
    assert bad.returncode == 1 and "MINIMAL_ASYMLOOP_JOINT_ATTENTION: unknown joint attention implementation 'fastest'" in bad.stderr


def test_cuda_flash_rules_without_a_gpu():
    """The reasons CUDA falls back to the masked call (fp32, other devices) are worded for the user."""
    assert "needs bf16 or fp16" in kernels.flash_unsupported(torch.device("cuda"), torch.float32, 128)
    assert "no flash kernel on mps" == kernels.flash_unsupported(torch.device("mps"), torch.float32, 128)
    assert kernels.flash_unsupported(torch.device("cpu"), torch.bfloat16, 128) is None


# ----------------------------------------------------------------------------- the CUDA path, traced with fake tensors


class _Ctx:
    """Stands in for autograd's ctx: fake CUDA tensors cannot enter the autograd graph on a CPU-only torch."""

    def save_for_backward(self, *ts):
        self.saved_tensors = ts


@pytest.fixture
def fake_cuda_autocast(monkeypatch):
    """FakeTensorMode with CUDA bf16 autocast on, and the flash kernels declared available (as on an H100)."""
    monkeypatch.setattr(kernels, "flash_unsupported", lambda *a: None)
    calls = []
    fwd, bwd = kernels.causal_flash_forward, kernels.causal_flash_backward
    monkeypatch.setattr(kernels, "causal_flash_forward", lambda *ts: calls.append(("fwd", ts)) or fwd(*ts))
    monkeypatch.setattr(kernels, "causal_flash_backward", lambda *ts: calls.append(("bwd", ts)) or bwd(*ts))
    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)  # the context manager refuses without a GPU; the flag itself works
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            yield calls
        finally:
            torch.set_autocast_enabled("cuda", False)


def test_fake_cuda_flash_forward_and_backward(fake_cuda_autocast):
    """The CUDA flash forward and backward ops, with fp32 q/k and bf16 v under autocast, trace to bf16 on CUDA."""
    b, h, n, hd = 2, 6, 1024, 128
    q, kg, kl = (torch.randn(b, h, n, hd, device="cuda") for _ in range(3))  # fp32, as from QKNorm + RoPE
    vg, vl = (torch.randn(b, h, n, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dtype = kernels.attention_dtype(q, kg, vg, kl, vl)
    assert dtype == torch.bfloat16
    xs = [t.to(dtype) for t in (q, kg, vg, kl, vl)]
    ctx = _Ctx()
    out = _JointFlash.forward(ctx, *xs)
    assert (out.shape, out.dtype, out.device.type) == ((b, h, n, hd), torch.bfloat16, "cuda")
    grads = _JointFlash.backward(ctx, torch.randn(b, h, n, hd, device="cuda", dtype=torch.bfloat16))
    assert [(g.shape, g.dtype, g.device.type) for g in grads] == [((b, h, n, hd), torch.bfloat16, "cuda")] * 5
    lse = ctx.saved_tensors[6]
    assert (lse.shape, lse.dtype) == ((b, h, n), torch.float32)
    kinds = [k for k, _ in fake_cuda_autocast]
    assert kinds == ["fwd", "fwd", "bwd", "bwd"]
    assert all(t.device.type == "cuda" for _, ts in fake_cuda_autocast for t in ts[:3])


def test_fake_cuda_model_forward_reaches_flash_in_bf16(fake_cuda_autocast):
    """A whole AsymLoop forward on (fake) CUDA under bf16 autocast: every joint attention call takes the flash
    path with q, k, v in bf16 (QKNorm and RoPE keep the autocast dtype)."""
    cfg = M.ModelConfig.from_preset("tiny", "asymloop", n_layer=2, d_model=64, n_head=2, d_ff=64, vocab_size=128, max_seq_len=32)
    with torch.device("meta"):
        model = M.LoopedLM(cfg)
    state = {n: torch.empty(t.shape, device="cuda") for n, t in [*model.named_parameters(), *model.named_buffers()]}
    idx = torch.zeros(2, 32, dtype=torch.long, device="cuda")
    with torch.no_grad():
        logits, loss = torch.func.functional_call(model, state, (idx, idx))
    assert logits.shape == (2, 32, 128) and logits.device.type == "cuda" and loss.dtype == torch.float32
    fwd = [ts for kind, ts in fake_cuda_autocast if kind == "fwd"]
    assert len(fwd) == 2 * cfg.n_dec * cfg.n_iter  # two causal calls per joint attention
    assert {t.dtype for ts in fwd for t in ts} == {torch.bfloat16}


# ----------------------------------------------------------------------------- values on a GPU


@cuda
@pytest.mark.parametrize("impl", ["flash", "flex", "masked", "auto"])
def test_cuda_bf16_impls_match_fp32_reference(impl):
    xs = inputs((2, 4, 256, 128), torch.float32, "cuda")
    d_out = torch.randn(2, 4, 256, 128, device="cuda")
    ref, ref_grads = forward_backward(joint_attention_reference, xs, d_out)
    fn = torch.compile(IMPLS[impl]) if impl == "flex" else IMPLS[impl]
    xs16 = [x.detach().bfloat16().requires_grad_() for x in xs]
    out, grads = forward_backward(fn, xs16, d_out.bfloat16())
    for name, a, r in zip(("out", "dq", "dK_glob", "dV_glob", "dK_loc", "dV_loc"), (out, *grads), (ref, *ref_grads)):
        err = ((a.float() - r).abs().max() / r.abs().max()).item()  # bf16 against fp32, relative to the scale
        assert err <= 3e-2, f"{impl} {name}: max |error| / max |reference| = {err:.2e}"


@cuda
def test_cuda_autocast_fp32_qk_takes_flash():
    xs = inputs((2, 4, 128, 64), torch.float32, "cuda")
    assert kernels.joint_attention_impl("cuda", torch.cuda.current_device(), torch.bfloat16, 64) == "flash"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = joint_attention(*xs)
    assert out.dtype == torch.bfloat16
    ref = joint_attention_reference(*xs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- bf16 without silent fallbacks


@pytest.mark.parametrize("arch, backbone", [("asymloop", "llama"), ("full_loop", "llama"), ("asymloop", "olmo2")])
def test_bf16_autocast_has_no_fallback_warning_and_one_attention_dtype(monkeypatch, arch, backbone):
    """A bf16 autocast forward+backward raises no warning (an fp32 RMSNorm scale on bf16 input used to fall back
    from the fused kernel with a UserWarning), and q, k, v reach every attention call in bf16."""
    seen = []
    monkeypatch.setattr(M, "joint_attention", recording_dtypes(M.joint_attention, seen))
    monkeypatch.setattr(M, "causal_attention", recording_dtypes(M.causal_attention, seen))
    cfg = M.ModelConfig.from_preset("tiny", arch, n_layer=2, d_model=64, n_head=2, d_ff=64, vocab_size=128,
                                    max_seq_len=32, backbone=backbone)
    model = M.LoopedLM(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
    assert seen and {d for call in seen for d in call} == {torch.bfloat16}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


# ----------------------------------------------------------------------------- dtypes under CUDA autocast, traced


def test_fake_cuda_rmsnorm_returns_its_input_dtype(fake_cuda_autocast):
    """CUDA autocast in torch 2.13 runs F.rms_norm in fp32 (an fp32 rule that CPU autocast, and CUDA autocast in torch
    2.11, lack); with or without that rule the model's RMSNorm returns bf16 for bf16 input, and fp32 for fp32 input."""
    norm = M.RMSNorm(16)
    weight = {"weight": torch.ones(16, device="cuda")}
    x = torch.randn(2, 16, device="cuda", dtype=torch.bfloat16)
    assert torch.func.functional_call(norm, weight, (x,)).dtype == torch.bfloat16
    assert torch.func.functional_call(norm, weight, (x.float(),)).dtype == torch.float32


@pytest.mark.parametrize("arch, backbone", [("asymloop", "llama"), ("asymloop", "olmo2"), ("full_loop", "llama")])
def test_fake_cuda_autocast_dtypes_at_every_attention_call_and_norm(fake_cuda_autocast, monkeypatch, arch, backbone):
    """A whole forward on (fake) CUDA under bf16 autocast: q, k, v reach every attention call in bf16; every RMSNorm
    returns its input's dtype, so QKNorm's are bf16; each decoder layer's Global K and V are cast once per forward
    (the same tensors reach the kernel at every iteration); the loss is fp32."""
    attention_calls, norms = [], []
    monkeypatch.setattr(M, "joint_attention", recording_dtypes(M.joint_attention, attention_calls))
    monkeypatch.setattr(M, "causal_attention", recording_dtypes(M.causal_attention, attention_calls))
    cfg = M.ModelConfig.from_preset("tiny", arch, n_layer=2, d_model=64, n_head=2, d_ff=64, vocab_size=128, max_seq_len=32,
                                    backbone=backbone)
    with torch.device("meta"):
        model = M.LoopedLM(cfg)
    for name, m in model.named_modules():
        if isinstance(m, M.RMSNorm):
            m.register_forward_hook(lambda m, args, out, name=name: norms.append((name, args[0].dtype, out.dtype)))
    state = {n: torch.empty(t.shape, device="cuda") for n, t in [*model.named_parameters(), *model.named_buffers()]}
    idx = torch.zeros(2, 32, dtype=torch.long, device="cuda")
    with torch.no_grad():
        _, loss = torch.func.functional_call(model, state, (idx, idx))
    assert loss.dtype == torch.float32
    n_attn = cfg.effective_depth
    assert len(attention_calls) == n_attn and {d for call in attention_calls for d in call} == {torch.bfloat16}
    assert norms and all(d_in == d_out for _, d_in, d_out in norms), [n for n in norms if n[1] != n[2]]
    qk = [(name, d_out) for name, _, d_out in norms if name.endswith(("q_norm", "k_norm", "k_glob_norm"))]
    assert {d for _, d in qk} == ({torch.bfloat16} if cfg.qk_norm else set())
    if arch == "asymloop":
        glob = [ts[1:3] for kind, ts in fake_cuda_autocast if kind == "fwd"][::2]  # (k, v) of each layer's Global call
        for layer in range(cfg.n_dec):
            per_iter = glob[layer::cfg.n_dec]
            assert len(per_iter) == cfg.n_iter
            assert all(k is per_iter[0][0] and v is per_iter[0][1] for k, v in per_iter), f"decoder {layer}: Global KV recast"
