import math

import pytest
import torch

from minimal_asymloop.flops import count_params, flops_per_token
from minimal_asymloop.model import LoopedLM, ModelConfig, MoE, SwiGLU

V = 97


def tiny(arch="asymloop", **kw):
    base = dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=32, moe_experts=4)
    return ModelConfig(arch=arch, **{**base, **kw})


def moe_layer(n_experts=6, top_k=2, d=16, d_ff=24, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="dense", n_layer=1, d_model=d, n_head=2, d_ff=48, vocab_size=V,
                      moe_experts=n_experts, moe_top_k=top_k, moe_d_ff=d_ff)
    return MoE(cfg)


def dense_reference(moe, x):
    """Every expert on every token, then each token keeps its k chosen outputs weighted by its gates."""
    _, gates, ids = moe.route(x)
    all_out = torch.stack([e(x) for e in moe.experts], dim=1)  # (T, E, d)
    return (all_out.gather(1, ids.unsqueeze(-1).expand(-1, -1, x.size(-1))) * gates.unsqueeze(-1)).sum(1)


def test_routing_picks_exactly_k_experts_and_gates_sum_to_one():
    moe = moe_layer(n_experts=6, top_k=2)
    x = torch.randn(50, 16)
    logits, gates, ids = moe.route(x)
    assert ids.shape == gates.shape == (50, 2)
    assert all(len(set(row.tolist())) == 2 for row in ids)  # k distinct experts per token
    top2 = logits.argsort(dim=-1, descending=True)[:, :2]
    assert torch.equal(ids.sort(-1).values, top2.sort(-1).values)  # the k highest-scoring ones
    torch.testing.assert_close(gates.sum(-1), torch.ones(50))
    # gates are the full softmax's top-k probabilities, renormalized
    p = logits.softmax(-1).gather(1, ids)
    torch.testing.assert_close(gates, p / p.sum(-1, keepdim=True))
    moe(x)
    assert moe.load.sum() == 50 * 2 and moe.n_calls == 1


def test_no_token_dropped_even_when_one_expert_is_overloaded():
    moe = moe_layer(n_experts=4, top_k=2)
    with torch.no_grad():  # a router that sends almost every token to expert 0: no capacity limit applies
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0
    x = torch.randn(40, 16)
    x[:, 0] = x[:, 0].abs() + 0.5
    with torch.no_grad():
        out = moe(x)
        torch.testing.assert_close(out, dense_reference(moe, x), atol=1e-6, rtol=1e-5)
    assert moe.load[0] == 40  # every token reached the overloaded expert
    assert (out.abs().sum(-1) > 0).all()  # and every token got an output


def test_one_expert_top1_equals_dense_ffn_with_same_weights():
    for arch in ("dense", "asymloop"):
        torch.manual_seed(0)
        dense = LoopedLM(tiny(arch, moe_experts=0)).eval()
        moe = LoopedLM(tiny(arch, moe_experts=1, moe_top_k=1, moe_d_ff=48)).eval()
        sd = {k.replace(".mlp.", ".mlp.experts.0."): v for k, v in dense.state_dict().items()}
        sd.update({k: torch.randn_like(v) for k, v in moe.state_dict().items() if "router" in k})
        moe.load_state_dict(sd)  # strict: dense FFN weights map one to one onto the single expert
        idx = torch.randint(0, V, (2, 13))
        with torch.no_grad():
            torch.testing.assert_close(moe(idx)[0], dense(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_balance_loss_is_minimal_for_a_uniform_router(top_k):
    E = 4
    moe = moe_layer(n_experts=E, top_k=top_k)
    x = torch.randn(256, 16)
    w = torch.randn(E, 16)
    losses = {}
    for scale in (0.0, 0.1, 1.0, 10.0, 100.0):  # 0: uniform router ... 100: nearly hard routing
        with torch.no_grad():
            moe.router.weight.copy_(scale * w)
            balance, z, _ = moe.aux_losses(*moe.route(x)[::2])
        losses[scale] = balance.item()
    assert losses[0.0] == pytest.approx(1.0, abs=1e-6)  # E·Σ f_e/E = 1 whatever the tie-breaking
    assert all(v >= 1.0 - 1e-6 for v in losses.values()), losses
    with torch.no_grad():  # collapsed: every token's top choice is expert 0 with probability ~1
        moe.router.weight.zero_()
        moe.router.weight[0] = 100 * x.mean(0) / x.mean(0).norm()
        xs = x + 3 * x.mean(0) / x.mean(0).norm()
        balance, z, _ = moe.aux_losses(*moe.route(xs)[::2])
    assert balance.item() > 1.5
    # the uniform router's z-loss is logsumexp(0,...,0)² = log(E)²
    with torch.no_grad():
        moe.router.weight.zero_()
        _, z, _ = moe.aux_losses(*moe.route(x)[::2])
    assert z.item() == pytest.approx(math.log(E) ** 2, rel=1e-6)


def test_balance_loss_gradient_balances_a_skewed_router():
    E = 4
    moe = moe_layer(n_experts=E, top_k=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g) + 1.0  # inputs share a direction ...
    with torch.no_grad():
        moe.router.weight.copy_(0.3 * torch.randn(E, 16, generator=g))
        moe.router.weight[0] += 0.4  # ... that favours expert 0

    def entropy():
        counts = torch.bincount(moe.route(x)[2].flatten(), minlength=E).float()
        return torch.special.entr(counts / counts.sum()).sum().item()

    start = entropy()
    opt = torch.optim.SGD(moe.router.parameters(), lr=1.0)
    for _ in range(50):
        logits, _, ids = moe.route(x)
        balance, _, _ = moe.aux_losses(logits, ids)
        opt.zero_grad()
        balance.backward()
        opt.step()
    assert start < 0.2 and entropy() > 0.95 * math.log(E), (start, entropy())


def test_unused_expert_still_gets_a_gradient():
    moe = moe_layer(n_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 1.0
    x = torch.randn(10, 16)
    x[:, 0] = x[:, 0].abs() + 0.1  # every token picks expert 0
    moe(x).sum().backward()
    assert moe.load.tolist() == [10, 0, 0, 0]
    for e in moe.experts[1:]:
        assert all(p.grad is not None and (p.grad == 0).all() for p in e.parameters())


def test_param_count_independent_of_k_and_counts_every_expert():
    for arch in ("full_loop", "asymloop"):
        counts = {k: count_params(tiny(arch, n_iter=k)) for k in (1, 2, 5)}
        assert len(set(counts.values())) == 1, counts
    for arch in ("dense", "full_loop", "asymloop"):
        cfg = tiny(arch)
        d, E, L = cfg.d_model, cfg.moe_experts, cfg.n_layer
        assert cfg.moe_d_ff == cfg.d_ff // cfg.moe_top_k == 24  # default: active width = dense width
        expected = L * (E * 3 * d * cfg.moe_d_ff + d * E - 3 * d * cfg.d_ff)  # experts + router - dense FFN
        assert count_params(cfg) - count_params(tiny(arch, moe_experts=0)) == expected


@pytest.mark.parametrize("arch", ["dense", "full_loop", "asymloop"])
def test_causality_with_moe(arch):
    torch.manual_seed(0)
    m = LoopedLM(tiny(arch)).eval()
    idx = torch.randint(0, V, (2, 12))
    idx2 = idx.clone()
    idx2[:, 8:] = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        a, b = m(idx)[0], m(idx2)[0]
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-4)


def test_shared_experts_route_every_iteration_and_aux_loss_is_their_mean():
    torch.manual_seed(0)
    cfg = tiny("asymloop", n_iter=3)
    m = LoopedLM(cfg).train()
    idx = torch.randint(0, V, (2, 11))
    _, loss_train = m(idx, idx)
    layers = m.moe_layers()
    assert sorted(layers) == ["decoder.0.mlp", "decoder.1.mlp", "encoder.0.mlp", "encoder.1.mlp"]
    assert [layers[n].n_calls for n in sorted(layers)] == [3, 3, 1, 1]  # shared experts, routed anew each iteration
    assert all(m_.load.sum() == m_.n_calls * 22 * cfg.moe_top_k for m_ in layers.values())
    calls = 8
    bal = sum(m_.balance_sum for m_ in layers.values()) / calls
    z = sum(m_.z_sum for m_ in layers.values()) / calls
    aux = m.moe_aux_losses()
    assert set(aux) == {"moe_balance_loss", "moe_z_loss"}
    torch.testing.assert_close(aux["moe_balance_loss"], 0.01 * bal)
    torch.testing.assert_close(aux["moe_z_loss"], 0.001 * z)
    assert bal.item() >= 1.0 - 1e-6 and aux["moe_balance_loss"].requires_grad
    entropy = m.moe_load_entropy()
    assert set(entropy) == {f"moe_load_entropy/{n}" for n in ("encoder.0", "encoder.1", "decoder.0", "decoder.1")}
    assert all(0 < v <= math.log(4) + 1e-6 for v in entropy.values())
    # training loss = cross-entropy + aux; eval-mode loss (validation) is the plain cross-entropy
    m.eval()
    with torch.no_grad():
        logits, loss_eval = m(idx, idx)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    torch.testing.assert_close(loss_eval, ce)
    torch.testing.assert_close(loss_train.detach(), ce + sum(m.moe_aux_losses().values()), atol=1e-6, rtol=1e-6)
    # a new forward resets the running sums: the next pass at K=5 counts 5 decoder calls, not 8
    m(idx, n_iter=5)
    assert layers["decoder.0.mlp"].n_calls == 5


def test_aux_loss_trains_the_router():
    torch.manual_seed(0)
    m = LoopedLM(tiny("full_loop", n_iter=2)).train()
    idx = torch.randint(0, V, (2, 11))
    _, loss = m(idx, idx)
    loss.backward()
    router = m.blocks[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    m.zero_grad()
    # with the aux weights at 0 the router still learns through the gates
    m2 = LoopedLM(tiny("full_loop", moe_balance_weight=0.0, moe_z_weight=0.0)).train()
    _, loss2 = m2(idx, idx)
    loss2.backward()
    assert m2.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_dense_model_has_no_moe_bookkeeping():
    m = LoopedLM(tiny(moe_experts=0))
    assert m.moe_layers() == {} and m.moe_aux_losses() == {} and m.moe_load_entropy() == {}
    assert all(isinstance(b.mlp, SwiGLU) for b in m.encoder)


def test_moe_flops_count_active_experts_and_router():
    d, dff, V_, N = 4, 6, 10, 8
    base = dict(n_layer=2, d_model=d, n_head=2, d_ff=dff, vocab_size=V_, max_seq_len=N)
    dense = flops_per_token(ModelConfig(arch="dense", **base), N)
    moe = flops_per_token(ModelConfig(arch="dense", moe_experts=8, moe_top_k=2, moe_d_ff=3, **base), N)
    # per block: 2 active experts of width 3 (2·6·4·3 = 144 = the dense 6·4·6) + router 2·4·8 = 64
    assert moe["blocks"] - dense["blocks"] == 2 * 64
    moe = flops_per_token(ModelConfig(arch="dense", moe_experts=8, moe_top_k=1, moe_d_ff=12, **base), N)
    assert moe["blocks"] - dense["blocks"] == 2 * (6 * 4 * 12 - 6 * 4 * 6 + 64)


def test_paper_moe_settings_at_60m():
    from minimal_asymloop.model import PAPER_MOE

    cfg = ModelConfig.from_preset("60m", **PAPER_MOE)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_d_ff) == (8, 2, 1024)
    assert ModelConfig.from_preset("135m", **PAPER_MOE).moe_d_ff == 1024
    # active FFN FLOPs equal the dense FFN's, plus the router
    dense = flops_per_token(ModelConfig.from_preset("60m"), 1024)["blocks"]
    moe = flops_per_token(cfg, 1024)["blocks"]
    assert moe - dense == cfg.effective_depth * 2 * 768 * 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(moe_experts=-1), "moe_experts must be an integer >= 0"),
    (dict(moe_experts=4, moe_top_k=5), r"moe_top_k=5 must be in 1\.\.moe_experts=4"),
    (dict(moe_experts=4, moe_top_k=0), r"moe_top_k=0 must be in 1\.\.moe_experts=4"),
    (dict(moe_experts=0, moe_d_ff=64), "moe_d_ff=64 applies only with moe_experts > 0"),
    (dict(moe_experts=4, moe_d_ff=0), "moe_d_ff must be a positive integer"),
    (dict(moe_experts=4, moe_balance_weight=-1.0), r"moe_balance_weight must be a finite number >= 0, got -1.0"),
])
def test_invalid_moe_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_preset("tiny", **kwargs)
