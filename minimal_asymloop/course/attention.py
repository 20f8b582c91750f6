"""Notebook 01's plumbing: small tables for the numeric trace of joint attention, the checks that compare a piece
built in the notebook with the package's module (and show a wrong version failing), and the build's reference."""

import time

import torch

from minimal_asymloop.adaptive import chain_batch, chain_model
from minimal_asymloop.course.draw import COLORS, FONT, GREY, NotebookFigure
from minimal_asymloop.paths import RESULTS


def key_labels(n: int) -> list[str]:
    """Column names of the (N, 2N) score matrix: Global keys G0..G(N-1), then Local keys L0..L(N-1)."""
    return [f"G{j}" for j in range(n)] + [f"L{j}" for j in range(n)]


def table(title: str, rows, cols: list[str] | None = None, row_name: str = "token", width: int = 7,
          digits: int = 3) -> str:
    """A small matrix (list of rows, or a 1-D or 2-D tensor) as aligned text; -inf prints as '-inf', and a bar
    separates the Global half from the Local half when the columns are key_labels."""
    m = torch.as_tensor(rows, dtype=torch.float64)
    m = m[:, None] if m.dim() == 1 else m
    if m.dim() != 2:
        raise ValueError(f"table takes a 1-D or 2-D matrix, got shape {tuple(m.shape)}; pick one head and batch row")
    cols = cols or [str(j) for j in range(m.size(1))]
    if len(cols) != m.size(1):
        raise ValueError(f"{len(cols)} column names for {m.size(1)} columns; pass one name per column")
    split = m.size(1) // 2 if cols == key_labels(m.size(1) // 2) and m.size(1) % 2 == 0 else None

    def cell(x):
        return "-inf".rjust(width) if x == float("-inf") else f"{x:{width}.{digits}f}"

    def line(first, items):
        items = list(items)
        if split:
            items.insert(split, " |")
        return f"{first:>8}" + "".join(items)

    out = [title, line("", (c.rjust(width) for c in cols))]
    out += [line(f"{row_name} {i}", (cell(x) for x in r.tolist())) for i, r in enumerate(m)]
    return "\n".join(out)


def show(title: str, rows, cols: list[str] | None = None, **kw):
    print(table(title, rows, cols, **kw) + "\n")


def check(label: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-10):
    """Assert that a piece built in the notebook equals the package's within tol (float64 rounding: about 1e-14 in
    notebook 01); print the largest difference."""
    if got.shape != want.shape:
        raise AssertionError(f"{label}: shape {tuple(got.shape)} against {tuple(want.shape)}")
    diff = (got - want).abs().max().item()
    if not diff <= tol:
        raise AssertionError(f"{label}: largest difference {diff:.2g} > tolerance {tol:g}")
    print(f"OK      {label}: largest difference {diff:.1g}")


def show_failing(label: str, run):
    """Run a check on a wrong version: it must raise AssertionError, which is printed (so the notebook goes on).
    A wrong version that passes is an error: the check could not tell it apart."""
    try:
        run()
    except AssertionError as e:
        print(f"CAUGHT  wrong version ({label}): {e}")
        return
    raise RuntimeError(f"the check passed on a wrong version ({label}); it cannot tell the two apart")


def global_shares(scores: torch.Tensor, mask: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """w_G per query: the Global half's share of ONE softmax over the (N, 2N) masked scores, the Global half's scores
    multiplied by global_scale."""
    n = scores.size(-1) // 2
    s = torch.cat([global_scale * scores[..., :n], scores[..., n:]], dim=-1)
    return s.masked_fill(~mask, float("-inf")).softmax(-1)[..., :n].sum(-1)


def competition_figure(scores: torch.Tensor, mask: torch.Tensor, global_scale: float = 1.0, max_scale: float = 3.0):
    """Left: the one softmax's probabilities (N, 2N) with the Global scores times global_scale. Right: w_G per token
    against the Global scale, one softmax (a curve per token) against two softmaxes averaged (0.5 whatever the scores)."""
    if scores.dim() != 2 or scores.shape != mask.shape or scores.size(1) != 2 * scores.size(0):
        raise ValueError(f"scores {tuple(scores.shape)} and mask {tuple(mask.shape)} must both be (N, 2N); pass one head")
    n = scores.size(0)
    s = torch.cat([global_scale * scores[:, :n], scores[:, n:]], dim=1)
    probs = s.masked_fill(~mask, float("-inf")).softmax(1)
    fig = NotebookFigure(figsize=(10, 3.3), layout="constrained")
    ax, bx = fig.subplots(1, 2, width_ratios=(1.1, 1))
    ax.imshow(probs.numpy(), cmap="Purples", vmin=0, vmax=1)
    for (i, j), p in zip(torch.cartesian_prod(torch.arange(n), torch.arange(2 * n)).tolist(), probs.flatten().tolist()):
        ax.text(j, i, f"{p:.2f}" if mask[i, j] else "-", ha="center", va="center", fontsize=FONT - 1,
                color="white" if p > 0.5 else "black")
    ax.axvline(n - 0.5, color="black", lw=2)
    ax.set_xticks(range(2 * n), key_labels(n))
    ax.set_yticks(range(n), [f"token {i}" for i in range(n)])
    ax.set_xlabel("key column: Global half | Local half")
    ax.set_ylabel("query")
    ax.set_title(f"one softmax, Global scores x{global_scale:g}: each row sums to 1", fontsize=FONT)
    grid = torch.linspace(0, max_scale, 61)
    curves = torch.stack([global_shares(scores, mask, float(g)) for g in grid])  # (len(grid), N)
    shades, styles = plt_purples(n), ("-", "--", "-.", ":")  # tokens in joint attention's purple, not the halves' colours
    for i in range(n):
        bx.plot(grid.numpy(), curves[:, i].numpy(), lw=2, color=shades[i], ls=styles[i % 4], label=f"token {i}, one softmax")
    bx.axhline(0.5, color=COLORS["head"], ls=(0, (1, 1)), lw=2, label="two softmaxes averaged (any scale)")
    bx.axvline(global_scale, color="black", lw=0.8, ls=":")
    bx.set_ylim(0, 1)
    bx.set_xlabel("GLOBAL_SCALE (factor on every Global score)")
    bx.set_ylabel("$w_G$: Global share of the mass")
    bx.set_title("Only one softmax lets the halves compete", fontsize=FONT)
    bx.legend(fontsize=FONT - 2.5, loc="lower right")
    return fig


def plt_purples(n: int) -> list:
    """n shades of the joint-attention purple (light to dark) for per-token curves."""
    from matplotlib import colormaps

    return [colormaps["Purples"](0.45 + 0.5 * i / max(n - 1, 1)) for i in range(n)]


CHAIN_SEEDS = (0, 1, 3)  # notebook 03's trained AsymLoop K = 3 models with both halves, committed


def chain_masked(masks: dict, seeds=CHAIN_SEEDS, build=None) -> dict:
    """Notebook 01, section 5: {seed: {mask: {hops: accuracy}}} of notebook 03's trained chain models (AsymLoop
    E = D = 1, K = 3) on 256 held-out programs (`adaptive.chain_batch`), each run through `build(model, idx, n_iter,
    probs)` (default: this module's `asymloop`, which reads the configuration from the model; the notebook's cells
    read the tiny model's) with every `probs` of `masks`."""
    run = build or asymloop  # the reference build, defined below
    idx, targets, hops = chain_batch()
    out = {}
    for seed in seeds:
        model = chain_model(RESULTS / "chain_weights" / f"asymloop_k3-s{seed}.safetensors").to(torch.get_default_dtype())
        with torch.no_grad():
            right = {name: run(model, idx, model.config.n_iter, probs).argmax(-1) == targets for name, probs in masks.items()}
        out[seed] = {name: {h: r[(targets >= 0) & (hops == h)].double().mean().item() for h in (1, 2, 3)}
                     for name, r in right.items()}
    return out


def decoder_look_figure(shares: dict, acc: dict, chance: float, chain: dict | None = None):
    """Notebook 01, section 5, per init: left, the Global share of the mass at init and after training (bar: the mean;
    dots: the K x D (k, layer) cells, side by side); middle, accuracy with nothing, the Global half or the Local half
    masked. With `chain` (`chain_masked`'s dict), a third panel: the chain models' 3-hop accuracy under the same masks."""
    fig = NotebookFigure(figsize=(14 if chain else 10, 3.4), layout="constrained")
    ax, bx, *cx = fig.subplots(1, 3 if chain else 2, gridspec_kw=dict(width_ratios=[1, 1.1, 1] if chain else [1, 1]))
    for i, pair in enumerate(shares.values()):
        for j, s in enumerate(pair):  # j = 0: at init, 1: trained
            x = 3 * i + j
            ax.bar(x, s.mean().item(), color=COLORS["global_kv"] if j else GREY, width=0.8,
                   label=("at init", "trained")[j] if i == 0 else None)
            spread = [x + 0.5 * (c / max(s.numel() - 1, 1) - 0.5) for c in range(s.numel())]  # side by side, (k, layer) order
            ax.scatter(spread, s.flatten().tolist(), color="black", s=12, zorder=3,
                       label="one (k, layer) cell" if i == j == 0 else None)
    ax.axhline(0.5, color=COLORS["head"], ls=":", lw=1)
    ax.set_xticks([3 * i + 0.5 for i in range(len(shares))], [f"{init} init" for init in shares])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("Global share of the mass")
    ax.set_title("Where the attention mass sits: the two runs differ (one seed per init)", fontsize=FONT)
    ax.legend(fontsize=FONT - 2.5, loc="upper center", ncol=3)
    names = list(next(iter(acc.values())))  # what is masked; a bar's colour: what is left (both, Local, Global)
    for i, (init, a) in enumerate(acc.items()):
        xs = [4 * i + j for j in range(len(names))]
        bars = bx.bar(xs, list(a.values()), width=0.8, color=[COLORS["joint_attention"], COLORS["loop"], COLORS["global_kv"]])
        bx.bar_label(bars, fmt="%.2f", fontsize=FONT - 2)
        bx.text(4 * i + 1, 1.13, f"{init} init", ha="center", fontsize=FONT - 1)
    bx.axhline(chance, color=COLORS["head"], ls=":", lw=1)
    bx.text(3, chance + 0.03, f"chance\n{chance:.2f}", ha="center", fontsize=FONT - 2.5)
    left = {"nothing": "both", "Global": "Local", "Local": "Global"}  # what a mask leaves, as the bar's colour says
    bx.set_xticks([4 * i + j for i in range(len(acc)) for j in range(len(names))],
                  [f"{n}\n({left.get(n, '?')} left)" for n in names] * len(acc), fontsize=FONT - 3)
    bx.set_xlabel("half masked in all layers and iterations (colour: the half left)")
    bx.set_ylim(0, 1.22)
    bx.set_ylabel("accuracy, new sequences")
    bx.set_title("Lag task: masking the Global half leaves near chance", fontsize=FONT, pad=18)
    if chain:  # grouped by seed, one bar per mask, coloured by the half left
        for i, a in enumerate(chain.values()):
            bars = cx[0].bar([4 * i + j for j in range(len(a))], [v[3] for v in a.values()], width=0.8,
                             color=[COLORS["joint_attention"], COLORS["loop"], COLORS["global_kv"]][: len(a)])
            cx[0].bar_label(bars, fmt="%.2f", fontsize=FONT - 2)
        cx[0].axhline(0.25, color=COLORS["head"], ls=":", lw=1)
        cx[0].text(3, 0.28, "chance\n0.25", ha="center", fontsize=FONT - 2.5)  # between the first two seeds' bars
        cx[0].set_xticks([4 * i + 1 for i in range(len(chain))], [f"seed {s}" for s in chain])
        cx[0].set_ylim(0, 1.12)
        cx[0].set_ylabel("3-hop accuracy")
        cx[0].set_xlabel("bars: nothing, Global, Local masked (colour: the half left)")
        cx[0].set_title("Chain task (notebook 03's models):\nmasking the Local half breaks 3-hop answers", fontsize=FONT)
    return fig


def print_verdicts(acc: dict, holds: dict, chain: dict | None = None):
    """Notebook 01, section 5: per init, accuracy with each half masked and whether each claim holds; per chain model
    (`chain_masked`), accuracy by hop count under each mask."""
    for init in acc:
        print(f"lag task, {init} init: accuracy, masking", ", ".join(f"{n}: {a:.2f}" for n, a in acc[init].items()))
        for claim, h in holds[init].items():
            print(f"  {'holds' if h else 'does NOT hold'}: {claim}")
    for seed, a in (chain or {}).items():
        print(f"chain task, seed {seed}: 1/2/3-hop accuracy, masking",
              "; ".join(f"{n}: " + "/".join(f"{x:.2f}" for x in by.values()) for n, by in a.items()))


# The build of notebook 01, section 4, as the package's reference: the notebook's unwritten steps (global_kv,
# joint_softmax) fall back on these, and its solutions notebook imports them, so that an edit to the notebook does
# not change what the solutions run. The same code as the notebook's cells; configuration read from the model.
def trace():
    """Section 2's hand trace: q, k_g, v_g, k_l, v_l (3 tokens, head dimension 2) and its (3, 6) scores, causal
    (3, 3) and joint (3, 6) masks, as a dict."""
    import math

    t = dict(q=[[1., 0.], [0., 1.], [1., 1.]], k_g=[[2., 0.], [0., 1.], [1., -1.]], v_g=[[1., 0.], [0., 1.], [1., 1.]],
             k_l=[[0., 1.], [1., 1.], [-1., 0.]], v_l=[[0., 0.], [2., 0.], [0., 2.]])
    t = {name: torch.tensor(v, dtype=torch.float64) for name, v in t.items()}
    t["scores"] = torch.cat([t["q"] @ t["k_g"].T, t["q"] @ t["k_l"].T], dim=1) / math.sqrt(2)
    t["causal"] = torch.ones(3, 3, dtype=torch.bool).tril()
    t["mask"] = torch.cat([t["causal"], t["causal"]], dim=1)
    return t


def tiny_model(seed: int = 0, n: int = 6):
    """Section 4's random AsymLoop in float64 (E = D = 2, K = 3, width 16, init_std 0.25, norm scales moved from 1)
    and two sequences of n tokens: (cfg, model, idx)."""
    from minimal_asymloop.model import LoopedLM, ModelConfig

    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # drawn in float64, as in the notebook (the same numbers)
    try:
        torch.manual_seed(seed)
        cfg = ModelConfig(arch="asymloop", n_layer=4, n_iter=3, d_model=16, n_head=2, d_ff=32, vocab_size=32,
                          max_seq_len=16, init_std=0.25)
        model = LoopedLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # RMSNorm and QKNorm scales, all 1 at init
                    p.add_(0.2 * torch.randn_like(p))
        return cfg, model, torch.randint(0, cfg.vocab_size, (2, n))
    finally:
        torch.set_default_dtype(dtype)


def rms_norm(x, g, eps: float = 1e-6):
    return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def heads(x, n_head: int):  # (B, N, d) -> (B, n_head, N, hd)
    return x.view(x.size(0), x.size(1), n_head, -1).transpose(1, 2)


def rope(x, theta: float = 10000.0):  # rotate-half RoPE at positions 0..N-1, float32 angles as the package's
    n, hd = x.shape[-2:]
    freq = theta ** -(torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angle = torch.outer(torch.arange(n, dtype=torch.float32), freq).repeat(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * angle.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * angle.sin().to(x.dtype)


def qkv(attn, x, theta: float = 10000.0):  # QKNorm, then RoPE, on queries and keys
    q = rope(rms_norm(heads(x @ attn.wq.weight.T, attn.n_head), attn.q_norm.weight, attn.q_norm.eps), theta)
    k = rope(rms_norm(heads(x @ attn.wk.weight.T, attn.n_head), attn.k_norm.weight, attn.k_norm.eps), theta)
    return q, k, heads(x @ attn.wv.weight.T, attn.n_head)


def causal_attention(attn, x, masked: bool = True):
    import math

    q, k, v = qkv(attn, x)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if masked:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return (s.softmax(-1) @ v).transpose(1, 2).flatten(2) @ attn.wo.weight.T


def block(blk, x, attend):  # pre-norm: attention sublayer, then the SwiGLU MLP
    import torch.nn.functional as F

    x = x + attend(rms_norm(x, blk.attn_norm.weight, blk.attn_norm.eps))
    a = rms_norm(x, blk.mlp_norm.weight, blk.mlp_norm.eps)
    return x + (F.silu(a @ blk.mlp.gate.weight.T) * (a @ blk.mlp.up.weight.T)) @ blk.mlp.down.weight.T


def encoder(model, x):  # token embeddings (B, N, d) -> H
    for blk in model.encoder:
        x = block(blk, x, lambda a, blk=blk: causal_attention(blk.attn, a))
    return x


def global_kv(model, H):  # [(K^G_l, V^G_l) for each decoder layer l], each (B, n_head, N, hd)
    h = rms_norm(H, model.enc_norm.weight, model.enc_norm.eps)
    out = []
    for blk in model.decoder:
        a = blk.attn
        k = rms_norm(heads(h @ a.wk_glob.weight.T, a.n_head), a.k_glob_norm.weight, a.k_glob_norm.eps)  # QKNorm
        out.append((rope(k, model.config.rope_theta), heads(h @ a.wv_glob.weight.T, a.n_head)))
    return out


def joint_softmax(s, causal_global: bool = True):  # s (..., N, 2N) -> ONE softmax over both halves
    causal = torch.ones(s.shape[-2], s.shape[-2], dtype=torch.bool).tril()
    seen_global = causal if causal_global else torch.ones_like(causal)
    mask = torch.cat([seen_global, causal], dim=-1)  # (N, 2N): Global half, then Local half
    return s.masked_fill(~mask, float("-inf")).softmax(-1)


def joint_attention_layer(attn, x, kv_glob, probs=joint_softmax):
    import math

    q, k, v = qkv(attn, x)
    k_g, v_g = kv_glob
    s = torch.cat([q @ k_g.transpose(-2, -1), q @ k.transpose(-2, -1)], dim=-1) / math.sqrt(q.size(-1))
    return (probs(s) @ torch.cat([v_g, v], dim=-2)).transpose(1, 2).flatten(2) @ attn.wo.weight.T


def decoder_layer(blk, z, kv_glob, probs=None):  # probs None: joint_softmax
    return block(blk, z, lambda a: joint_attention_layer(blk.attn, a, kv_glob, probs or joint_softmax))


def decoder_loop(model, H, n_iter: int, global_from_state: bool = False, probs=None):  # [z_1, ..., z_K]
    kv = global_kv(model, H)  # once, before the loop
    z, states = H, []
    for _ in range(n_iter):
        if global_from_state:  # the wrong version: Global KV from z_{k-1}
            kv = global_kv(model, z)
        for blk, kv_l in zip(model.decoder, kv):
            z = decoder_layer(blk, z, kv_l, probs)
        states.append(z)
    return states


def asymloop(model, idx, n_iter: int, probs=joint_softmax):  # tokens (B, N) -> logits (B, N, vocab)
    H = encoder(model, model.embed.weight[idx])
    return rms_norm(decoder_loop(model, H, n_iter, probs=probs)[-1], model.norm.weight, model.norm.eps) @ model.head.weight.T


def train_lag(model, batch, steps: int, lr: float = 1e-2) -> float:
    """Notebook 01's section 5: `steps` AdamW steps of the package's forward on batch() -> (tokens, targets), targets
    -100 where there is none; returns the CPU seconds taken."""
    import torch.nn.functional as F
    opt, cpu = torch.optim.AdamW(model.parameters(), lr=lr), time.process_time()
    for _ in range(steps):
        x, y = batch()
        loss = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.process_time() - cpu
