import math

import pytest
import torch

from minimal_asymloop.flops import count_params, flops_per_token
from minimal_asymloop.model import (
    LoopedLM,
    ModelConfig,
    joint_attention,
    joint_attention_masked,
    joint_attention_reference,
)

V = 97


def tiny(arch="asymloop", **kw):
    base = dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=32)
    return ModelConfig(arch=arch, **{**base, **kw})


# every architecture and every ablation of the paper's Section 3
VARIANTS = {
    "dense": tiny("dense"),
    "full_loop": tiny("full_loop"),
    "asymloop": tiny(),
    "asym_no_global_kv": tiny(context="none"),
    "asym_no_local_kv": tiny(local_kv=False),
    "asym_additive": tiny(context="additive"),
    "asym_no_qknorm": tiny(qk_norm=False),
    "asym_E1": tiny(n_enc=1, n_iter=2),
    "dense_qknorm": tiny("dense", qk_norm=True),
}


def model_for(cfg, seed=0):
    torch.manual_seed(seed)
    return LoopedLM(cfg).eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_shapes_and_finite_loss(name):
    cfg = VARIANTS[name]
    m = model_for(cfg)
    idx = torch.randint(0, V, (2, 11))
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 11, V)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(V)) < 1.0  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("name", VARIANTS)
def test_causality(name):
    m = model_for(VARIANTS[name])
    idx = torch.randint(0, V, (1, 12))
    t = 7
    idx2 = idx.clone()
    idx2[0, t] = (idx[0, t] + 1) % V
    with torch.no_grad():
        a, b = m(idx)[0], m(idx2)[0]
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-4)  # the change is seen from t on


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("heads", [1, 3, 6])
def test_fast_joint_attention_matches_reference(n, heads):
    g = torch.Generator().manual_seed(n * 10 + heads)
    xs = [torch.randn(2, heads, n, 16, generator=g, requires_grad=True) for _ in range(5)]
    dout = torch.randn(2, heads, n, 16, generator=g)
    outs, grads = [], []
    for fn in (joint_attention_reference, joint_attention, joint_attention_masked):
        o = fn(*xs)
        outs.append(o)
        grads.append(torch.autograd.grad(o, xs, dout))
    for o, gr in zip(outs[1:], grads[1:]):
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(gr, grads[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fast_joint_attention_is_exact_in_float64():
    """The log-sum-exp merge keeps float64 (it once rounded both halves through fp32: off by about 1e-8)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 17, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    dout = torch.randn(2, 3, 17, 16, generator=g, dtype=torch.float64)
    fast, ref = joint_attention(*xs), joint_attention_reference(*xs)
    assert (fast - ref).abs().max() < 1e-13
    for a, b in zip(torch.autograd.grad(fast, xs, dout), torch.autograd.grad(ref, xs, dout)):
        assert (a - b).abs().max() < 1e-12


def test_joint_attention_hand_computed():
    # N=2, one head, hd=2. Scores are q·k/sqrt(2); query 0 sees {g0, l0}, query 1 sees {g0, g1, l0, l1}.
    s2 = math.sqrt(2.0)
    q = torch.tensor([[s2, 0.0], [0.0, s2]]).view(1, 1, 2, 2)
    kg = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    kl = torch.tensor([[0.0, 0.0], [1.0, 1.0]]).view(1, 1, 2, 2)
    vg = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    vl = torch.tensor([[2.0, 2.0], [-1.0, 3.0]]).view(1, 1, 2, 2)
    # query 0: scores g0=1, l0=0 -> p = (e, 1)/(e+1)
    e = math.e
    o0 = [(e * 1 + 1 * 2) / (e + 1), (e * 0 + 1 * 2) / (e + 1)]
    # query 1: scores g0=0, g1=1, l0=0, l1=1 -> weights (1, e, 1, e)/(2+2e)
    z = 2 + 2 * e
    o1 = [(1 * 1 + e * 0 + 1 * 2 + e * -1) / z, (1 * 0 + e * 1 + 1 * 2 + e * 3) / z]
    expected = torch.tensor([o0, o1]).view(1, 1, 2, 2)
    for fn in (joint_attention_reference, joint_attention, joint_attention_masked):
        torch.testing.assert_close(fn(q, kg, vg, kl, vl), expected, atol=1e-6, rtol=1e-6)
    # one softmax is not two: averaging two separate softmaxes gives another answer
    two = 0.5 * (torch.softmax(q @ kg.mT / s2 + torch.triu(torch.full((2, 2), -1e9), 1), -1) @ vg
                 + torch.softmax(q @ kl.mT / s2 + torch.triu(torch.full((2, 2), -1e9), 1), -1) @ vl)
    assert not torch.allclose(two, expected, atol=1e-3)


def test_param_count_independent_of_k_and_global_kv_difference():
    for arch in ("full_loop", "asymloop"):
        counts = {k: count_params(tiny(arch, n_iter=k)) for k in (1, 2, 5)}
        assert len(set(counts.values())) == 1, counts
    cfg = tiny()
    d, hd, D = cfg.d_model, cfg.head_dim, cfg.n_dec
    # asymloop adds Wk_glob, Wv_glob (2d² per decoder layer), the shared encoder-output norm (d),
    # and QKNorm scales (q, k_loc, k_glob: 3·hd per decoder layer, q, k: 2·hd per encoder layer)
    expected = 2 * d * d * D + d + 3 * hd * D + 2 * hd * cfg.n_enc
    assert count_params(cfg) - count_params(tiny("dense")) == expected
    # with QKNorm matched, the difference is exactly the Global KV projections plus the norms
    diff = count_params(tiny(qk_norm=False)) - count_params(tiny("dense"))
    assert diff == 2 * d * d * D + d
    # sum over the real module equals the meta-device count
    assert sum(p.numel() for p in LoopedLM(cfg).parameters()) == count_params(cfg)


def test_meta_device_1b():
    cfg = ModelConfig.from_preset("1b")
    with torch.device("meta"):
        m = LoopedLM(cfg)
    assert all(p.is_meta for p in m.parameters())
    assert count_params(cfg) > 1.3e9


def test_n_iter_override_changes_output_and_is_used():
    m = model_for(tiny())
    idx = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        base = m(idx)[0]
        again = m(idx, n_iter=3)[0]
        other = m(idx, n_iter=5)[0]
        states = m.states(idx, n_iter=5)
    torch.testing.assert_close(base, again)
    assert not torch.allclose(base, other, atol=1e-4)
    assert len(states) == 5
    # z_k does not depend on the total K: the third state of a K=5 pass is the K=3 output
    torch.testing.assert_close(m.logits(states[2]), base, atol=1e-5, rtol=1e-5)


def test_asymloop_without_context_k1_equals_dense():
    asym = model_for(tiny(context="none", n_iter=1, qk_norm=False), seed=1)
    dense = model_for(tiny("dense"), seed=2)
    E = asym.config.n_enc
    mapped = {}
    for name, t in asym.state_dict().items():
        if name.startswith("encoder."):
            name = "blocks." + name[len("encoder."):]
        elif name.startswith("decoder."):
            i, rest = name[len("decoder."):].split(".", 1)
            name = f"blocks.{int(i) + E}.{rest}"
        mapped[name] = t
    dense.load_state_dict(mapped)  # strict: the two parameter sets map one to one
    idx = torch.randint(0, V, (3, 13))
    with torch.no_grad():
        torch.testing.assert_close(asym(idx)[0], dense(idx)[0], atol=1e-6, rtol=1e-6)
    assert asym.config.effective_depth == dense.config.effective_depth == 4


def test_presets_match_the_papers_configurations():
    table = {"60m": (6, 3, 768, 2048, 6), "135m": (12, 6, 768, 2048, 12),
             "350m": (24, 12, 1024, 2736, 16), "1b": (24, 12, 2048, 5461, 32)}
    for size, (L, E, d, dff, h) in table.items():
        c = ModelConfig.from_preset(size)
        assert (c.n_layer, c.n_enc, c.d_model, c.d_ff, c.n_head, c.vocab_size, c.max_seq_len) == \
            (L, E, d, dff, h, 32128, 1024)
        assert c.n_iter == 3 and c.qk_norm and c.context == "global_kv" and c.effective_depth == E + 3 * (L - E)
    assert ModelConfig.from_preset("60m", "dense").n_iter == 1
    assert ModelConfig.from_preset("60m", "full_loop").n_iter == 2
    assert not ModelConfig.from_preset("60m", "full_loop").qk_norm
    assert ModelConfig.from_preset("60m", "full_loop").effective_depth == 12


@pytest.mark.parametrize("kwargs, match", [
    (dict(size="7b"), "unknown size '7b'; choose one of tiny, 60m"),
    (dict(size="tiny", arch="loop"), "unknown arch 'loop'"),
    (dict(size="tiny", n_head=5), "not divisible by n_head=5"),
    (dict(size="tiny", n_enc=0), r"n_enc=0 must be in 1\.\.3"),
    (dict(size="tiny", n_enc=4), r"n_enc=4 must be in 1\.\.3"),
    (dict(size="tiny", n_iter=0), "n_iter"),
    (dict(size="tiny", arch="full_loop", context="additive"), "applies only to arch='asymloop'"),
    (dict(size="tiny", context="sideways"), "unknown context"),
    (dict(size="tiny", context="none", local_kv=False), "nothing to attend to"),
    (dict(size="tiny", d_modle=3), "unknown ModelConfig field"),
])
def test_invalid_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_preset(**kwargs)


def test_too_long_sequence_is_a_clear_error():
    m = model_for(tiny())
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_flops_hand_checked():
    d, dff, V_, N = 4, 6, 10, 8
    blk = 8 * d * d + 6 * d * dff + 4 * N * d  # 128 + 144 + 128 = 400
    assert blk == 400
    base = dict(n_layer=4, d_model=d, n_head=2, d_ff=dff, vocab_size=V_, max_seq_len=N)
    f = flops_per_token(ModelConfig(arch="dense", **base), N)
    assert f == dict(total=4 * 400 + 80, blocks=1600, head=80, global_kv_proj=0, global_attn=0)
    f = flops_per_token(ModelConfig(arch="full_loop", n_iter=2, **base), N)
    assert f["blocks"] == 3200 and f["total"] == 3280
    f = flops_per_token(ModelConfig(arch="asymloop", n_iter=3, **base), N)  # E=D=2
    assert f["blocks"] == (2 + 3 * 2) * 400
    assert f["global_kv_proj"] == 4 * d * d * 2 == 128
    assert f["global_attn"] == 4 * N * d * 2 * 3 == 768
    assert f["head"] == 80 and f["total"] == 3200 + 128 + 768 + 80
    f = flops_per_token(ModelConfig(arch="asymloop", context="none", **base), N)
    assert f["global_kv_proj"] == f["global_attn"] == 0


def test_fast_path_is_used_in_the_model_and_matches_reference(monkeypatch):
    import minimal_asymloop.model as M

    m = model_for(tiny())
    idx = torch.randint(0, V, (2, 10))
    fast, _ = m(idx)
    monkeypatch.setattr(M, "joint_attention", M.joint_attention_reference)
    ref, _ = m(idx)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_rmsnorm_keeps_float64_exact_and_returns_the_input_dtype():
    """fp64 input is normalized in fp64 (an fp32 pass would lose ~1e-7, which the notebooks' fp64 checks would see),
    lower precisions compute in fp32 and come back in their own dtype."""
    from minimal_asymloop.model import RMSNorm

    norm = RMSNorm(64, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(8, 64, dtype=torch.float64) * 3
    exact = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert (norm(x) - exact).abs().max() < 1e-12
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert norm.to(dt)(x.to(dt)).dtype == dt
