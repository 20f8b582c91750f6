"""KV-cached generation: exact against the full forward pass, for every architecture and ablation."""

import pytest
import torch

from minimal_asymloop.generate import KVCache, kv_cache_bytes
from minimal_asymloop.model import LoopedLM, ModelConfig

V = 97


def tiny(arch="asymloop", **kw):
    # init_std 0.1 (not 0.02) so attention visibly moves the logits: a broken cache cannot hide
    base = dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=24, init_std=0.1)
    return ModelConfig(arch=arch, **{**base, **kw})


VARIANTS = {
    "dense": tiny("dense"),
    "full_loop": tiny("full_loop"),
    "asymloop": tiny(),
    "asym_no_global_kv": tiny(context="none"),
    "asym_no_local_kv": tiny(local_kv=False),
    "asym_additive": tiny(context="additive"),
    "asym_no_qknorm": tiny(qk_norm=False),
    "asym_E1": tiny(n_enc=1, n_iter=2),
    "full_loop_qknorm": tiny("full_loop", qk_norm=True),
    "asym_moe": tiny(moe_experts=4, moe_top_k=2),
    "asym_olmo2": tiny(backbone="olmo2"),
    "full_loop_olmo2_moe": tiny("full_loop", backbone="olmo2", moe_experts=3, moe_top_k=1),
}
# expected number of filled per-layer caches: dense L, full loop K·L, asymloop E + D·[global] + K·D·[local]
N_CACHES = {"dense": lambda k: 4, "full_loop": lambda k: 4 * k, "asymloop": lambda k: 2 + 2 + 2 * k,
            "asym_no_global_kv": lambda k: 2 + 2 * k, "asym_no_local_kv": lambda k: 2 + 2, "asym_additive": lambda k: 2 + 2 * k,
            "asym_no_qknorm": lambda k: 2 + 2 + 2 * k, "asym_E1": lambda k: 1 + 3 + 3 * k, "full_loop_qknorm": lambda k: 4 * k,
            "asym_moe": lambda k: 2 + 2 + 2 * k, "asym_olmo2": lambda k: 2 + 2 + 2 * k, "full_loop_olmo2_moe": lambda k: 4 * k}


def model_for(cfg, seed=0):
    torch.manual_seed(seed)
    return LoopedLM(cfg).eval()


def depths(cfg):
    return [1] if cfg.arch == "dense" else [1, cfg.n_iter, cfg.n_iter + 2]  # test-time depth != trained K


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_logits_equal_full_forward(name):
    cfg = VARIANTS[name]
    m = model_for(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (2, 20), generator=g)
    with torch.no_grad():
        other = idx.clone()
        other[:, 0] = (idx[:, 0] + 1) % V
        assert (m(idx)[0][:, -1] - m(other)[0][:, -1]).abs().max() > 1e-2  # context matters: the check below can fail
        for k in depths(cfg):
            full = m.logits(m.states(idx, k)[-1])  # (B, N, V)
            cache = KVCache()
            chunks = [idx[:, :7], idx[:, 7:10]] + [idx[:, t:t + 1] for t in range(10, 20)]  # prefill, a chunk, then tokens
            inc = torch.cat([m.logits(m.states(c, k, cache)[-1]) for c in chunks], dim=1)
            torch.testing.assert_close(inc, full, atol=1e-5, rtol=0, msg=f"{name} n_iter={k}")
            assert cache.pos == 20
            filled = [key for key, c in cache.layers.items() if c.k is not None]
            assert len(filled) == N_CACHES[name](k), sorted(filled)
            assert cache.nbytes() == kv_cache_bytes(cfg, 20, batch=2, dtype=torch.float32, n_iter=k)


@pytest.mark.parametrize("name", ["dense", "full_loop", "asymloop", "asym_no_local_kv", "asym_additive"])
def test_generate_cached_equals_uncached(name):
    cfg = VARIANTS[name]
    m = model_for(cfg)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    for k in depths(cfg)[-2:]:  # trained K and deeper (K=1 is covered above)
        # 30 new tokens run past max_seq_len=24: the window slides and both paths must agree there too
        a = m.generate(prompt, 30, temperature=0, n_iter=k)
        b = m.generate(prompt, 30, temperature=0, n_iter=k, use_cache=False)
        assert a.shape == (2, 35) and torch.equal(a[:, :5], prompt)
        assert torch.equal(a, b), f"{name} n_iter={k}"
        torch.manual_seed(3)
        a = m.generate(prompt, 12, temperature=1.0, n_iter=k)
        torch.manual_seed(3)
        b = m.generate(prompt, 12, temperature=1.0, n_iter=k, use_cache=False)
        assert torch.equal(a, b), f"{name} n_iter={k} sampled"


def test_greedy_is_argmax_of_full_forward():
    m = model_for(VARIANTS["asymloop"])
    idx = m.generate(torch.tensor([[1, 2, 3]]), 6, temperature=0)
    with torch.no_grad():
        logits = m(idx[:, :-1])[0]  # (1, 8, V)
    assert torch.equal(logits[0, 2:].argmax(-1), idx[0, 3:])


def test_deterministic_for_a_fixed_seed():
    m = model_for(VARIANTS["asymloop"])
    prompt = torch.tensor([[5, 6, 7]])
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(m.generate(prompt, 16, temperature=1.5))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    m = model_for(VARIANTS["full_loop"])
    prompt = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(4))
    greedy = m.generate(prompt, 10, temperature=0)
    torch.manual_seed(0)
    assert torch.equal(m.generate(prompt, 10, temperature=temperature, top_k=1), greedy)


def first_token_freqs(m, prompt, n, **kw):
    torch.manual_seed(0)
    out = m.generate(prompt.expand(n, -1), 1, **kw)[:, -1]
    return torch.bincount(out, minlength=V).float() / n


def test_temperature_and_top_k_sample_the_right_distribution():
    m = model_for(VARIANTS["dense"])  # sampling is the same code for every arch
    prompt = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        logits = m(prompt)[0][0, -1]  # (V,)
    n = 5000
    for t in (1.0, 2.0):  # empirical frequencies follow softmax(logits / T); 4-sigma bound
        p = torch.softmax(logits / t, -1)
        freq = first_token_freqs(m, prompt, n, temperature=t)
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all(), t
    freq_lo, freq_hi = first_token_freqs(m, prompt, n, temperature=0.5), first_token_freqs(m, prompt, n, temperature=5.0)
    assert freq_lo.max() > freq_hi.max()  # colder sampling concentrates on the top tokens
    top5 = set(logits.topk(5).indices.tolist())
    freq = first_token_freqs(m, prompt, n, temperature=1.0, top_k=5)
    assert set(freq.nonzero().flatten().tolist()) == top5  # only, and all of, the 5 best
    p5 = torch.softmax(logits[list(top5)], -1)  # renormalised over the top 5
    assert (freq[list(top5)] - p5).abs().max() < 0.04


def test_generate_rejects_bad_arguments():
    m = model_for(VARIANTS["dense"])
    idx = torch.tensor([[1, 2]])
    for kw, msg in [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2, temperature=-1), "temperature"),
                    (dict(max_new_tokens=2, top_k=0), "top_k")]:
        with pytest.raises(ValueError, match=msg):
            m.generate(idx, **kw)
    with pytest.raises(ValueError, match="idx must be"):
        m.generate(torch.tensor([1, 2]), 2)
    assert torch.equal(m.generate(idx, 0), idx)
    cache = KVCache()
    m.states(torch.zeros(1, 20, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="exceeds max_seq_len=24"):
        m.states(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.pos == 20  # the refused call left the cache as it was


def test_cache_refuses_a_different_depth():
    m = model_for(VARIANTS["asymloop"])
    cache = KVCache()
    m.states(torch.zeros(1, 4, dtype=torch.long), n_iter=3, cache=cache)
    with pytest.raises(ValueError, match="filled at n_iter=3, not 5"):
        m.states(torch.zeros(1, 1, dtype=torch.long), n_iter=5, cache=cache)


def test_kv_cache_bytes_at_60m():
    sizes = {arch: kv_cache_bytes(ModelConfig.from_preset("60m", arch, **kw), 1024, 1, torch.bfloat16)
             for arch, kw in [("dense", {}), ("full_loop", dict(n_iter=2)), ("asymloop", dict(n_iter=3))]}
    assert sizes["dense"] == 6 * 2 * 1024 * 768 * 2  # L layers x (K, V) x T x d x 2 bytes = 18 MiB
    assert sizes["full_loop"] == 2 * sizes["dense"]  # K·L = 12 caches
    assert sizes["asymloop"] == 2.5 * sizes["dense"]  # E + D + K·D = 3 + 3 + 9 = 15 caches


def test_bench_generate_runs(capsys):
    from minimal_asymloop.bench import main

    main(["generate", "--prompt-len", "4", "--new-tokens", "3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["dense"], ["full_loop"], ["asymloop"])]
    assert len(rows) == 3 + 5 and all(r.endswith("yes") for r in rows[:3])  # cached and uncached chose the same tokens
    assert "45.0 MiB  2.50x dense" in out
