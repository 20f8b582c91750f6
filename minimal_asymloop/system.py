"""System plumbing for training and the benchmarks: errors, device and dtype, autocast and the fp16 loss scaler, MPS's
missing ops, signals, GPU peak FLOP/s for MFU, a device-synchronized timer, the optional wandb import, the out-dir
check, and the DDP lost-rank message. Not part of the method.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import sysconfig
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class ConfigError(ValueError):
    """A training setting that cannot work; the message names the fix."""


class DistributedError(RuntimeError):
    """DDP: another rank died or hung (a collective failed or passed ddp_timeout_s); the message says what to do."""


def lost_ranks_error(e: RuntimeError, rank: int, step: int, cfg) -> DistributedError | None:
    """A one-line DistributedError for a failed collective (gloo/NCCL), or None for any other RuntimeError."""
    text = " ".join(str(e).split())
    comm = ("gloo", "NCCL", "Timed out", "Connection reset", "Connection closed")
    if not (isinstance(e, dist.DistError) or any(k in text for k in comm)):
        return None
    why = next((k.lower() for k in ("Timed out", "Connection reset by peer", "Connection closed by peer") if k in text), text[:120])
    return DistributedError(f"rank {rank} lost contact with the other ranks at step {step} ({why}): one of them died or hung, see its "
                            f"log; the last checkpoint is {Path(cfg.out_dir) / 'latest'}, continue with --resume "
                            f"(--ddp-timeout-s, now {cfg.ddp_timeout_s}, bounds the wait)")


# Peak dense bf16 tensor FLOP/s per GPU (not the "with sparsity" figure, which is twice this), keyed by the exact name
# torch.cuda.get_device_name reports: PCIe and NVL cards are slower than SXM ones of the same chip. Sources:
PEAK_BF16_FLOPS = {
    # NVIDIA H100 Tensor Core GPU datasheet: SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOPS with sparsity
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    # NVIDIA H200 Tensor Core GPU datasheet: SXM 1,979 / NVL 1,671 TFLOPS with sparsity
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    # NVIDIA GH200 Grace Hopper Superchip datasheet: 1,979 TFLOPS with sparsity
    "NVIDIA GH200 480GB": 989e12,
    # NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS dense for SXM and PCIe, 40 and 80 GB
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    # NVIDIA L40S datasheet: 362.05 TFLOPS dense (733 with sparsity); L40 datasheet: 181.05; L4 datasheet: 121
    "NVIDIA L40S": 362.05e12,
    "NVIDIA L40": 181.05e12,
    "NVIDIA L4": 121e12,
    # NVIDIA A10 datasheet: 125 TFLOPS dense (250 with sparsity)
    "NVIDIA A10": 125e12,
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090) and Ampere GA102 whitepaper (RTX A6000, RTX 3090):
    # "peak BF16 Tensor TFLOPS with FP32 accumulate", which is what a bf16 matmul in PyTorch uses
    "NVIDIA GeForce RTX 4090": 165.2e12,
    "NVIDIA RTX A6000": 154.8e12,
    "NVIDIA GeForce RTX 3090": 71e12,
}


def gpu_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device` by its exact product name (PEAK_BF16_FLOPS), None for CPU or an unlisted GPU."""
    if torch.device(device).type != "cuda":
        return None
    return PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device).strip())


def peak_flops_or_reason(device: torch.device, say) -> float | None:
    peak = gpu_peak_flops(device)
    if peak is None and device.type == "cuda":
        say(f"MFU not logged: no peak bf16 FLOP/s is known for {torch.cuda.get_device_name(device)!r} "
            f"(add its datasheet's dense figure to PEAK_BF16_FLOPS in minimal_asymloop/system.py)")
    return peak


def synchronize(device: torch.device):
    """Wait for the GPU (CUDA or MPS) to finish its queued work, so that a timer reads the real time; nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timeit(fn, device, warmup=2, min_time=1.0, max_iters=50):
    """Median seconds per call of fn() after warmup."""
    sync = lambda: synchronize(device)
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


class _LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive, and their peak. A storage dies when
    its last tensor does, including the tensors autograd saves for backward, so this is what an allocator holds."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (key := id(s := t.untyped_storage())) not in self.seen:
                self.seen.add(key)
                self.live += s.nbytes()
                weakref.finalize(s, self._freed, key, s.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def peak_new_bytes(fn) -> int:
    """Peak bytes of the tensors fn() creates (on any device, CPU included) on top of those that exist before it."""
    with _LiveStorages() as mode:
        fn()
    return mode.peak


def wandb_module(cfg):
    """The wandb package when --wandb is on, else None; a one-line error when it is not installed."""
    if not cfg.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise ConfigError('--wandb needs the wandb package, an optional extra: pip install -e ".[wandb]"') from None
    return wandb


DEVICES = ("auto", "cuda", "mps", "cpu")  # and cuda:N
DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_device() -> str:
    """What --device auto picks: CUDA, then MPS (Apple silicon), then CPU."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def check_device_name(name: str):
    """A one-line ConfigError for a --device that names no device kind."""
    if name not in DEVICES and not re.fullmatch(r"cuda:\d+", name):
        raise ConfigError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} (or cuda:N for the N-th GPU)")


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch.device for --device `name` on this machine (auto: CUDA, then MPS, then CPU), or a one-line ConfigError."""
    check_device_name(name)
    kind = default_device() if name == "auto" else name
    if kind.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for, but CUDA is not available; use --device auto (here: {default_device()})")
    if kind == "mps" and not torch.backends.mps.is_available():
        why = "needs Apple silicon and macOS 12.3 or newer" if torch.backends.mps.is_built() else "this PyTorch build has no MPS"
        raise ConfigError(f"--device mps asked for, but MPS is not available ({why}); use --device auto (here: {default_device()})")
    return torch.device(f"cuda:{local_rank}" if kind == "cuda" else kind)


def resolve_device(cfg, local_rank: int) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) for cfg.device and cfg.dtype on this machine, or a one-line ConfigError naming the fix."""
    device = pick_device(cfg.device, local_rank)
    return device, resolve_dtype(cfg.dtype, device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: auto -> bfloat16 on a CUDA GPU that has it (compute capability >= 8.0), float16 with loss
    scaling on one that does not (T4, V100), float32 on CPU and MPS."""
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 is slow
    if name == "auto":
        # (ours) float32 on MPS: PyTorch's MPS autocast and GradScaler are recent and vary with the macOS version
        name = ("bfloat16" if bf16 else "float16") if device.type == "cuda" else "float32"
    if name == "bfloat16" and device.type == "cuda" and not bf16:
        raise ConfigError(f"this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16 arithmetic (it needs compute capability "
                          f">= 8.0); use --dtype float16, which trains with loss scaling, or --dtype auto")
    return getattr(torch, name)


def autocast_context(device, dtype):
    """torch.autocast in bf16 or fp16; nothing for float32."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=dtype) if dtype in (torch.bfloat16, torch.float16) else nullcontext()


def grad_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """fp16's loss scaler: it multiplies the loss before backward, so that small gradients do not flush to zero in fp16, and
    skips a step whose gradients overflowed (then halves the scale). For bf16 and fp32 a disabled one: every call passes through."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def mps_error(e: BaseException) -> ConfigError | None:
    """One line for an op or dtype that PyTorch's MPS backend lacks, naming the fix; None for any other error."""
    text = " ".join(str(e).split())
    if "MPS" not in text:
        return None
    if isinstance(e, NotImplementedError) or "not currently implemented" in text:
        op = re.search(r"operator '([^']+)'", text)
        return ConfigError(f"PyTorch {torch.__version__} has no MPS kernel for {op.group(1) if op else 'an operator this run uses'}; "
                           f"rerun with PYTORCH_ENABLE_MPS_FALLBACK=1 (that op then runs on the CPU) or use --device cpu")
    if any(k in text.lower() for k in ("dtype", "float64", "bfloat16", "float16", "half")):
        return ConfigError(f"the MPS backend cannot run a dtype this run uses ({text[:160]}); use --dtype float32")
    return None


@contextmanager
def stop_on_signals(flag: dict):
    """SIGINT/SIGTERM set flag['signal']; the loop then checkpoints and returns. A second Ctrl-C aborts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if flag.get("signal") and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_out_dir(out_dir: Path):
    """Fail now, not at the first checkpoint hours later, if out_dir cannot be created or written."""
    probe = out_dir / f".write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to --out-dir {out_dir} ({e.strerror or e}); choose a writable --out-dir") from None


# ----------------------------------------------------------------------------- can torch.compile build here?


def triton_c_compiler() -> str | None:
    """The C compiler Triton builds its kernel launchers with, as triton/runtime/build.py finds it: $CC if set,
    else gcc, else clang on PATH. None: there is none."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def python_include_dir() -> Path:
    """Where Triton looks for Python.h: sysconfig's include path (Debian's posix_local scheme read as posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    return Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])


def compile_preflight() -> str | None:
    """Why torch.compile's CUDA backend (inductor, through Triton) cannot build kernels on this machine, or None when it
    can. Triton compiles a small C launcher per kernel, with a C compiler and the Python headers; slim GPU images
    often have neither, and without this check the first compiled step would fail minutes into a run."""
    missing = []
    if triton_c_compiler() is None:
        cc = os.environ.get("CC")
        missing.append(f"no C compiler ({f'$CC={cc} is not on PATH' if cc else 'no gcc or clang on PATH'})")
    if not (python_include_dir() / "Python.h").exists():
        missing.append(f"no Python headers (no Python.h in {python_include_dir()})")
    if not missing:
        return None
    dev = f"python{sys.version_info.major}.{sys.version_info.minor}-dev"
    return (f"torch.compile cannot build GPU kernels here: {' and '.join(missing)}; install them (Debian/Ubuntu: "
            f"`apt-get install build-essential python3-dev`, or {dev} for a Python that is not the system's; conda: "
            f"`conda install -c conda-forge gcc`), or run with --compile false")


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


# ----------------------------------------------------------------------------- RNG state and the process group


def rng_state(device: torch.device) -> dict:
    """This process's RNG: CPU, and the current CUDA device's (not every visible GPU's, so that a checkpoint
    resumes on any number of GPUs, or on CPU) or MPS's. Every rank seeds alike and draws alike, so rank 0's is every rank's."""
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                mps=torch.mps.get_rng_state() if device.type == "mps" else None)


def restore_rng(rng: dict, device: torch.device):
    """Set the RNG from rng_state(): the GPU part only on that kind of device (a CPU resume has no GPU generator to set)."""
    torch.set_rng_state(rng["torch"])
    cuda = rng.get("cuda")
    if isinstance(cuda, (list, tuple)):  # older checkpoints: rank 0's state of every visible GPU; rank 0 ran on the first
        cuda = cuda[0] if cuda else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    if rng.get("mps") is not None and device.type == "mps":
        torch.mps.set_rng_state(rng["mps"])


def init_process_group(device: torch.device, timeout_s: int):
    """NCCL on CUDA, bound to this rank's GPU (device_id: NCCL connects at once, not at the first collective), else gloo."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
