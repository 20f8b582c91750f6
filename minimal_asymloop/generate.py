"""KV-cached generation for `LoopedLM` (`model.generate` calls `generate` here).

A KVCache keeps every attention call's keys and values between steps, so after the prompt
each new token runs one position through the model: the encoder and the Global KV once,
the decoder K times, each iteration reading its own Local KV cache.

Adaptive depth (`generate(..., exit_threshold=tau, max_iter=K_max)`, `adaptive_logits` for whole sequences) runs
the decoder one iteration at a time and stops each token once its logit-lens prediction has settled; see
adaptive_states and docs/generation.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
             n_iter: int | None = None, use_cache: bool = True, stop_id: int | None = None,
             exit_threshold: float | None = None, max_iter: int | None = None):
    """Append up to max_new_tokens sampled tokens to idx (B, T). temperature=0 is greedy.

    With the cache, the prompt runs in one forward pass (prefill), then each step runs
    only the newest token. n_iter may differ from the trained K (test-time depth).
    stop_id: stop early once every row has generated this token (rows keep going until then).
    exit_threshold: adaptive depth, up to max_iter iterations per token (see generate_adaptive).
    """
    if exit_threshold is not None or max_iter is not None:
        return generate_adaptive(model, idx, max_new_tokens, temperature, top_k, use_cache, stop_id,
                                 exit_threshold, max_iter or n_iter)[0]
    check_generate_args(idx, max_new_tokens, temperature, top_k)
    window, prompt_len = model.config.max_seq_len, idx.size(1)
    cache = KVCache() if use_cache else None
    for _ in range(max_new_tokens):
        if idx.size(1) > window:  # (ours) past max_seq_len the window slides, like nanoGPT; the
            cache = None  # cached keys sit at the wrong RoPE positions, so recompute from here on
        new = idx[:, -window:] if cache is None else idx[:, cache.pos:]  # cached: the prompt, then one token
        logits = model.logits(model.states(new, n_iter, cache)[-1][:, -1])  # (B, V)
        idx = torch.cat([idx, pick_next(logits, temperature, top_k)], dim=1)
        if stop_id is not None and (idx[:, prompt_len:] == stop_id).any(dim=1).all():
            break
    return idx


def check_generate_args(idx, max_new_tokens, temperature, top_k):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be a (batch, length>=1) tensor of token ids, got shape {tuple(idx.shape)}")


def pick_next(logits, temperature: float, top_k: int | None):
    """The next token (B, 1) from the last position's logits (B, V): argmax at temperature 0, else sampled."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)  # (B, 1)


# ----------------------------------------------------------------------------- adaptive depth


class AdaptiveKVCache(KVCache):
    """A KVCache for adaptive depth. Every (iteration, layer) Local KV keeps one row per token, as at fixed
    K = max_iter: a token that exited after iteration j holds copies of its iteration-j rows at j+1..max_iter,
    which is what later tokens read there (Huginn's "latest" lookup, stored instead of looked up). So the cache
    takes as many bytes as at fixed max_iter; `reused_rows` counts the copies a compact cache would not store.

    exit_iter: (B, T) iterations each cached token ran. record=True keeps, in `fed`, the (K, V) that each
    (kind, iteration, layer) attention call last received, for tests and probes.
    """

    def __init__(self, record: bool = False):
        super().__init__()
        self.exit_iter = None
        self.fed = {} if record else None

    def reused_rows(self) -> int:
        """Local KV rows (token, iteration, layer; per batch row) that are copies of an earlier iteration's."""
        if self.exit_iter is None:
            return 0
        n_local = len({key[2] for key, c in self.layers.items() if key[0] in ("local", "block") and c.k is not None})
        return int((self.n_iter - self.exit_iter).sum()) * n_local


class ReuseExitedKV:
    """The Local KV that the attention call at (kind, iteration k, layer l) appends: the rows of tokens that have
    exited are replaced by the same layer's rows at iteration k-1, which (by induction) are their last computed ones."""

    def __init__(self, cache: AdaptiveKVCache, key: tuple, exited):
        self.cache, self.key, self.exited = cache, key, exited  # exited: (B, N) for the N new tokens

    def append(self, k, v):
        kind, it, layer = self.key
        if it and self.exited.any():
            prev, n, m = self.cache.layer(kind, it - 1, layer), k.size(-2), self.exited[:, None, :, None]
            k, v = torch.where(m, prev.k[..., -n:, :], k), torch.where(m, prev.v[..., -n:, :], v)
        k, v = self.cache.layer(*self.key).append(k, v)
        if self.cache.fed is not None:
            self.cache.fed[self.key] = (k, v)
        return k, v


def adaptive_states(model, idx, exit_threshold: float, max_iter: int, cache: AdaptiveKVCache):
    """(z, exit_iter) for the N tokens of idx (B, N) after those in the cache: each token's decoder state after
    its last iteration (B, N, d) and how many iterations it ran (B, N).

    The decoder runs one iteration at a time. After iteration k >= 2 a token stops once
    KL(p_{k-1} || p_k) < exit_threshold, where p_k = softmax(head(norm(z_k))) is the logit lens of its state
    (the KL direction of Huginn's KLExitEvaluator.check, seal-rg/recurrent-pretraining, raven_modeling_minimal.py).
    (ours) No check after iteration 1: Huginn compares p_1 with the uniform distribution
    (KLExitEvaluator.init), which lets a token whose first prediction is near uniform stop at once.
    Exited tokens keep their state and, in later iterations, show later tokens their last Local KV
    (ReuseExitedKV); the Global KV (once per token) is unchanged. exit_threshold=0 never exits: fixed K = max_iter.
    Tokens of one step run together, so compute falls only once all of them have exited.
    """
    cfg = model.config
    if cfg.arch == "dense":
        raise ValueError("adaptive depth needs a looped model (arch full_loop or asymloop); dense runs each block once")
    b, n = idx.shape
    start = cache.pos
    if start + n > cfg.max_seq_len:
        raise ValueError(f"sequence length {start + n} exceeds max_seq_len={cfg.max_seq_len}; "
                         f"shorten the input or build the model with a larger max_seq_len")
    cache.advance(n, max_iter)
    x = model.embed(idx)  # (B, N, d)
    if cfg.arch == "full_loop":  # the whole stack loops, z_0 = embed(x)
        kind, blocks, h, z, kv = "block", model.blocks, None, x, [None] * len(model.blocks)
    else:
        for i, blk in enumerate(model.encoder):
            x = blk(x, model.rope, cache=cache.layer("enc", i), start=start)
        kind, blocks, h = "local", model.decoder, x
        kv = model.global_kv(h, start, cache) if cfg.context == "global_kv" else [None] * len(blocks)
        z = torch.zeros_like(h) if cfg.context == "additive" else h
    exit_iter = torch.full((b, n), max_iter, dtype=torch.long, device=idx.device)
    running = torch.ones(b, n, dtype=torch.bool, device=idx.device)
    logp = None
    for k in range(max_iter):
        if not running.any():  # all exited: carry their Local KV to the later iterations, nothing to compute
            for i in range(len(blocks)):
                prev = cache.layer(kind, k - 1, i)
                if prev.k is not None:
                    ReuseExitedKV(cache, (kind, k, i), ~running).append(prev.k[..., -n:, :], prev.v[..., -n:, :])
            continue
        y = z + h if cfg.context == "additive" else z
        for i, (blk, kv_i) in enumerate(zip(blocks, kv)):
            y = blk(y, model.rope, kv_i, ReuseExitedKV(cache, (kind, k, i), ~running), start)
        z = torch.where(running[..., None], y, z)  # exited tokens keep their state
        new_logp = F.log_softmax(model.logits(z).float(), dim=-1)  # (B, N, V)
        if logp is not None:
            kl = iteration_kl(logp, new_logp)
            settled = running & (kl < exit_threshold)
            exit_iter[settled] = k + 1
            running &= ~settled
        logp = new_logp
    cache.exit_iter = exit_iter if cache.exit_iter is None else torch.cat([cache.exit_iter, exit_iter], dim=1)
    return z, exit_iter


def iteration_kl(logp_prev, logp):
    """KL(p_{k-1} || p_k) per position from two log-probability tensors (..., V): the exit rule's signal,
    clamped at 0 so rounding never makes it negative."""
    return (logp_prev.exp() * (logp_prev - logp)).sum(-1).clamp_min(0)


def check_adaptive_args(model, exit_threshold, max_iter) -> int:
    """max_iter (None -> the trained K), after checking both values."""
    if exit_threshold is None or not exit_threshold >= 0:
        raise ValueError(f"exit_threshold must be a number >= 0 (0 = fixed depth max_iter), got {exit_threshold!r}")
    max_iter = model.config.n_iter if max_iter is None else max_iter
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter (K_max) must be an integer >= 1, got {max_iter!r}")
    return max_iter


@torch.no_grad()
def adaptive_logits(model, idx, exit_threshold: float, max_iter: int | None = None, record: bool = False):
    """Teacher-forced adaptive depth over whole sequences idx (B, T): (logits (B, T, V), exit_iter (B, T), cache).
    The same computation as generating the sequence token by token with `generate_adaptive`."""
    max_iter = check_adaptive_args(model, exit_threshold, max_iter)
    cache = AdaptiveKVCache(record)
    z, exit_iter = adaptive_states(model, idx, exit_threshold, max_iter, cache)
    return model.logits(z), exit_iter, cache


@torch.no_grad()
def generate_adaptive(model, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                      use_cache: bool = True, stop_id: int | None = None, exit_threshold: float | None = None,
                      max_iter: int | None = None):
    """`generate` with adaptive depth: (idx with the new tokens, iters (B, n_new)), iters[:, i] being the decoder
    iterations of the position that produced new token i. See adaptive_states for the exit rule and the KV reuse."""
    check_generate_args(idx, max_new_tokens, temperature, top_k)
    max_iter = check_adaptive_args(model, exit_threshold, max_iter)
    window, prompt_len, iters = model.config.max_seq_len, idx.size(1), []
    cache = AdaptiveKVCache() if use_cache else None
    for _ in range(max_new_tokens):
        if idx.size(1) > window or not use_cache:  # the window slides, or no cache: recompute it (exits too)
            cache, new = AdaptiveKVCache(), idx[:, -window:]
        else:
            new = idx[:, cache.pos:]
        z, exit_iter = adaptive_states(model, new, exit_threshold, max_iter, cache)
        idx = torch.cat([idx, pick_next(model.logits(z[:, -1]), temperature, top_k)], dim=1)
        iters.append(exit_iter[:, -1])
        if stop_id is not None and (idx[:, prompt_len:] == stop_id).any(dim=1).all():
            break
    return idx, torch.stack(iters, dim=1) if iters else idx.new_zeros(idx.size(0), 0)


def kv_cache_bytes(cfg, seq_len: int, batch: int = 1, dtype=torch.bfloat16, n_iter: int | None = None) -> int:
    """Bytes of the KV cache for batch sequences of seq_len tokens: K and V, (B, T, d) each,
    per cached attention call (see KVCache). AsymLoop caches E + D·[Global KV] + K·D·[Local KV]."""
    k = n_iter or cfg.n_iter
    if cfg.arch == "asymloop":
        n_caches = cfg.n_enc + cfg.n_dec * (cfg.context == "global_kv") + k * cfg.n_dec * cfg.local_kv
    else:
        n_caches = cfg.n_layer * (k if cfg.arch == "full_loop" else 1)
    return n_caches * 2 * batch * seq_len * cfg.d_model * torch.empty((), dtype=dtype).element_size()
