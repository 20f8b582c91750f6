"""Adaptive per-token depth: exact at exit_threshold 0, exited tokens' Local KV reused, incremental = whole sequence."""

import pytest
import torch
import torch.nn.functional as F

from minimal_asymloop.generate import AdaptiveKVCache, KVCache, adaptive_logits, adaptive_states, generate_adaptive, kv_cache_bytes
from minimal_asymloop.model import LoopedLM, ModelConfig

V = 97
TAU = 0.01  # at init_std 0.1 about a quarter of the tokens exit before K_max = 4 (asserted where it matters)


def tiny(arch="asymloop", **kw):
    base = dict(n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=V, max_seq_len=24, init_std=0.1)
    return ModelConfig(arch=arch, **{**base, **kw})


VARIANTS = {
    "full_loop": tiny("full_loop"),
    "asymloop": tiny(),
    "asym_no_global_kv": tiny(context="none"),
    "asym_no_local_kv": tiny(local_kv=False),
    "asym_additive": tiny(context="additive"),
    "asym_E1": tiny(n_enc=1, n_iter=2),
    "asym_olmo2": tiny(backbone="olmo2"),
}


def model_for(cfg, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return LoopedLM(cfg).to(dtype).eval()


def tokens(shape, seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", VARIANTS)
def test_threshold_zero_is_fixed_depth_exactly(name):
    cfg = VARIANTS[name]
    m, idx = model_for(cfg), tokens((2, 20))
    for k in (1, cfg.n_iter, cfg.n_iter + 2):
        with torch.no_grad():
            fixed = m.logits(m.states(idx, k)[-1])
        logits, exit_iter, cache = adaptive_logits(m, idx, 0.0, max_iter=k)
        assert torch.equal(logits, fixed), f"{name} K={k}"
        assert (exit_iter == k).all() and cache.reused_rows() == 0
        assert cache.nbytes() == kv_cache_bytes(cfg, 20, batch=2, dtype=torch.float32, n_iter=k)
    # the check above can fail: with a threshold, tokens exit and the logits move
    logits, exit_iter, _ = adaptive_logits(m, idx, TAU, max_iter=cfg.n_iter + 2)
    assert exit_iter.float().mean() < cfg.n_iter + 2
    assert not torch.equal(logits, m.logits(m.states(idx, cfg.n_iter + 2)[-1]))


@pytest.mark.parametrize("name", ["full_loop", "asymloop", "asym_additive", "asym_no_local_kv"])
def test_threshold_zero_generates_the_fixed_depth_tokens(name):
    m, prompt = model_for(VARIANTS[name]), tokens((2, 5), seed=2)
    k = 4
    for use_cache in (True, False):  # 30 new tokens run past max_seq_len=24: the window slides
        fixed = m.generate(prompt, 30, temperature=0, n_iter=k, use_cache=use_cache)
        assert torch.equal(m.generate(prompt, 30, temperature=0, exit_threshold=0.0, max_iter=k, use_cache=use_cache), fixed)
    torch.manual_seed(3)
    fixed = m.generate(prompt, 12, temperature=1.0, n_iter=k)
    torch.manual_seed(3)
    out, iters = generate_adaptive(m, prompt, 12, temperature=1.0, exit_threshold=0.0, max_iter=k)
    assert torch.equal(out, fixed) and iters.shape == (2, 12) and (iters == k).all()
    # and the check can fail: with a threshold the greedy text changes
    assert not torch.equal(m.generate(prompt, 30, temperature=0, exit_threshold=0.1, max_iter=k), fixed)


@pytest.mark.parametrize("name", ["full_loop", "asymloop", "asym_additive"])
def test_token_by_token_equals_whole_sequence(name):
    """Generation's path (prefill, a chunk, then one token per step through the cache) and the teacher-forced one
    make the same exits and logits (float64, so that no KL sits within rounding of the threshold)."""
    m, idx = model_for(VARIANTS[name], dtype=torch.float64), tokens((2, 20))
    whole, exit_whole, _ = adaptive_logits(m, idx, TAU, max_iter=4)
    assert (exit_whole < 4).any()  # tokens exit early (asym_additive: all of them, after 2 iterations)
    cache, parts = AdaptiveKVCache(), []
    with torch.no_grad():
        for c in [idx[:, :7], idx[:, 7:10]] + [idx[:, t:t + 1] for t in range(10, 20)]:
            z, _ = adaptive_states(m, c, TAU, 4, cache)
            parts.append(m.logits(z))
    assert torch.equal(cache.exit_iter, exit_whole)
    # 1e-6: the prefill's joint attention and a step's attention after a cached prefix are different kernels
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-6, rtol=0)


def test_batch_rows_are_independent():
    m, idx = model_for(VARIANTS["asymloop"], dtype=torch.float64), tokens((3, 20))
    logits, exit_iter, _ = adaptive_logits(m, idx, TAU, max_iter=4)
    assert len({tuple(r.tolist()) for r in exit_iter}) == 3  # the rows exit differently
    for b in range(3):
        one, exit_one, _ = adaptive_logits(m, idx[b:b + 1], TAU, max_iter=4)
        assert torch.equal(exit_one[0], exit_iter[b])
        torch.testing.assert_close(one[0], logits[b], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["asymloop", "full_loop"])
def test_exited_tokens_show_their_last_local_kv(name):
    """What attention receives at iteration k: a token that exited after iteration j < k shows its iteration-j
    rows (same layer); a running token shows rows it computed at iteration k."""
    cfg = VARIANTS[name]
    m, idx, kmax = model_for(cfg), tokens((2, 20)), 4
    _, exit_iter, cache = adaptive_logits(m, idx, TAU, max_iter=kmax, record=True)
    kind, n_layers = ("block", cfg.n_layer) if cfg.arch == "full_loop" else ("local", cfg.n_dec)
    early = exit_iter < kmax
    assert early.any() and (~early).any()
    for layer in range(n_layers):
        for k in range(1, kmax):  # 0-based iteration k is iteration k+1
            for i, kv in enumerate(cache.fed[(kind, k, layer)]):
                now, before = kv, cache.fed[(kind, k - 1, layer)][i]  # (B, H, T, hd)
                same = (now == before).all(dim=(1, 3))  # (B, T)
                assert torch.equal(same[exit_iter <= k], torch.ones_like(same[exit_iter <= k])), (k, layer)
                assert not same[exit_iter > k].any(), (k, layer)  # recomputed from a new state: different
    # the cache holds what attention read, and counts the copies
    assert cache.nbytes() == kv_cache_bytes(cfg, 20, batch=2, dtype=torch.float32, n_iter=kmax)
    assert cache.reused_rows() == int((kmax - exit_iter).sum()) * n_layers


class LatestKV:
    """Reference Local KV store, Huginn's way (HuginnDynamicCache.update, lookup "latest-m4"): one entry per
    (position) as computed; a position missing at this iteration is read at the latest iteration it ran."""

    def __init__(self, store, it, layer, pos):
        self.store, self.it, self.layer, self.pos = store, it, layer, pos

    def append(self, k, v):  # the one new token, at position pos
        pos = self.pos
        self.store[(self.it, self.layer, pos)] = (k, v)
        rows = []
        for s in range(pos + 1):
            latest = max(i for i in range(self.it + 1) if (i, self.layer, s) in self.store)
            rows.append(self.store[(latest, self.layer, s)])
        return torch.cat([r[0] for r in rows], dim=-2), torch.cat([r[1] for r in rows], dim=-2)


def reference_adaptive(m, idx, tau, kmax):
    """Token by token, as Huginn's _prefill_with_varied_exit_steps: each token iterates until KL(p_{k-1} || p_k) < tau
    (from iteration 2 on), reading earlier tokens' Local KV through LatestKV."""
    cache, store, logits, exits = KVCache(), {}, [], []
    for t in range(idx.size(1)):
        cache.advance(1, kmax)
        x = m.embed(idx[:, t:t + 1])
        for i, blk in enumerate(m.encoder):
            x = blk(x, m.rope, cache=cache.layer("enc", i), start=t)
        kv = m.global_kv(x, t, cache)
        z, logp = x, None
        for k in range(kmax):
            for i, (blk, kv_i) in enumerate(zip(m.decoder, kv)):
                z = blk(z, m.rope, kv_i, LatestKV(store, k, i, t), t)
            new_logp = F.log_softmax(m.logits(z).float(), dim=-1)
            if logp is not None and (logp.exp() * (logp - new_logp)).sum() < tau:
                break
            logp = new_logp
        logits.append(m.logits(z))
        exits.append(k + 1)
    return torch.cat(logits, dim=1), torch.tensor(exits)


def test_matches_a_token_by_token_reference():
    m, idx = model_for(VARIANTS["asymloop"], dtype=torch.float64), tokens((1, 20))
    with torch.no_grad():
        ref_logits, ref_exits = reference_adaptive(m, idx, TAU, 4)
    logits, exit_iter, _ = adaptive_logits(m, idx, TAU, max_iter=4)
    assert (ref_exits < 4).any()
    assert torch.equal(exit_iter[0], ref_exits)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)  # joint attention vs one token's: other kernels


def test_bad_input():
    m, idx = model_for(VARIANTS["asymloop"]), tokens((1, 5))
    with pytest.raises(ValueError, match="exit_threshold must be a number >= 0"):
        adaptive_logits(m, idx, -1.0)
    with pytest.raises(ValueError, match="max_iter"):
        adaptive_logits(m, idx, 0.1, max_iter=0)
    with pytest.raises(ValueError, match="exit_threshold must be"):
        m.generate(idx, 3, max_iter=4)  # max_iter without a threshold
    with pytest.raises(ValueError, match="needs a looped model"):
        adaptive_logits(model_for(tiny("dense")), idx, 0.1)


def test_bench_chain_sweep(tmp_path):
    """The bench's chain-task sweep on a committed model: tau = 0 is the fixed-K_max row, and 3-hop answers stop later."""
    import json

    from minimal_asymloop.bench import main

    out = tmp_path / "adaptive.json"
    main(["adaptive", "--ckpt", "none", "--seeds", "1", "--taus", "0", "0.03", "--chain-max-iter", "3", "--out", str(out)])
    run = json.loads(out.read_text())["chain"]["runs"][0]
    fixed, (zero, tau) = run["fixed"][-1], run["adaptive"]
    assert {k: zero[k] for k in ("ce", "acc", "mean_iter")} == {k: fixed[k] for k in ("ce", "acc", "mean_iter")}
    assert tau["mean_iter"] < 3 and tau["iter_by_hops"]["3"] > tau["iter_by_hops"]["1"]


def test_bench_names_a_missing_checkpoint(tmp_path):
    from minimal_asymloop.bench import main

    with pytest.raises(SystemExit, match="python train_minimal.py"):
        main(["adaptive", "--ckpt", "out/no-such-run", "--seeds"])
