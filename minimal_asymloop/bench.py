"""Benchmarks that print figures (never timed unit tests).

    python -m minimal_asymloop.bench attention      # joint attention paths vs causal SDPA
    python -m minimal_asymloop.bench train --size tiny   # training step: dense vs full_loop K=2 vs asymloop K=3
"""

import argparse
import time
from contextlib import nullcontext

import torch

from minimal_asymloop.model import (
    LoopedLM,
    ModelConfig,
    causal_attention,
    flops_per_token,
    joint_attention,
    joint_attention_masked,
    joint_attention_reference,
)


def timeit(fn, device, warmup=2, min_time=1.0, max_iters=50):
    """Median seconds per call of fn() after warmup."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


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
        }
        t = {name: timeit(fn, device) for name, fn in paths.items()}
        for name, s in t.items():
            print(f"{n:>5} {name:<28} {s * 1e3:>9.1f} {s / t['reference (naive)']:>13.2f} "
                  f"{s / t['causal SDPA over N keys']:>15.2f}")
    print("floor for fast/causal-SDPA is about 2 (twice the keys); target <= 2.3 at N=1024")


def time_train_step(cfg, batch, seq, device, dtype, args) -> float:
    """Median seconds of one optimizer step (forward, backward, AdamW) on random tokens."""
    from minimal_asymloop.trainer import param_groups

    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_model = torch.compile(model) if args.compile else model
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    ctx = torch.autocast(device.type, dtype=dtype) if dtype == torch.bfloat16 else nullcontext()

    def step():
        with ctx:
            _, loss = step_model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timeit(step, device, warmup=args.warmup, min_time=args.min_time, max_iters=args.steps)


def bench_train(args):
    """Timed optimizer steps (forward, backward, AdamW) of the three architectures at one size, side by side."""
    from minimal_asymloop.trainer import TRAIN_PRESETS, gpu_peak_flops

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
        t = time_train_step(cfg, batch, seq, device, dtype, args)
        flops = 3 * flops_per_token(cfg, seq)["total"]  # training ~ 3x forward (DESIGN.md §3)
        results[arch] = (t, flops)
        ratio = (t / results["dense"][0]) / (flops / results["dense"][1])
        achieved = flops * batch * seq / t
        mfu = f" {achieved / peak:>6.1%}" if peak else ""
        print(f"{arch:<10} {k:>2} {cfg.effective_depth:>5} {t * 1e3:>9.1f} {batch * seq / t:>10,.0f} {flops / 1e9:>10.3f} "
              f"{achieved / 1e12:>8.3f}{mfu} {ratio:>20.3f}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("FLOP-normalized ratio = (t_arch / t_dense) / (F_arch / F_dense): 1.0 means looping and joint attention cost "
          "nothing beyond their arithmetic; target <= 1.15")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention", help="joint attention paths vs causal SDPA")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    t = sub.add_parser("train", help="training step time of dense, full_loop K=2 and asymloop K=3 side by side")
    t.add_argument("--size", default="tiny", choices=["tiny", "60m", "135m", "350m", "1b"])
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's micro-batch)")
    t.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    t.add_argument("--compile", action="store_true")
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--min-time", type=float, default=5.0, help="seconds of timed steps per architecture (at least 3 steps)")
    t.add_argument("--steps", type=int, default=20, help="at most this many timed steps per architecture")
    args = p.parse_args(argv)
    {"attention": bench_attention, "train": bench_train}[args.what](args)


if __name__ == "__main__":
    main()
