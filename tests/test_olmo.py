import pytest
import torch
import torch.nn.functional as F

from minimal_asymloop.flops import count_params, flops_per_token
from minimal_asymloop.model import Block, LoopedLM, ModelConfig, Rotary

V = 97


def tiny(arch="asymloop", **kw):
    base = dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=32)
    return ModelConfig(arch=arch, **{**base, **kw})


def rms(v, eps=1e-6):
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def hand_built_block(backbone):
    """d_model 4, 2 heads, d_ff 2: identity V projection, W_o = 2·I, norm scales (1, 2, 1, 1) and (1, 1, 3, 1)."""
    cfg = ModelConfig(arch="dense", n_layer=1, d_model=4, n_head=2, d_ff=2, vocab_size=V, max_seq_len=4,
                      backbone=backbone, qk_norm=False)
    blk = Block(cfg)
    with torch.no_grad():
        blk.attn.wq.weight.copy_(torch.eye(4))
        blk.attn.wk.weight.copy_(torch.eye(4))
        blk.attn.wv.weight.copy_(torch.eye(4))
        blk.attn.wo.weight.copy_(2 * torch.eye(4))
        blk.attn_norm.weight.copy_(torch.tensor([1.0, 2.0, 1.0, 1.0]))
        blk.mlp_norm.weight.copy_(torch.tensor([1.0, 1.0, 3.0, 1.0]))
        blk.mlp.gate.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        blk.mlp.up.weight.copy_(torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 1.0]]))
        blk.mlp.down.weight.copy_(torch.tensor([[1.0, 0], [0, 1.0], [1.0, 1.0], [0, 0]]))
    return blk, Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)


def test_olmo2_block_on_a_hand_built_example():
    # one token: attention over a single key returns its value, so Attn(a) = W_o·W_v·a = 2a
    x = torch.tensor([[[1.0, -2.0, 0.5, 3.0]]])  # (B=1, N=1, d=4)
    g_attn, g_mlp = torch.tensor([1.0, 2.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 3.0, 1.0])

    def mlp(a):  # gate reads dims 0,1, up reads dims 2,3; down writes (h0, h1, h0 + h1, 0)
        h = F.silu(a[..., :2]) * a[..., 2:]
        return torch.stack([h[..., 0], h[..., 1], h[..., 0] + h[..., 1], torch.zeros_like(h[..., 0])], -1)

    # LLaMA: norm on the sublayer input
    h = x + 2 * (g_attn * rms(x))
    llama = h + mlp(g_mlp * rms(h))
    # OLMo-2: the same norms on the sublayer output
    h = x + g_attn * rms(2 * x)
    olmo = h + g_mlp * rms(mlp(h))
    for backbone, expected in (("llama", llama), ("olmo2", olmo)):
        blk, rope = hand_built_block(backbone)
        with torch.no_grad():
            torch.testing.assert_close(blk(x, rope), expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(llama, olmo, atol=1e-3)


def test_olmo2_block_formula_on_random_weights():
    cfg = tiny("dense", backbone="olmo2")
    torch.manual_seed(0)
    blk, rope = Block(cfg), Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    for p in blk.parameters():  # random norm scales too
        torch.nn.init.normal_(p, 0.5, 0.3)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        h = x + blk.attn_norm(blk.attn(x, rope))
        torch.testing.assert_close(blk(x, rope), h + blk.mlp_norm(blk.mlp(h)))


@pytest.mark.parametrize("arch", ["dense", "full_loop", "asymloop"])
def test_switch_changes_only_the_norm_placement(arch):
    llama_cfg, olmo_cfg = tiny(arch, qk_norm=True), tiny(arch, backbone="olmo2")
    assert olmo_cfg.qk_norm  # QKNorm on by default with the OLMo-2 backbone
    assert tiny(arch, backbone="olmo2", qk_norm=False).qk_norm is False  # still an explicit switch
    torch.manual_seed(0)
    llama = LoopedLM(llama_cfg).eval()
    torch.manual_seed(0)
    olmo = LoopedLM(olmo_cfg).eval()
    # same parameters, same names, same initialization: only Block.forward differs
    a, b = llama.state_dict(), olmo.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert count_params(llama_cfg) == count_params(olmo_cfg)
    assert flops_per_token(llama_cfg) == flops_per_token(olmo_cfg)
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert not torch.allclose(llama(idx)[0], olmo(idx)[0], atol=1e-3)
    # with every block turned into the identity map (sublayer outputs 0 in llama, RMSNorm(0)=0 in olmo2),
    # the two models agree: embedding, final norm and head are shared code
    for m in (llama, olmo):
        for name, p in m.named_parameters():
            if name.endswith(("wo.weight", "down.weight")):
                torch.nn.init.zeros_(p)
    with torch.no_grad():
        torch.testing.assert_close(llama(idx)[0], olmo(idx)[0])


@pytest.mark.parametrize("arch", ["dense", "full_loop", "asymloop"])
def test_olmo2_causal_and_trainable(arch):
    torch.manual_seed(0)
    m = LoopedLM(tiny(arch, backbone="olmo2", moe_experts=4))
    idx = torch.randint(0, V, (2, 12))
    idx2 = idx.clone()
    idx2[:, 7:] = (idx2[:, 7:] + 1) % V
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(idx)[0][:, :7], m(idx2)[0][:, :7], atol=1e-6, rtol=1e-6)
    m.train()
    _, loss = m(idx, idx)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_olmo8_preset_is_the_papers_appendix_g_model():
    """Appendix G: 8 pre-norm blocks, d 512, 8 heads, SwiGLU 2048, the SmolLM tokenizer's 49152 tokens; QKNorm as in the
    main models (AsymLoop only); OLMo-2's norm order is only an option (ours)."""
    fl, asym = ModelConfig.from_preset("olmo8", "full_loop"), ModelConfig.from_preset("olmo8")
    for c in (fl, asym):
        assert (c.n_layer, c.d_model, c.n_head, c.d_ff, c.vocab_size, c.backbone) == (8, 512, 8, 2048, 49152, "llama")
    assert (fl.qk_norm, asym.qk_norm) == (False, True)
    assert (fl.n_iter, fl.effective_depth) == (2, 16)
    assert (asym.n_enc, asym.n_dec, asym.n_iter, asym.effective_depth) == (4, 4, 3, 16)
    # they differ by the Global KV projections (4 decoder layers x 2 d^2) with their QKNorm scales, the encoder-output
    # norm, and AsymLoop's q/k QKNorm scales in all 8 blocks
    assert count_params(asym) - count_params(fl) == 4 * (2 * 512 * 512 + 64) + 512 + 8 * 2 * 64
    assert ModelConfig.from_preset("olmo8", backbone="olmo2").backbone == "olmo2"  # the (ours) OLMo-2 option
    with pytest.raises(ValueError, match="unknown backbone 'olmo3'; choose one of llama, olmo2"):
        ModelConfig.from_preset("olmo8", backbone="olmo3")


def test_olmo8_training_preset_is_the_papers_appendix_g_setup():
    from minimal_asymloop.alrs import ALRS
    from minimal_asymloop.trainer import TrainConfig, make_alrs

    t = TrainConfig.from_preset("olmo8")
    assert (t.data, t.tokenizer, t.seq_len, t.global_batch, t.tokens, t.warmup_frac) == (
        "fineweb-edu-dedup", "smollm", 1024, 512, 1_680_000_000, 0.1)
    hook = make_alrs(t, "asymloop")
    assert isinstance(hook, ALRS) and (hook.lo, hook.hi) == (1.0, 3.0)  # ALRS in [1, 3]
    assert make_alrs(t, "full_loop") is None
