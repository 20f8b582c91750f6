import pytest
import torch

from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.probes import attention_maps, chain_back, chain_lookups, global_attention_share, logit_lens, state_change, state_norms
from minimal_asymloop.tasks import ChainTask

V = 61


def tiny(arch="asymloop", **kw):
    return ModelConfig(arch=arch, **{**dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=32), **kw})


@pytest.mark.parametrize("arch", ["asymloop", "full_loop"])
def test_logit_lens_from_one_pass_equals_separate_passes(arch):
    torch.manual_seed(0)
    model = LoopedLM(tiny(arch)).eval()
    idx, targets = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    lens = logit_lens(model, idx, targets, n_iter=5)
    with torch.no_grad():
        separate = [model(idx, targets, n_iter=k)[1].item() for k in range(1, 6)]
    assert len(lens) == 5 and lens == pytest.approx(separate, abs=1e-5)


def test_state_change_matches_definition():
    torch.manual_seed(0)
    model = LoopedLM(tiny()).eval()
    idx = torch.randint(0, V, (2, 16))
    change = state_change(model, idx, n_iter=3)
    with torch.no_grad():
        zs = model.states(idx, 3)
    rel = ((zs[2] - zs[1]).norm(dim=-1) / zs[2].norm(dim=-1)).mean().item()
    assert len(change) == 3 and change[2] == pytest.approx(rel, rel=1e-5) and all(c > 0 for c in change)
    with pytest.raises(ValueError, match="looped model"):
        state_change(LoopedLM(tiny("dense")), idx)


@pytest.mark.parametrize("context", ["global_kv", "additive"])
def test_state_norms_are_the_absolute_sizes(context):
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_iter=3, context=context)).eval()
    idx = torch.randint(0, V, (2, 16))
    s = state_norms(model, idx, n_iter=4)
    with torch.no_grad():
        zs = model.states(idx, 4)
    assert len(s["norm"]) == 5 and len(s["step"]) == len(s["relative"]) == 4
    assert s["norm"][4] == pytest.approx(zs[3].norm(dim=-1).mean().item(), rel=1e-5)
    assert s["step"][3] == pytest.approx((zs[3] - zs[2]).norm(dim=-1).mean().item(), rel=1e-5)
    if context == "additive":  # z_0 = 0: the first update is the whole state
        assert s["norm"][0] == 0 and s["step"][0] == pytest.approx(s["norm"][1], rel=1e-5)
    # the ratio can fall while the update itself does not: it is the norm that grows
    assert s["relative"] == pytest.approx(state_change(model, idx, n_iter=4))


def test_global_share_is_a_probability_and_tracks_the_global_keys():
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_iter=2)).eval()
    idx = torch.randint(0, V, (2, 16))
    share = global_attention_share(model, idx)
    assert share.shape == (2, 2) and (abs(share - 0.5) < 0.1).all()  # symmetric sources at init
    # sharp Global scores against flat (zero) Local scores pull the mass to Global keys, and vice versa
    for glob, loc, check in ((50.0, 0.0, lambda s: s > 0.85), (0.0, 50.0, lambda s: s < 0.15)):
        with torch.no_grad():
            for blk in model.decoder:
                blk.attn.q_norm.weight.fill_(50.0)
                blk.attn.k_glob_norm.weight.fill_(glob)
                blk.attn.k_norm.weight.fill_(loc)
        assert check(global_attention_share(model, idx)).all()
    with pytest.raises(ValueError, match="global_kv"):
        global_attention_share(LoopedLM(tiny(context="none")), idx)


@pytest.mark.parametrize("variant", [dict(), dict(context="none"), dict(context="additive"), dict(local_kv=False)])
def test_attention_maps_reproduce_each_decoder_layers_output(variant):
    """The maps times the values, through wo, give exactly what each decoder attention returned, at every iteration."""
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_iter=2, n_enc=2, **variant)).eval()
    idx = torch.randint(0, V, (2, 16))
    maps = attention_maps(model, idx)  # (K, D, B, H, N, 2N)
    assert maps.shape == (2, 2, 2, 4, 16, 32)
    assert torch.allclose(maps.sum(-1), torch.ones(()), atol=1e-5)
    calls = []  # (attn, x, kv_glob, output) per call, iteration-major

    def grab(attn, args, out):
        calls.append((attn, args[0], args[2], out))

    handles = [blk.attn.register_forward_hook(grab) for blk in model.decoder]
    with torch.no_grad():
        model.states(idx)
    for h in handles:
        h.remove()
    for c, (attn, x, kv_glob, out) in enumerate(calls):
        zero = torch.zeros(2, 4, 16, 8)
        v_glob = kv_glob[1] if kv_glob is not None else zero
        v_loc = attn.heads(attn.wv(x)) if attn.has_local else zero
        y = maps[c // 2, c % 2] @ torch.cat([v_glob, v_loc], -2)  # (B, H, N, hd)
        assert torch.allclose(attn.wo(y.transpose(1, 2).flatten(2)), out, atol=1e-5)
    if variant.get("context") in ("none", "additive"):
        assert (maps[..., :16] == 0).all()
    if variant.get("local_kv") is False:
        assert (maps[..., 16:] == 0).all()
    if not variant:
        assert global_attention_share(model, idx) == pytest.approx(maps[..., :16].sum(-1).mean((2, 3, 4)))
    with pytest.raises(ValueError, match="asymloop"):
        attention_maps(LoopedLM(tiny("full_loop")), idx)


def test_chain_back_follows_each_chain_to_its_literal():
    task = ChainTask(n_stmt=4, max_hops=3, n_vars=4, n_values=4)
    idx = torch.tensor([task.encode("a=1;b=a;d=2;c=b;")])
    assert chain_back(task, idx)[0].tolist() == [[0, -1, -1], [1, 0, -1], [2, -1, -1], [3, 1, 0]]
    idx, _, hops = task.batch(16, torch.Generator().manual_seed(0))
    assert ((chain_back(task, idx) >= 0).sum(-1) == hops[:, 2::4]).all()  # chain length = the task's hop count


def test_chain_lookups_equal_the_attention_maps_read_by_hand():
    task = ChainTask(n_stmt=4, max_hops=3, n_vars=4, n_values=4)
    torch.manual_seed(0)
    model = LoopedLM(tiny(n_iter=3, n_layer=2, n_enc=1, vocab_size=task.vocab_size)).eval()
    idx = torch.tensor([task.encode("a=1;b=a;d=2;c=b;"), task.encode("b=3;a=b;c=a;d=c;")])
    look = chain_lookups(model, task, idx)
    maps = attention_maps(model, idx)  # (K, D, B, H, N, 2N)
    assert look["back"].shape == look["stmt"].shape == (3, 1, 4, 2, 4, 3, 2) and look["half"].shape == (3, 1, 4, 2, 4, 2)
    for k, h in ((0, 0), (2, 1)):
        row = maps[k, 0, 0, h, 4 * 3 + 2]  # statement 3 "c=b" of program 0: its chain is c=b -> b=a -> a=1
        for j, t in enumerate([3, 1, 0]):
            for half in (0, 1):
                assert look["back"][k, 0, h, 0, 3, j, half] == pytest.approx(row[16 * half + 4 * t + 2].item())
                assert look["stmt"][k, 0, h, 0, 3, j, half] == pytest.approx(row[16 * half + 4 * t: 16 * half + 4 * t + 4].sum().item())
        assert look["half"][k, 0, h, 0, 3, 0] == pytest.approx(row[:16].sum().item())
    assert (look["back"][:, :, :, 0, 2, 1:] == 0).all() and (look["stmt"][:, :, :, 0, 2, 1:] == 0).all()  # "d=2": 1 hop
    assert (look["back"][:, :, :, 1, 3] > 0).all()  # "d=c" has 3 hops: all three right-hand sides are visible to it
