"""linear_cross_entropy: the same loss and gradients as materializing every logit in fp32, in less memory; and the
model's training and validation loss go through it."""

import pytest
import torch

from minimal_asymloop import model as M
from minimal_asymloop.loss import compute_loss, linear_cross_entropy, plain_cross_entropy
from minimal_asymloop.system import peak_new_bytes


def _inputs(t=50, d=16, v=97, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, v, (t,), generator=g)
    if ignore:
        y[::7] = -1  # ignored targets, as in fine-tuning's prompts
    return h, w, y


def _loss_and_grads(fn, h, w, y):
    loss = fn(h, w, y)
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("chunk", [1, 7, 50, None])
def test_equals_the_plain_loss_and_gradients_in_fp32(chunk):
    """Any chunking (uneven, one token, one chunk) gives the plain fp32 loss and both gradients, ignoring targets -1."""
    h, w, y = _inputs()
    ref = _loss_and_grads(plain_cross_entropy, h, w, y)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=chunk), h, w, y)
    for name, a, b in zip(("loss", "dh", "dw"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert got[0].dtype == torch.float32


def test_the_comparison_can_fail():
    """The tolerance above is tight enough to see a wrong gradient: ignoring nothing changes both."""
    h, w, y = _inputs()
    ref = _loss_and_grads(plain_cross_entropy, h, w, y)
    wrong = _loss_and_grads(linear_cross_entropy, h, w, y.clamp_min(0))
    assert not torch.allclose(wrong[0], ref[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(wrong[1], ref[1], rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_matches_a_bf16_linear_then_fp32_cross_entropy():
    """Autocast: matmuls in bf16 as nn.Linear would, softmax in fp32; fp32 loss, gradients in the inputs' dtypes."""
    h, w, y = _inputs(t=64, d=32, v=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(plain_cross_entropy, h, w, y)
        got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk=16), h, w, y)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_without_gradients_it_computes_only_the_loss():
    h, w, y = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk=8), plain_cross_entropy(h, w, y))


def test_peak_memory_is_lower_measured():
    """Bytes of live tensors at the peak of forward + backward (storages, CPU): plain holds the fp32 logits, their
    log-softmax and its gradient (3 x T x V x 4 bytes); chunked holds one chunk's logits and the two gradients.
    The figures for real shapes: `python -m minimal_asymloop.bench loss`."""
    h, w, y = _inputs(t=1024, d=32, v=4096, ignore=False)
    logits = 1024 * 4096 * 4

    def run(fn):
        return lambda: fn(h, w, y).backward()

    plain = peak_new_bytes(run(plain_cross_entropy))
    chunked = peak_new_bytes(run(lambda *a: linear_cross_entropy(*a, chunk=128)))
    assert plain >= 3 * logits  # the measurement sees what the plain loss holds
    assert chunked < logits / 2, (chunked, plain)


def test_model_loss_is_the_cross_entropy_of_its_logits_and_training_skips_the_logits():
    """model(idx, targets) is the plain fp32 cross-entropy of model(idx)'s logits, value and gradients; the training
    and validation path (compute_loss) gets no logits, and model(idx) still returns them for generation and probes."""
    cfg = M.ModelConfig.from_preset("tiny", "asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = M.LoopedLM(cfg)
    idx = torch.randint(0, 64, (2, 16))
    y = idx.roll(-1, dims=1)
    y[:, -1] = -1
    logits, loss = model(idx, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = torch.nn.functional.cross_entropy(model(idx)[0].float().flatten(0, 1), y.flatten(), ignore_index=-1)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert logits.shape == (2, 16, 64)
    none, loss2 = model(idx, y, return_logits=False)
    assert none is None and torch.allclose(loss2, loss, rtol=1e-6, atol=0)  # the chunked path, to float rounding
    train_loss, ce, aux = compute_loss(model, idx, y)
    assert torch.equal(ce, loss2) and aux == {}


def test_a_call_that_returns_the_logits_runs_the_output_head_once(monkeypatch):
    """model(x, y) takes its loss from the logits it returns; the chunked linear + cross-entropy (a second pass through the
    head's matmul) runs only when the logits are not asked for, as in training (compute_loss)."""
    calls = []
    real = M.linear_cross_entropy
    monkeypatch.setattr(M, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = M.LoopedLM(M.ModelConfig(arch="asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=64, max_seq_len=32))
    idx = torch.randint(0, 64, (2, 16))
    logits, loss = model(idx, idx)
    assert calls == [] and logits is not None
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten()))
    model(idx, idx, return_logits=False)
    assert calls == [1]
