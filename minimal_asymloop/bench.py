"""Benchmarks that print figures (never timed unit tests).

    python -m minimal_asymloop.bench attention   # joint attention paths vs causal SDPA
    python -m minimal_asymloop.bench moe         # MoE FFN (expert loop) vs dense SwiGLU, layer and model
    python -m minimal_asymloop.bench generate    # KV-cached vs uncached generation, cache memory
    python -m minimal_asymloop.bench alrs        # one ALRS allocation vs 100 training steps
    python -m minimal_asymloop.bench train --size tiny   # training step: dense vs full_loop K=2 vs asymloop K=3
    python -m minimal_asymloop.bench gpu --out gpu.json  # a fresh GPU's self-check, <= 8 minutes on one H100 (bench_gpu.py)
    python -m minimal_asymloop.bench data        # data preparation MB/s and tokens/s with 1 and 2 tokenizer workers
    python -m minimal_asymloop.bench adaptive --ckpt out/tiny-asymloop-k3   # adaptive per-token depth vs fixed K
    python -m minimal_asymloop.bench loss        # chunked linear + cross-entropy vs fp32 logits: peak memory, time
    python -m minimal_asymloop.bench depth --k 8 # truncated backprop through the loop: peak memory and time vs n (depth.py)
    python -m minimal_asymloop.bench depth --samplers  # time per token of sampled K against fixed K = 3, side by side
"""

import argparse
import time

import numpy as np
import torch

from minimal_asymloop.bench_gpu import bench_gpu, causal_flash_only
from minimal_asymloop.flops import flops_per_token
from minimal_asymloop.generate import kv_cache_bytes
from minimal_asymloop.loss import CHUNK_ELEMENTS, linear_cross_entropy, plain_cross_entropy
from minimal_asymloop.model import (
    PAPER_MOE,
    LoopedLM,
    ModelConfig,
    MoE,
    SwiGLU,
    causal_attention,
    joint_attention,
    joint_attention_masked,
    joint_attention_reference,
)
from minimal_asymloop.system import (
    DTYPES,
    ConfigError,
    autocast_context,
    gpu_peak_flops,
    grad_scaler,
    mps_error,
    peak_new_bytes,
    pick_device,
    resolve_dtype,
    timeit,
)


def bench_attention(args):
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, H, hd = 8, 6, 128
    print(f"joint attention, forward+backward, B={B} H={H} head_dim={hd}, {device} {dtype}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'N':>5} {'path':<28} {'ms':>9} {'vs reference':>13} {'vs causal SDPA':>15}")
    for n in args.seq:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, kg, vg, kl, vl = (torch.randn(B, H, n, hd, generator=g).to(device, dtype).requires_grad_() for _ in range(5))
        dout = torch.randn(B, H, n, hd, generator=g).to(device, dtype)

        def run(f, *xs):
            return lambda: torch.autograd.backward(f(*xs), dout)  # noqa: B023 (used inside the loop)

        paths = {
            "joint_attention (fast)": run(joint_attention, q, kg, vg, kl, vl),
            "SDPA + (N,2N) bool mask": run(joint_attention_masked, q, kg, vg, kl, vl),
            "reference (naive)": run(joint_attention_reference, q, kg, vg, kl, vl),
            "causal SDPA over N keys": run(causal_attention, q, kl, vl),
            "causal flash over N keys": run(causal_flash_only, q, kl, vl),  # the kernel joint_attention calls twice
        }
        t = {name: timeit(fn, device) for name, fn in paths.items()}
        for name, s in t.items():
            print(f"{n:>5} {name:<28} {s * 1e3:>9.1f} {s / t['reference (naive)']:>13.2f} "
                  f"{s / t['causal SDPA over N keys']:>15.2f}")
    print("floor for fast/causal-SDPA is about 2 (twice the keys); target <= 2.3 at N=1024. SDPA may pick another "
          "kernel than flash for the causal call (cuDNN on an H200): the last row is the flash kernel itself")


def bench_moe(args):
    """Forward+backward time of the paper's MoE FFN (8 experts, top-2, half width) against the dense SwiGLU
    it replaces (same active FLOPs), for one layer and for a whole training step of the given size."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_preset(args.size, args.arch, max_seq_len=args.seq)
    moe_cfg = ModelConfig.from_preset(args.size, args.arch, max_seq_len=args.seq, **PAPER_MOE)
    B, N, d = args.batch, args.seq, cfg.d_model
    print(f"MoE ({moe_cfg.moe_experts} experts, top-{moe_cfg.moe_top_k}, width {moe_cfg.moe_d_ff}) vs dense SwiGLU "
          f"(width {cfg.d_ff}), size {args.size}, B={B} N={N}, {device} {dtype}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    x = torch.randn(B * N, d, device=device, requires_grad=True)
    ctx = lambda: torch.autocast(device.type, dtype) if dtype != torch.float32 else torch.autocast(device.type, enabled=False)

    def step(module, *inputs):
        def run():
            with ctx():
                out = module(*inputs)
            (out[1] if isinstance(out, tuple) else out).float().sum().backward()
        return run

    idx = torch.randint(0, cfg.vocab_size, (B, N), device=device)
    rows = {
        "FFN layer": (step(SwiGLU(d, cfg.d_ff).to(device), x), step(MoE(moe_cfg).to(device), x)),
        f"{args.arch} train step": (step(LoopedLM(cfg).to(device).train(), idx, idx),
                                    step(LoopedLM(moe_cfg).to(device).train(), idx, idx)),
    }
    print(f"{'what':<24} {'dense ms':>10} {'MoE ms':>10} {'MoE/dense':>10}")
    for name, (dense, moe) in rows.items():
        t_dense, t_moe = timeit(dense, device), timeit(moe, device)
        print(f"{name:<24} {t_dense * 1e3:>10.1f} {t_moe * 1e3:>10.1f} {t_moe / t_dense:>10.2f}")


def bench_generate(args):
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"generation, {args.size} model (random weights), batch {args.batch}, prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens, greedy, {device} float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'arch':<10} {'K':>2} {'cached tok/s':>13} {'uncached tok/s':>15} {'speedup':>8}  same tokens")
    for arch, k in [("dense", 1), ("full_loop", 2), ("asymloop", 3)]:
        torch.manual_seed(0)
        model = LoopedLM(ModelConfig.from_preset(args.size, arch, n_iter=k)).to(device).eval()
        prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)
        out, tps = {}, {}
        for use_cache in (True, False):
            model.generate(prompt, 4, temperature=0, use_cache=use_cache)  # warmup
            sync()
            t0 = time.perf_counter()
            out[use_cache] = model.generate(prompt, args.new_tokens, temperature=0, use_cache=use_cache)
            sync()
            tps[use_cache] = args.batch * args.new_tokens / (time.perf_counter() - t0)
        print(f"{arch:<10} {k:>2} {tps[True]:>13.1f} {tps[False]:>15.1f} {tps[True] / tps[False]:>7.2f}x  "
              f"{'yes' if torch.equal(out[True], out[False]) else 'NO'}")
    print("\nKV cache memory, 60m, seq 1024, batch 1, bf16 (kv_cache_bytes):")
    dense = kv_cache_bytes(ModelConfig.from_preset("60m", "dense"), 1024, 1, torch.bfloat16)
    for arch, k in [("dense", 1), ("full_loop", 2), ("asymloop", 3), ("full_loop", 3), ("asymloop", 5)]:
        cfg = ModelConfig.from_preset("60m", arch, n_iter=k)
        b = kv_cache_bytes(cfg, 1024, 1, torch.bfloat16)
        print(f"{arch:<10} K={k}  eff. depth {cfg.effective_depth:>2}  {b / 2**20:6.1f} MiB  {b / dense:.2f}x dense")


def bench_alrs(args):
    """One ALRS allocation (eigenvalues, then each fit) for a preset, next to weightwatcher's
    analyze() and to 100 training steps estimated from a measured forward+backward.
    Prints wall and process CPU seconds: on a shared machine CPU time is the steadier figure."""
    import warnings

    from minimal_asymloop import alrs
    from minimal_asymloop.flops import count_params

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def clock(fn):  # (wall s, CPU s) of one call
        sync()
        w, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - w, time.process_time() - c

    cfg = ModelConfig.from_preset(args.size, args.arch, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    mats = alrs.tuned_matrices(model)
    print(f"ALRS allocation, {args.size} {args.arch} (K={cfg.n_iter}, {count_params(cfg) / 1e6:.1f}M params), "
          f"{len(mats)} tuned matrices, {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("  figures are (wall s / process CPU s)")
    t = clock(alrs.weightwatcher_module)
    print(f"  weightwatcher import, once per process: {t[0]:.1f} / {t[1]:.1f}")
    alrs.eigenvalues(mats["head.weight"])  # warm up the solver (CUDA handles, MKL threads)
    evals = {}
    t_eig = np.sum([clock(lambda n=n, w=w: evals.__setitem__(n, alrs.eigenvalues(w))) for n, w in mats.items()], axis=0)
    t_fit = {fit: clock(lambda fn=fn: [fn(e) for e in evals.values()]) for fit, fn in alrs.FIT_FNS.items()}
    print(f"  eigenvalues (torch.linalg.svdvals, float32, {device}): {t_eig[0]:.2f} / {t_eig[1]:.2f}")
    for fit, t in t_fit.items():
        print(f"  fit {fit:<12} (CPU): {t[0]:.2f} / {t[1]:.2f}   -> allocation: {t_eig[0] + t[0]:.2f} / {t_eig[1] + t[1]:.2f}")
    if args.ww_analyze:
        cpu_state = {k: v.detach().cpu() for k, v in mats.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = clock(lambda: alrs.weightwatcher_module().WeightWatcher().analyze(cpu_state, plot=False))
        print(f"  for reference, weightwatcher analyze() of the same matrices: {t[0]:.2f} / {t[1]:.2f}")

    # one training step = forward+backward over tokens_per_step tokens; we time a (batch, seq)
    # micro-batch and scale by tokens (optimizer step and communication not included)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    amp = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def fwd_bwd():
        with amp:
            _, loss = model(idx, idx, return_logits=False)
        loss.backward()

    fwd_bwd()  # warm-up
    t_mb = np.median([clock(fwd_bwd) for _ in range(args.repeats)], axis=0)
    scale = args.tokens_per_step / (args.batch * args.seq)
    print(f"  forward+backward of {args.batch}x{args.seq} tokens: {t_mb[0]:.2f} / {t_mb[1]:.2f}; one step of "
          f"{args.tokens_per_step} tokens ~ {t_mb[0] * scale:.1f} / {t_mb[1] * scale:.1f} on this device")
    for fit, t in t_fit.items():
        frac = (t_eig + t) / (100 * t_mb * scale)
        print(f"  allocation ({fit}) / 100 steps: {100 * frac[0]:.2g}% / {100 * frac[1]:.2g}%   (allocations run in the "
              f"first 20% only: {20 * frac[0]:.2g}% / {20 * frac[1]:.2g}% of training)")
    if device.type == "cuda" and args.size == "60m" and args.arch == "asymloop":  # the paper: 0.216 s/step on 8xH100
        for fit, t in t_fit.items():
            print(f"  vs the paper's 8xH100 step (0.216 s): allocation ({fit}, wall) / 100 steps = {(t_eig[0] + t[0]) / 21.6:.1%}")


def time_train_step(cfg, batch, seq, device, dtype, args) -> float:
    """Median seconds of one optimizer step (forward, backward, AdamW; fp16 with its loss scaler) on random tokens."""
    from minimal_asymloop.optim import param_groups

    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_model = torch.compile(model) if args.compile else model
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    scaler = grad_scaler(device, dtype)

    def step():
        with autocast_context(device, dtype):
            _, loss = step_model(x[:, :-1], x[:, 1:], return_logits=False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return timeit(step, device, warmup=args.warmup, min_time=args.min_time, max_iters=args.steps)


def bench_train(args):
    """Timed optimizer steps (forward, backward, AdamW) of the three architectures at one size, side by side."""
    from minimal_asymloop.config import TRAIN_PRESETS

    try:
        device = pick_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    preset = TRAIN_PRESETS[args.size]
    seq = args.seq or preset["seq_len"]
    batch = args.batch or preset.get("micro_batch") or preset["global_batch"]
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    peak = gpu_peak_flops(device)
    print(f"training step, size {args.size}, batch {batch} x seq {seq}, {device} {str(dtype).removeprefix('torch.')}"
          f"{' compiled' if args.compile else ''}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    mfu_head = f" {'MFU':>6}" if peak else ""
    print(f"{'arch':<10} {'K':>2} {'depth':>5} {'step ms':>9} {'tokens/s':>10} {'GFLOP/tok':>10} {'TFLOP/s':>8}{mfu_head} "
          f"{'FLOP-norm. vs dense':>20}")
    results = {}
    for arch, k in (("dense", 1), ("full_loop", 2), ("asymloop", 3)):
        cfg = ModelConfig.from_preset(args.size, arch, n_iter=k)
        if seq > cfg.max_seq_len:
            cfg = ModelConfig.from_preset(args.size, arch, n_iter=k, max_seq_len=seq)
        try:
            t = time_train_step(cfg, batch, seq, device, dtype, args)
        except (RuntimeError, TypeError) as e:
            if (err := mps_error(e)) is None:  # an op or dtype MPS lacks: one line naming the fix
                raise
            raise SystemExit(f"error: {err}") from None
        flops = 3 * flops_per_token(cfg, seq)["total"]  # training ~ 3x forward (the paper's Appendix D)
        results[arch] = (t, flops)
        ratio = (t / results["dense"][0]) / (flops / results["dense"][1])
        achieved = flops * batch * seq / t
        mfu = f" {achieved / peak:>6.1%}" if peak else ""
        print(f"{arch:<10} {k:>2} {cfg.effective_depth:>5} {t * 1e3:>9.1f} {batch * seq / t:>10,.0f} {flops / 1e9:>10.3f} "
              f"{achieved / 1e12:>8.3f}{mfu} {ratio:>20.3f}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        elif device.type == "mps":
            torch.mps.empty_cache()
    print("FLOP-normalized ratio = (t_arch / t_dense) / (F_arch / F_dense): 1.0 means looping and joint attention cost "
          "nothing beyond their arithmetic; target <= 1.15")
    return results


def bench_data(args):
    """Preparation throughput (tokenize + write shards; the tokenizer is trained once, outside the timing) on a local
    parquet file of FineWeb-Edu's schema whose texts are the stdlib corpus, with each worker count."""
    import os
    import tempfile
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from minimal_asymloop import data as D
    from minimal_asymloop import sources as S

    _, files = S.stdlib_files()
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files] * args.repeat
    n, mb = len(texts), sum(len(t.encode()) for t in texts) / 1e6
    table = pa.table({"text": texts, "id": [f"<urn:uuid:{i:08d}-bench>" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
                      "url": [f"https://example.org/{i}" for i in range(n)], "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
                      "language": ["en"] * n, "language_score": [0.95] * n, "token_count": [len(t) // 4 for t in texts],
                      "score": [3.0] * n, "int_score": [3] * n})
    print(f"data preparation: {n} documents, {mb:.1f} MB of text (the stdlib corpus x{args.repeat}) in a FineWeb-Edu-schema parquet, "
          f"BPE vocab {args.vocab}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'workers':>14} {'seconds':>9} {'MB/s':>7} {'tokens/s':>10} {'vs 1st':>7}  (best of {args.repeats})")
    with tempfile.TemporaryDirectory() as tmp:
        source = str(Path(tmp) / "fineweb-edu-schema.parquet")
        pq.write_table(table, source)
        tok = S.train_bpe(texts[::max(1, n // 300)], args.vocab)
        ident, first, streams = S.source_identity(source, None), None, set()
        for w in args.workers:
            best = float("inf")
            for r in range(args.repeats):
                work = Path(tmp) / f"w{w}-{r}"
                work.mkdir()
                t0 = time.perf_counter()
                progress = D.write_shards(work, source, ident, tok, 0.005, workers=w)
                best = min(best, time.perf_counter() - t0)
            tokens = progress["n_train_tokens"] + progress["n_val_tokens"]
            streams.add(b"".join((work / f).read_bytes() for f in progress["train_files"] + progress["val_files"]))
            first = first or best
            label = f"{w}" + (" (in-process)" if w == 1 else "")
            print(f"{label:>14} {best:9.2f} {mb / best:7.2f} {tokens / best:10,.0f} {first / best:6.2f}x")
    print(f"same tokens for every worker count: {len(streams) == 1}. Workers 1: one process, tokenizers' own threads per batch; "
          f"N > 1: N tokenizer processes fed while the source streams")


def bench_adaptive(args):
    """Adaptive per-token depth against fixed K (adaptive.py measures it; this prints it)."""
    from minimal_asymloop import adaptive

    return adaptive.bench(args)


def bench_loss(args):
    """Peak memory and time of the LM loss, forward + backward, at the head's shape: chunked vs every logit in fp32."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, d, v = args.tokens, args.d_model, args.vocab
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(tokens, d, generator=g).to(device).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.02).to(device).requires_grad_()
    y = torch.randint(0, v, (tokens,), generator=g).to(device)
    chunk = args.chunk or max(1, CHUNK_ELEMENTS // v)
    print(f"LM loss forward+backward: {tokens:,} tokens x d {d} -> vocab {v:,}, {device} "
          f"{'bf16 autocast' if cuda else 'fp32'}; fp32 logits would be {tokens * v * 4 / 2**30:.2f} GiB; chunk {chunk:,} tokens")
    print(f"{'loss':<24} {'peak MiB':>10} {'ms':>9}")
    chunked = lambda *a: linear_cross_entropy(*a, chunk=chunk)  # noqa: E731
    for name, fn in (("plain (fp32 logits)", plain_cross_entropy), ("linear_cross_entropy", chunked)):
        def step(fn=fn):
            h.grad = w.grad = None
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                loss = fn(h, w, y)
            loss.backward()
        if cuda:  # the allocator's own peak, above what is allocated before the step
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device) - base
        else:  # live tensor storages created by the step (system.peak_new_bytes), the gradients included
            peak = peak_new_bytes(step)
        t = timeit(step, device, warmup=1, min_time=args.min_time, max_iters=10)
        print(f"{name:<24} {peak / 2**20:>10,.0f} {t * 1e3:>9.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention", help="joint attention paths vs causal SDPA")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    m = sub.add_parser("moe", help="MoE FFN expert loop vs dense SwiGLU, one layer and one training step")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--size", default="tiny")
    m.add_argument("--arch", default="asymloop")
    m.add_argument("--batch", type=int, default=8)
    m.add_argument("--seq", type=int, default=128)
    g = sub.add_parser("generate", help="KV-cached vs uncached generation tokens/s, and KV cache memory")
    g.add_argument("--device", default="cpu")
    g.add_argument("--size", default="tiny")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--prompt-len", type=int, default=32)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    r = sub.add_parser("alrs", help="one ALRS allocation vs 100 training steps")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--size", default="60m")
    r.add_argument("--arch", default="asymloop")
    r.add_argument("--batch", type=int, default=1, help="micro-batch timed for the step estimate")
    r.add_argument("--seq", type=int, default=1024)
    r.add_argument("--tokens-per-step", type=int, default=512 * 1024, help="the paper: 512 sequences of 1024")
    r.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes (median)")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    r.add_argument("--no-ww-analyze", dest="ww_analyze", action="store_false", help="skip the weightwatcher reference")
    t = sub.add_parser("train", help="training step time of dense, full_loop K=2 and asymloop K=3 side by side")
    t.add_argument("--size", default="tiny", choices=["tiny", "60m", "135m", "350m", "1b"])
    t.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cuda, cuda:N, mps or cpu")
    t.add_argument("--dtype", default="auto", choices=DTYPES, help="autocast dtype; auto: what train_minimal.py's --dtype auto picks")
    t.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's micro-batch)")
    t.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    t.add_argument("--compile", action="store_true")
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--min-time", type=float, default=5.0, help="seconds of timed steps per architecture (at least 3 steps)")
    t.add_argument("--steps", type=int, default=20, help="at most this many timed steps per architecture")
    gp = sub.add_parser("gpu", help="a fresh GPU's self-check: versions, kernels, joint attention errors and speed, 60m training")
    gp.add_argument("--out", default=None, help="write the results as JSON to this path")
    gp.add_argument("--cache-dir", default="data_cache", help="where the stdlib BPE tokens are cached")
    gp.add_argument("--no-compile", action="store_true", help="time eager training steps instead of torch.compile")
    d = sub.add_parser("data", help="data preparation MB/s and tokens/s with 1 and 2 tokenizer workers")
    d.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    d.add_argument("--repeat", type=int, default=1, help="copies of the stdlib corpus in the parquet file")
    d.add_argument("--repeats", type=int, default=2, help="timed runs per worker count (best is shown)")
    d.add_argument("--vocab", type=int, default=8192)
    ad = sub.add_parser("adaptive", help="adaptive per-token depth vs fixed K: iterations, CE, chain-task exits by hops")
    ad.add_argument("--ckpt", default="out/tiny-asymloop-k3", help="a trained LM checkpoint ('none': chain task only)")
    ad.add_argument("--max-iter", type=int, default=6, help="K_max for the LM (may exceed the trained K)")
    ad.add_argument("--lm-windows", type=int, default=32, help="held-out windows of seq_len tokens scored")
    ad.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 3], help="chain-task asymloop_k3 seeds (none: skip)")
    ad.add_argument("--chain-weights", default=None, help="folder of asymloop_k3-s{seed}.safetensors (default: the committed)")
    ad.add_argument("--chain-max-iter", type=int, default=6, help="K_max on the chain task (trained K = 3)")
    ad.add_argument("--taus", type=float, nargs="+", default=None, help="exit thresholds (default: adaptive.TAUS)")
    ad.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ad.add_argument("--out", default=None, help="write the results as JSON to this path")
    lo = sub.add_parser("loss", help="chunked linear + cross-entropy vs fp32 logits: peak memory and time")
    lo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    lo.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (the 60m preset: 32 x 1024)")
    lo.add_argument("--d-model", type=int, default=768)
    lo.add_argument("--vocab", type=int, default=32128)
    lo.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: 2^27 logits / vocab)")
    lo.add_argument("--min-time", type=float, default=1.0)
    de = sub.add_parser("depth", help="peak training memory and step time vs --backprop-depth n at one K")
    for flag, kind, default in (("--size", str, "tiny"), ("--arch", str, "asymloop"), ("--k", int, 8), ("--batch", int, 8),
                                ("--seq", int, 128), ("--threads", int, 1), ("--min-time", float, 0.0)):
        de.add_argument(flag, type=kind, default=default)
    de.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    de.add_argument("--backprop-depths", type=int, nargs="+", default=[0, 8, 4, 2, 1], help="n values (0: every iteration)")
    de.add_argument("--samplers", action="store_true", help="instead: time per token of sampled K vs fixed K=3, side by side")
    de.add_argument("--steps", type=int, default=30, help="with --samplers: timed steps per recipe")
    args = p.parse_args(argv)
    if args.what == "depth":
        from minimal_asymloop import depth
        return depth.bench_samplers(args) if args.samplers else depth.bench(args)
    {"attention": bench_attention, "train": bench_train, "generate": bench_generate, "alrs": bench_alrs, "moe": bench_moe,
     "gpu": bench_gpu, "data": bench_data, "loss": bench_loss, "adaptive": bench_adaptive}[args.what](args)


if __name__ == "__main__":
    main()
