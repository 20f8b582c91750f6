import pytest
import torch

from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.probes import global_attention_share, logit_lens, state_change, state_norms

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
