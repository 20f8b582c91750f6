"""`python -m minimal_asymloop.bench gpu`: the self-check for a fresh GPU, <= 8 minutes on one H100.

Sections, each independent (one failing is reported and the rest still run), in this order: versions; 60m training
tokens/s, MFU, peak memory and compile time against the targets, AsymLoop K=3 first (the row the targets are judged
on, with its own time budget), then AsymLoop K=3 eager, dense and Full Loop; the fused kernel behind each attention
call; error and time of each joint attention implementation against causal flash; cached generation in bf16. A row or
section that would overrun the time budget is skipped, and the JSON says which and why. `gpu_report(..., "tiny")` runs
every section on CPU in seconds, for the tests.
"""

import datetime
import json
import math
import platform
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minimal_asymloop import kernels
from minimal_asymloop.flops import flops_per_token
from minimal_asymloop.generate import KVCache
from minimal_asymloop.model import (
    LoopedLM,
    ModelConfig,
    attention_after_prefix,
    causal_attention,
    joint_attention,
    joint_attention_flash,
    joint_attention_masked,
    joint_attention_reference,
)
from minimal_asymloop.system import compile_preflight, gpu_peak_flops, timeit

# (ours) "full": the <= 8-minute check on one H100/H200; "tiny": every section in seconds, for tests on CPU.
# budget_s: the whole report; later training rows and sections start only if the time they need (reserve_s, or for a
# compiled training row the compile time AsymLoop K=3 took) is left. AsymLoop K=3 runs first and always.
GPU_SCALES = {
    "full": dict(attn=(8, 6, 1024, 128), size="60m", batch=32, seq=1024, prompt=256, new_tokens=16,
                 data_tokens=2_000_000, bpe_vocab=8192, min_time=4.0, max_steps=20, budget_s=450, model={},
                 reserve_s=dict(sdpa_backends=15, joint_attention=90, generation=20)),
    "tiny": dict(attn=(2, 2, 64, 16), size="tiny", batch=2, seq=64, prompt=16, new_tokens=4,
                 data_tokens=100_000, bpe_vocab=512, min_time=0.0, max_steps=3, budget_s=600,
                 model=dict(n_layer=2, d_model=64, n_head=2, d_ff=128, vocab_size=512),
                 reserve_s=dict(sdpa_backends=0, joint_attention=0, generation=0)),
}
SDPA_BACKENDS = {  # aten op -> backend; no fused op at all means PyTorch's unfused math path
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
}
TOL_BF16 = 3e-2  # (ours) max |error| / max |reference| of a bf16 kernel against the fp32 reference


class _AttentionOps(TorchDispatchMode):
    """Records the fused attention ops that run (below autograd, so backward ops too)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "attention" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def sdpa_backend(fn, *xs, backward=True) -> dict:
    """Which fused attention kernel fn(*xs) runs, forward (and backward): {"backend", "ops"}."""
    with _AttentionOps() as rec:
        out = fn(*xs)
        if backward:
            torch.autograd.backward(out, torch.ones_like(out))
    forward = [op for op in rec.ops if not op.endswith("_backward")]
    backends = sorted({SDPA_BACKENDS.get(op, op.removeprefix("aten::")) for op in forward}) or ["math (unfused)"]
    return dict(backend=" + ".join(backends), ops=rec.ops)


def _inputs(shape, device, dtype, n=5, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(n)]


def _rel_err(a, ref) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def gpu_versions(device) -> dict:
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                    flash_available=torch.backends.cuda.is_flash_attention_available())
    else:
        info.update(gpu=None, cpu_threads=torch.get_num_threads())
    return info


def gpu_sdpa_backends(device, dtype, shape) -> dict:
    """The kernel behind each attention call of the model, at the training shape (decoding: 1 and 8 new tokens)."""
    b, h, n, hd = shape
    q, kg, vg, kl, vl = _inputs(shape, device, dtype)
    q1, q8 = (torch.randn(b, h, m, hd, device=device, dtype=dtype) for m in (1, 8))
    impl = kernels.joint_attention_impl(device.type, device.index, dtype, hd)
    def after(qm):  # queries after a cached prefix: Global and Local keys under one softmax
        return attention_after_prefix(qm, [(kg, vg), (kl, vl)])

    calls = {
        "causal_attention (encoder, dense, full loop)": sdpa_backend(causal_attention, q, kl, vl),
        f"joint_attention (decoder; chooses {impl!r})": sdpa_backend(joint_attention, q, kg, vg, kl, vl),
        "joint_attention_flash (2 causal calls + LSE merge)": sdpa_backend(joint_attention_flash, q, kg, vg, kl, vl),
        "joint_attention_masked (fallback: (N, 2N) bool mask)": sdpa_backend(joint_attention_masked, q, kg, vg, kl, vl),
        "attention_after_prefix, 1 new token (decoding)": sdpa_backend(after, q1, backward=False),
        "attention_after_prefix, 8 new tokens (bool mask)": sdpa_backend(after, q8, backward=False),
    }
    return dict(joint_attention_impl=impl, calls=calls)


def causal_flash_only(q, k, v):
    """Causal attention through the flash SDPA kernel alone (the kernel `joint_attention_flash` calls twice)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return causal_attention(q, k, v)


def gpu_joint_attention(device, dtype, shape, compile_flex: bool, min_time: float = 1.0) -> dict:
    """Each implementation in `dtype` against the fp32 reference (forward and all five gradients), and its
    forward+backward time against one causal flash call over N keys."""
    x32 = _inputs(shape, device, torch.float32)
    d_out = torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    ref = joint_attention_reference(*x32)
    ref_grads = torch.autograd.grad(ref, x32, d_out)
    xs = [x.detach().to(dtype).requires_grad_() for x in x32]
    d_out_lp = d_out.to(dtype)
    flex_backward = device.type == "cuda"  # FlexAttention has no backward on CPU
    flex = torch.compile(kernels.joint_attention_flex, fullgraph=True) if compile_flex else kernels.joint_attention_flex
    impls = {"flash": (joint_attention_flash, True), "flex": (flex, flex_backward), "masked": (joint_attention_masked, True)}

    def fwd_bwd(fn, args, backward=True):
        def run():
            out = fn(*args)
            if backward:
                torch.autograd.backward(out, d_out_lp)
        return run

    t_causal = timeit(fwd_bwd(causal_attention, [xs[0], xs[3], xs[4]]), device, min_time=min_time)
    t_flash = timeit(fwd_bwd(causal_flash_only, [xs[0], xs[3], xs[4]]), device, min_time=min_time)  # SDPA may pick cuDNN
    rows = {}
    for name, (fn, backward) in impls.items():
        args = xs if backward else [x.detach() for x in xs]
        try:  # one implementation failing (e.g. flex not compiling) still leaves the others' figures
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                out = fn(*args)  # compiles flex
                err = {"out": _rel_err(out, ref)}
                if backward:
                    grads = torch.autograd.grad(out, args, d_out_lp)
                    err.update({k: _rel_err(g, r) for k, g, r in zip(("dq", "dk_glob", "dv_glob", "dk_loc", "dv_loc"), grads, ref_grads)})
                first_s = time.perf_counter() - t0
                t = timeit(fwd_bwd(fn, args, backward), device, min_time=min_time)
        except Exception as e:
            rows[name] = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            continue
        rows[name] = dict(max_rel_err=err, ok=max(err.values()) <= TOL_BF16, ms=t * 1e3, vs_causal=t / t_causal,
                          vs_causal_flash=t / t_flash, timed="forward+backward" if backward else "forward only", first_call_s=first_s)
    return dict(shape=list(shape), dtype=str(dtype).removeprefix("torch."), causal_ms=t_causal * 1e3,
                causal_flash_ms=t_flash * 1e3, flex_compiled=compile_flex,
                impls=rows, tolerance=TOL_BF16, target_vs_causal=2.2)


def gpu_generation(device, dtype, cfg, prompt: int, new: int) -> dict:
    """Cached generation (prefill, then one token at a time) against one full forward, in `dtype` autocast."""
    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, prompt + new), device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        full = model(idx)[0].float()  # (1, T, V)
        cache = KVCache()
        steps = [idx[:, :prompt]] + [idx[:, t:t + 1] for t in range(prompt, prompt + new)]
        cached = torch.cat([model.logits(model.states(s, cache=cache)[-1]) for s in steps], dim=1).float()
    err = _rel_err(cached, full)
    same = (cached.argmax(-1) == full.argmax(-1)).float().mean().item()
    return dict(arch=cfg.arch, n_iter=cfg.n_iter, prompt=prompt, new_tokens=new, max_rel_err=err, argmax_agreement=same,
                ok=err <= TOL_BF16)


def _bench_tokens(cache_dir, n_tokens: int, bpe_vocab: int):
    """Real text without the network or `datasets`: the Python stdlib corpus, BPE-tokenized and cached."""
    from minimal_asymloop.data import prepare

    t0 = time.perf_counter()
    data = prepare(source="stdlib", tokenizer="bpe", bpe_vocab=bpe_vocab, cache_dir=cache_dir, max_tokens=n_tokens,
                   val_fraction=0.2, quiet=True)  # (ours) the val split is unused here; 20% keeps it non-empty at tiny sizes
    return data, time.perf_counter() - t0


def gpu_train_row(cfg, x, device, dtype, compile_backend, min_time, max_steps) -> dict:
    """One architecture's optimizer steps (forward, backward, fused AdamW on CUDA) on the batch x (B, N+1)."""
    from minimal_asymloop.optim import param_groups

    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_model = torch.compile(model, backend=compile_backend) if compile_backend else model
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = []

    def step():
        with torch.autocast(device.type, dtype=dtype):
            _, loss = step_model(x[:, :-1], x[:, 1:], return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()  # compiles
    sync()
    first = time.perf_counter() - t0
    t = timeit(step, device, warmup=1, min_time=min_time, max_iters=max_steps)
    batch, seq = x.size(0), x.size(1) - 1
    flops = 3 * flops_per_token(cfg, seq)["total"]  # training ~ 3x forward (the paper's Appendix D)
    peak = gpu_peak_flops(device)
    row = dict(arch=cfg.arch, n_iter=cfg.n_iter, compile=compile_backend, effective_depth=cfg.effective_depth, step_ms=t * 1e3,
               tokens_per_s=batch * seq / t, tflops=flops * batch * seq / t / 1e12, flops_per_token=flops,
               mfu=flops * batch * seq / t / peak if peak else None, compile_s=max(first - t, 0.0) if compile_backend else None,
               first_step_s=first,
               peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               last_loss=losses[-1].item())
    if not math.isfinite(row["last_loss"]):
        raise FloatingPointError(f"{cfg.arch} training loss is {row['last_loss']}")
    return row


def training_rows(compile_backend) -> list[tuple[str, str, int, str | None]]:
    """(name, arch, K, compile backend) in the order they run: AsymLoop K=3 first, then its eager twin (when compiled)."""
    rows = [("asymloop K=3", "asymloop", 3, compile_backend)]
    if compile_backend:
        rows.append(("asymloop K=3 eager", "asymloop", 3, None))
    return rows + [("dense K=1", "dense", 1, compile_backend), ("full_loop K=2", "full_loop", 2, compile_backend)]


def gpu_training(device, dtype, sc, compile_backend, cache_dir, deadline, say, no_compile_why=None) -> dict:
    """The training rows; AsymLoop K=3 always runs, a later row only if the time it needs is left before `deadline`
    (a compiled row needs about the compile time the first row took). no_compile_why: why compiled rows cannot run."""
    data, prep_s = _bench_tokens(cache_dir, sc["data_tokens"], sc["bpe_vocab"])
    say(f"  data: stdlib corpus, BPE vocab {data.vocab_size}, {len(data.train):,} train tokens, prepared/loaded in {prep_s:.1f}s")
    batch, seq = sc["batch"], sc["seq"]
    x = torch.from_numpy(data.train.window(0, batch * (seq + 1))).view(batch, seq + 1).to(device)
    rows, first_s = {}, {}  # first_s[compiled?]: the first such row's first step
    for name, arch, k, backend in training_rows(compile_backend):
        need = first_s.get(backend is not None, 0.0) + sc["min_time"]  # the first row's first step (compile) + timing
        left = deadline - time.perf_counter()
        if backend and no_compile_why:
            why = no_compile_why
        elif rows and need > left:
            why = f"time budget: {max(left, 0):.0f}s left, this row needs about {need:.0f}s"
        else:
            why = None
        if why:
            rows[name] = dict(arch=arch, n_iter=k, compile=backend, skipped=why)
            say(f"  {name}: skipped ({why})")
            continue
        cfg = ModelConfig.from_preset(sc["size"], arch, n_iter=k, max_seq_len=max(seq, 64), **sc["model"])
        row = gpu_train_row(cfg, x, device, dtype, backend, sc["min_time"], sc["max_steps"])
        first_s.setdefault(backend is not None, row["first_step_s"])
        rows[name] = row
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        mem = f"{row['peak_mem_gib']:.1f} GiB" if row["peak_mem_gib"] is not None else "n/a"
        comp = f"{row['compile_s']:.0f}s" if row["compile_s"] is not None else "off"
        say(f"  {name:<18} {row['step_ms']:8.1f} ms/step {row['tokens_per_s']:>11,.0f} tok/s  MFU {mfu:>6}  "
            f"peak {mem:>9}  compile {comp:>5}  loss {row['last_loss']:.2f}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dense = rows.get("dense K=1", {})
    for row in rows.values():  # FLOP-normalized step time against dense with the same compile setting
        base = dense if "skipped" not in dense and row.get("compile") == dense.get("compile") else None
        if "skipped" not in row and base:
            row["flop_normalized_vs_dense"] = (row["step_ms"] / base["step_ms"]) / (row["flops_per_token"] / base["flops_per_token"])
    return dict(size=sc["size"], batch=batch, seq=seq, dtype=str(dtype).removeprefix("torch."), compile=compile_backend,
                data_prepare_s=prep_s, rows=rows, skipped={n: r["skipped"] for n, r in rows.items() if "skipped" in r},
                targets=dict(asymloop_tokens_per_s=400_000, asymloop_mfu=0.40))


def gpu_report(device, scale="full", compile_backend="inductor", cache_dir="data_cache", out=None, say=print) -> dict:
    """Every `bench gpu` section at `scale` on `device`; a failing section is reported and the rest still run."""
    device, sc, dtype = torch.device(device), GPU_SCALES[scale], torch.bfloat16
    start = time.perf_counter()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    model_cfg = ModelConfig.from_preset(sc["size"], "asymloop", max_seq_len=max(sc["seq"], 64), **sc["model"])
    # a GPU without a C compiler or Python headers cannot compile: the compiled rows say so, the eager ones still run
    no_compile = compile_preflight() if device.type == "cuda" and compile_backend == "inductor" else None
    end, reserve = start + sc["budget_s"], sc["reserve_s"]
    sections = {
        "versions": lambda: gpu_versions(device),
        "training": lambda: gpu_training(device, dtype, sc, compile_backend, cache_dir, end - sum(reserve.values()), say, no_compile),
        "sdpa_backends": lambda: gpu_sdpa_backends(device, dtype, sc["attn"]),
        "joint_attention": lambda: gpu_joint_attention(device, dtype, sc["attn"],
                                                       compile_backend is not None and device.type == "cuda" and not no_compile,
                                                       max(sc["min_time"], 0.2)),
        "generation": lambda: gpu_generation(device, dtype, model_cfg, sc["prompt"], sc["new_tokens"]),
    }
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), scale=scale, failed=[],
                  skipped={}, compile_preflight=no_compile or "ok", budget_s=sc["budget_s"])
    for name, run in sections.items():
        say(f"[{name}]")
        left = end - time.perf_counter()
        if name in reserve and left < reserve[name]:  # versions and training (AsymLoop K=3 at least) always run
            report["skipped"][name] = f"time budget: {max(left, 0):.0f}s left of {sc['budget_s']}s, this section needs {reserve[name]}s"
            say(f"  skipped ({report['skipped'][name]})")
            continue
        t0 = time.perf_counter()
        try:  # (ours) one broken section must not cost the rest of a short GPU session
            report[name] = run()
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            _say_section(name, report[name], say)
        except Exception as e:
            report[name] = {**report.get(name, {}), "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}",
                            "seconds": round(time.perf_counter() - t0, 1)}
            report["failed"].append(name)
            say(f"  FAILED: {report[name]['error']}")
        if out:
            Path(out).write_text(json.dumps(report, indent=1, default=str))
    report["skipped"].update({f"training: {row}": why for row, why in report.get("training", {}).get("skipped", {}).items()})
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    if out:
        Path(out).write_text(json.dumps(report, indent=1, default=str))
    return report


def _say_section(name, r, say):
    if "error" in r:
        return
    if name == "versions":
        say(f"  GPU {r['gpu']} (capability {r.get('capability')}, {r.get('memory_gib')} GiB), torch {r['torch']}, "
            f"CUDA {r['cuda']}, cuDNN {r['cudnn']}, Python {r['python']}")
    elif name == "sdpa_backends":
        for call, c in r["calls"].items():
            say(f"  {call:<56} {c['backend']}")
    elif name == "joint_attention":
        say(f"  B,H,N,hd = {r['shape']}, {r['dtype']}; causal SDPA forward+backward {r['causal_ms']:.2f} ms (the flash kernel "
            f"alone {r['causal_flash_ms']:.2f} ms); max |err| / max |fp32 reference| (tolerance {r['tolerance']})")
        for impl, row in r["impls"].items():
            if "error" in row:
                say(f"  {impl:<7} FAILED: {row['error']}")
                continue
            errs = " ".join(f"{k} {v:.1e}" for k, v in row["max_rel_err"].items())
            say(f"  {impl:<7} {'ok' if row['ok'] else 'ERROR TOO LARGE':<6} {errs}  {row['ms']:.2f} ms = "
                f"{row['vs_causal']:.2f}x causal SDPA, {row['vs_causal_flash']:.2f}x causal flash "
                f"({row['timed']}; target <= {r['target_vs_causal']})")
        if r["flex_compiled"] and "first_call_s" in r["impls"]["flex"]:
            say(f"  flex: torch.compile'd, first call (compile) {r['impls']['flex']['first_call_s']:.1f}s")
    elif name == "generation":
        say(f"  {r['arch']} K={r['n_iter']}, prompt {r['prompt']} + {r['new_tokens']} cached steps vs one full forward: "
            f"max rel. logit error {r['max_rel_err']:.1e}, argmax agreement {r['argmax_agreement']:.1%}: {'ok' if r['ok'] else 'MISMATCH'}")
    elif name == "training":
        asym, eager = r["rows"].get("asymloop K=3", {}), r["rows"].get("asymloop K=3 eager", {})
        norm = [f"{n} {row['flop_normalized_vs_dense']:.3f}" for n, row in r["rows"].items() if "flop_normalized_vs_dense" in row]
        if norm:
            say(f"  FLOP-normalized step time vs dense (1.0: looping costs nothing beyond its FLOPs): {', '.join(norm)}")
        if "step_ms" in asym and "step_ms" in eager:
            say(f"  AsymLoop K=3 compiled: {eager['step_ms'] / asym['step_ms']:.2f}x the eager step's speed")
        if asym.get("mfu") is not None:
            t = r["targets"]
            met = asym["tokens_per_s"] >= t["asymloop_tokens_per_s"] and asym["mfu"] >= t["asymloop_mfu"]
            say(f"  targets (AsymLoop K=3: >= 400K tok/s and MFU >= 40%; the paper: 303K tok/s per GPU): {'met' if met else 'NOT met'}")
    say(f"  ({r['seconds']}s)")


def bench_gpu(args):
    """The self-check for a fresh GPU; one line and exit status 1 without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit("bench gpu needs a CUDA GPU, and torch.cuda.is_available() is False here; "
                         "on CPU run `python -m minimal_asymloop.bench train --size tiny` instead")
    report = gpu_report(torch.device("cuda"), "full", None if args.no_compile else "inductor", args.cache_dir, args.out)
    print(f"done in {report['total_seconds']:.0f}s" + (f"; results in {args.out}" if args.out else ""))
    if report["failed"]:
        raise SystemExit(f"bench gpu: these sections failed: {', '.join(report['failed'])} (see above)")
