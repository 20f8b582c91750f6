"""KV-cached generation for `LoopedLM` (`model.generate` calls `generate` here).

A KVCache keeps every attention call's keys and values between steps, so after the prompt
each new token runs one position through the model: the encoder and the Global KV once,
the decoder K times, each iteration reading its own Local KV cache.
"""

from __future__ import annotations

import torch


class LayerKV:
    """One attention layer's keys and values for the tokens so far, each (B, H, T, hd)."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        self.k, self.v = k, v
        return k, v


class KVCache:
    """Everything generation keeps between steps, one LayerKV per attention call per token:
    dense / full loop: ("block", k, l), so K·L for full loop; asymloop: ("enc", l) for the
    encoder, ("global", l) per decoder layer shared by all iterations, and ("local", k, l)
    per iteration (E + D + K·D; layers without Local KV leave theirs empty)."""

    def __init__(self):
        self.pos = 0  # tokens cached so far = position of the next one
        self.n_iter = None  # the depth K it was filled at
        self.layers: dict[tuple, LayerKV] = {}

    def advance(self, n: int, n_iter: int):
        if self.pos and n_iter != self.n_iter:  # iterations it never ran have no Local KV for earlier tokens
            raise ValueError(f"this KVCache was filled at n_iter={self.n_iter}, not {n_iter}; keep the depth or start a new KVCache")
        self.pos, self.n_iter = self.pos + n, n_iter

    def layer(self, *key) -> LayerKV:
        if key not in self.layers:
            self.layers[key] = LayerKV()
        return self.layers[key]

    def nbytes(self) -> int:
        return sum(t.nbytes for c in self.layers.values() if c.k is not None for t in (c.k, c.v))


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             n_iter: int | None = None, use_cache: bool = True, stop_id: int | None = None):
    """Append up to max_new_tokens sampled tokens to idx (B, T). temperature=0 is greedy.

    With the cache, the prompt runs in one forward pass (prefill), then each step runs
    only the newest token. n_iter may differ from the trained K (test-time depth).
    stop_id: stop early once every row has generated this token (rows keep going until then).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be a (batch, length>=1) tensor of token ids, got shape {tuple(idx.shape)}")
    window, prompt_len = model.config.max_seq_len, idx.size(1)
    cache = KVCache() if use_cache else None
    for _ in range(max_new_tokens):
        if idx.size(1) > window:  # (ours) past max_seq_len the window slides, like nanoGPT; the
            cache = None  # cached keys sit at the wrong RoPE positions, so recompute from here on
        new = idx[:, -window:] if cache is None else idx[:, cache.pos:]  # cached: the prompt, then one token
        logits = model.logits(model.states(new, n_iter, cache)[-1][:, -1]).float()  # (B, V)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)
        if stop_id is not None and (idx[:, prompt_len:] == stop_id).any(dim=1).all():
            break
    return idx


def kv_cache_bytes(cfg, seq_len: int, batch: int = 1, dtype=torch.bfloat16, n_iter: int | None = None) -> int:
    """Bytes of the KV cache for batch sequences of seq_len tokens: K and V, (B, T, d) each,
    per cached attention call (see KVCache). AsymLoop caches E + D·[Global KV] + K·D·[Local KV]."""
    k = n_iter or cfg.n_iter
    if cfg.arch == "asymloop":
        n_caches = cfg.n_enc + cfg.n_dec * (cfg.context == "global_kv") + k * cfg.n_dec * cfg.local_kv
    else:
        n_caches = cfg.n_layer * (k if cfg.arch == "full_loop" else 1)
    return n_caches * 2 * batch * seq_len * cfg.d_model * torch.empty((), dtype=dtype).element_size()
