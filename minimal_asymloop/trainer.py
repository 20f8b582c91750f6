"""Training: presets, the loop (one process or DDP under torchrun), evaluation, metrics, resume.

`train(model_cfg, train_cfg)` is the whole job and works from a notebook; `train_minimal.py` is a
thin nanoGPT-style command line over it. Settings: the paper's training setup; choices it leaves open are marked (ours).
"""

import json
import math
import os
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from minimal_asymloop import alrs
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.data import SHARD_TOKENS, BatchSampler, Tokens, eval_windows, prepare
from minimal_asymloop.model import LoopedLM, ModelConfig, count_params, flops_per_token


class ConfigError(ValueError):
    """A training setting that cannot work; the message names the fix."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became inf/NaN; the run stopped before applying that update."""


class DistributedError(RuntimeError):
    """DDP: another rank died or hung (a collective failed or passed ddp_timeout_s); the message says what to do."""


def _lost_ranks(e: RuntimeError, rank: int, step: int, cfg: "TrainConfig") -> DistributedError | None:
    """A one-line DistributedError for a failed collective (gloo/NCCL), or None for any other RuntimeError."""
    text = " ".join(str(e).split())
    comm = ("gloo", "NCCL", "Timed out", "Connection reset", "Connection closed")
    if not (isinstance(e, dist.DistError) or any(k in text for k in comm)):
        return None
    why = next((k.lower() for k in ("Timed out", "Connection reset by peer", "Connection closed by peer") if k in text), text[:120])
    return DistributedError(f"rank {rank} lost contact with the other ranks at step {step} ({why}): one of them died or hung, see its "
                            f"log; the last checkpoint is {Path(cfg.out_dir) / 'latest'}, continue with --resume "
                            f"(--ddp-timeout-s, now {cfg.ddp_timeout_s}, bounds the wait)")


# ----------------------------------------------------------------------------- config and presets


@dataclass
class TrainConfig:
    # data
    data: str = "stdlib"  # stdlib | fineweb-edu[:config] | a path or glob of .txt/.jsonl/.parquet
    tokenizer: str = "bpe"  # bpe (trained on the data) | t5
    bpe_vocab: int | None = None  # None -> the model's vocab_size
    data_cache: str = "data_cache"
    max_data_tokens: int | None = None  # cap on train tokens read from the source; None: all (fineweb-edu: the budget)
    val_fraction: float | None = None  # None -> 5% of documents (0.5% for fineweb-edu), by hash
    # batch and budget
    seq_len: int = 1024
    global_batch: int = 512  # sequences per optimizer step, summed over ranks
    micro_batch: int | None = None  # sequences per forward pass per rank; None -> global_batch / world_size
    tokens: int | None = None  # training budget; total steps = tokens / (global_batch * seq_len)
    max_steps: int | None = None  # total steps (overrides tokens); the LR schedule ends here
    stop_step: int | None = None  # stop early at this step with a checkpoint; --resume continues the same schedule
    # optimizer and schedule (the paper's)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to 0.1x peak
    warmup_frac: float = 0.1  # linear warmup over the first 10% of steps
    weight_decay: float = 0.1  # matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # evaluation and checkpoints (a checkpoint is written at every eval)
    eval_interval: int = 250
    eval_batches: int = 8  # fixed val batches of global_batch sequences, the same for any micro_batch or world size
    # system
    out_dir: str = "out"
    device: str = "auto"  # auto -> cuda if available, else cpu
    dtype: str = "auto"  # auto -> bfloat16 on CUDA, float32 elsewhere
    compile: bool = False
    seed: int = 1337
    resume: bool = False
    quiet: bool = False  # no prints, no progress bar (notebooks)
    ddp_timeout_s: int = 600  # a rank that dies makes the others fail after this, never hang (ours)
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is inf/NaN (counted, logged) instead of stopping
    # ALRS layerwise learning rates (He et al. 2026; alrs.py); --no-alrs and --alrs-range LO HI also work
    alrs: bool | None = None  # None -> on for asymloop, off for dense and full_loop (as in the paper)
    alrs_fit: str = "ww"  # ww: weightwatcher's fit (xmin by KS distance) | hill_median: the reference code's
    alrs_lo: float = 1.0  # multipliers run from lo (smallest alpha) to hi (largest alpha)
    alrs_hi: float = 5.0
    alrs_every: int = 100  # steps between allocations
    alrs_phase: float = 0.2  # allocate while step <= phase * total steps, then freeze
    alrs_ramp: int = 50  # steps of linear transition to each new allocation

    def __post_init__(self):
        for name in ("seq_len", "global_batch", "eval_interval", "eval_batches", "ddp_timeout_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("micro_batch", "tokens", "max_steps", "stop_step", "bpe_vocab", "max_data_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of float32, bfloat16 (or auto)")
        if self.tokenizer not in ("bpe", "t5"):
            raise ConfigError(f"unknown tokenizer {self.tokenizer!r}; choose one of bpe, t5")
        if self.max_steps is None and self.tokens is None:
            raise ConfigError("no training budget: set --max-steps or --tokens")
        alrs_hook(self)  # checks the ALRS settings now, with a clear error, even when ALRS is off

    def total_steps(self) -> int:
        return self.max_steps or math.ceil(self.tokens / (self.global_batch * self.seq_len))

    @classmethod
    def from_preset(cls, size: str, **overrides) -> "TrainConfig":
        if size not in TRAIN_PRESETS:
            raise ConfigError(f"unknown size {size!r}; choose one of {', '.join(TRAIN_PRESETS)}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s) {unknown}; valid fields: {', '.join(sorted(names))}")
        preset = dict(TRAIN_PRESETS[size])
        if "max_steps" in overrides or "tokens" in overrides:  # an explicit budget replaces the preset's
            preset.pop("max_steps", None), preset.pop("tokens", None)
        return cls(**{**preset, **overrides})


_PAPER = dict(data="fineweb-edu", tokenizer="t5", seq_len=1024, global_batch=512, lr=1e-3)
TRAIN_PRESETS = {
    # (ours) sized for a 2-core CPU: data prep + training + evals in <= 5 minutes, see docs/training.md. ALRS off:
    # its 1-5x multipliers on this LR overshoot at 200 steps (docs/training.md); --alrs true turns it on
    "tiny": dict(data="stdlib", tokenizer="bpe", seq_len=128, global_batch=16, max_steps=200,
                 lr=3e-3, eval_interval=50, eval_batches=8, alrs=False),
    # the paper's settings; micro_batch (ours) fits an 80 GB GPU in bf16, lower it on smaller GPUs
    "60m": dict(_PAPER, tokens=1_680_000_000, micro_batch=32, eval_interval=250),
    "135m": dict(_PAPER, tokens=3_000_000_000, micro_batch=32, eval_interval=250),
    "350m": dict(_PAPER, tokens=7_000_000_000, micro_batch=16, eval_interval=500),
    "1b": dict(_PAPER, tokens=20_000_000_000, micro_batch=8, eval_interval=500),
    # (ours) the paper's Appendix G gives no budget for its OLMo-style model; 60m's, a model of similar size
    "olmo8": dict(_PAPER, tokens=1_680_000_000, micro_batch=32, eval_interval=250),
}
# settings that may change on --resume without changing the result (or only its speed)
RESUME_MAY_CHANGE = {"out_dir", "device", "compile", "stop_step", "quiet", "resume", "eval_interval", "eval_batches",
                     "micro_batch", "ddp_timeout_s", "data_cache", "skip_nonfinite"}
NAN_ENV = "MINIMAL_ASYMLOOP_NAN_STEPS"  # test hook: comma-separated steps (1-based) whose loss is made NaN


# ----------------------------------------------------------------------------- optimizer and schedule


def make_alrs(cfg: TrainConfig, arch: str) -> alrs.ALRS | None:
    """The ALRS lr_hook for this run, or None: on by default for asymloop only (as in the paper)."""
    return alrs_hook(cfg) if (cfg.alrs if cfg.alrs is not None else arch == "asymloop") else None


def alrs_hook(cfg: TrainConfig) -> alrs.ALRS:
    try:
        return alrs.ALRS(cfg.total_steps(), cfg.alrs_fit, cfg.alrs_lo, cfg.alrs_hi, cfg.alrs_every, cfg.alrs_phase, cfg.alrs_ramp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def param_groups(model: torch.nn.Module, weight_decay: float, per_matrix: bool = False) -> list[dict]:
    """AdamW groups: weight decay on matrices (dim >= 2) only. per_matrix=True gives every matrix its
    own group (for ALRS). Every group has a "name" and an "lr_mult"; the trainer sets
    group["lr"] = lr_at(step) * group["lr_mult"] each step."""
    matrices = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    if per_matrix:
        groups = [dict(name=n, params=[p], weight_decay=weight_decay, lr_mult=1.0) for n, p in matrices]
    else:
        groups = [dict(name="matrices", params=[p for _, p in matrices], weight_decay=weight_decay, lr_mult=1.0)]
    return groups + [dict(name="vectors", params=vectors, weight_decay=0.0, lr_mult=1.0)]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Peak cfg.lr after a linear warmup over warmup_frac of training, then cosine down to min_lr_ratio x peak."""
    total = cfg.total_steps()
    warmup = max(1, round(cfg.warmup_frac * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - lo)


# ----------------------------------------------------------------------------- loss, evaluation, metrics


def _unwrap(model) -> LoopedLM:
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def compute_loss(model, x, y):
    """The one place a batch becomes a loss. Returns (loss to backprop, LM cross-entropy, aux dict).

    With MoE FFNs the model's loss already includes its routers' weighted aux losses in training mode
    (LoopedLM.forward); aux holds them by name for the log, and the cross-entropy is the loss without them.
    """
    _, loss = model(x, y)
    raw = _unwrap(model)
    aux = raw.moe_aux_losses() if raw.training else {}
    return loss, (loss - sum(aux.values()) if aux else loss), aux


def _dist() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


@torch.no_grad()
def evaluate_loss(model, tokens: Tokens, seq_len: int, batch_size: int, n_batches: int, device="cpu",
                  dtype: torch.dtype = torch.float32, micro_batch: int | None = None) -> float:
    """Mean cross-entropy (nats/token) over n_batches x batch_size fixed windows spread evenly over `tokens`.

    The windows depend only on (tokens, seq_len, batch_size, n_batches); they are run in chunks of
    micro_batch, and under DDP each rank takes every world_size-th chunk and the sums are all-reduced.
    """
    rank, world = _dist()
    starts = eval_windows(tokens, seq_len, n_batches * batch_size)
    chunk = micro_batch or batch_size
    totals = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of per-window losses, windows)
    was_training = model.training
    model.eval()
    for c in range(rank, math.ceil(len(starts) / chunk), world):
        w = np.stack([tokens.window(int(s), seq_len + 1) for s in starts[c * chunk:(c + 1) * chunk]])
        w = torch.from_numpy(w).to(device)  # (B, T+1)
        with _autocast(device, dtype):
            _, ce, _ = compute_loss(model, w[:, :-1], w[:, 1:])
        totals += torch.stack([ce.double() * len(w), torch.tensor(float(len(w)), device=device, dtype=torch.float64)])
    model.train(was_training)
    if world > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def log_metrics(out_dir, row: dict):
    """Append one JSON object to out_dir/metrics.jsonl (rank 0 only). Every logged figure goes through here."""
    if _dist()[0] != 0:
        return
    with open(Path(out_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _trim_metrics(out_dir, last_step: int):
    """On resume: drop rows logged after the checkpoint (they will be recomputed), atomically."""
    rows = [r for r in read_metrics(out_dir) if r.get("step", 0) <= last_step]
    tmp = Path(out_dir) / "metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, Path(out_dir) / "metrics.jsonl")


def plot_metrics(out_dir, unigram_entropy: float | None = None) -> Path:
    """Loss curve PNG (train and val cross-entropy vs step) next to metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out_dir)
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), lw=0.8, alpha=0.7, label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    if unigram_entropy:
        ax.axhline(unigram_entropy, ls="--", c="gray", label=f"val unigram entropy {unigram_entropy:.2f}")
    ax.set(title=f"Loss curve: {Path(out_dir).name}", xlabel="optimizer step", ylabel="cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(out_dir) / "loss.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- system helpers

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _autocast(device, dtype):
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()


def resolve_device(cfg: TrainConfig, local_rank: int) -> tuple[torch.device, torch.dtype]:
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {cfg.device!r} asked for but CUDA is not available; use --device cpu")
        name = f"cuda:{local_rank}" if name == "cuda" else name
    device = torch.device(name)
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    return device, getattr(torch, dtype)


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


def _data_for(model_cfg: ModelConfig, cfg: TrainConfig, local_rank: int, quiet: bool):
    """Prepare the data on local rank 0 (before any collective: it can outlast a timeout); other ranks wait for it."""
    budget = cfg.total_steps() * cfg.global_batch * cfg.seq_len
    max_tokens = cfg.max_data_tokens
    if max_tokens is None and cfg.data.startswith("fineweb-edu"):
        # a streamed source is read up to the budget, rounded up to whole shards so short runs share a cache (ours)
        max_tokens = math.ceil(budget / SHARD_TOKENS) * SHARD_TOKENS
    kw = dict(source=cfg.data, tokenizer=cfg.tokenizer, bpe_vocab=cfg.bpe_vocab or model_cfg.vocab_size, cache_dir=cfg.data_cache,
              max_tokens=max_tokens, val_fraction=cfg.val_fraction)
    if local_rank == 0:
        return prepare(**kw, quiet=quiet)
    while True:  # torchrun stops this rank if rank 0 fails
        try:
            return prepare(**kw, quiet=True, build=False)
        except FileNotFoundError:
            time.sleep(2)


def check_out_dir(out_dir: Path):
    """Fail now, not at the first checkpoint hours later, if out_dir cannot be created or written."""
    probe = out_dir / f".write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to --out-dir {out_dir} ({e.strerror or e}); choose a writable --out-dir") from None


def _nan_steps() -> set[int]:
    return {int(s) for s in os.environ.get(NAN_ENV, "").split(",") if s.strip()}


def _check_resume(meta: dict, model_cfg: ModelConfig, cfg: TrainConfig, data_meta: dict):
    diffs = [f"{k}: {v!r} -> {model_cfg.to_dict().get(k)!r}" for k, v in meta["model_config"].items() if model_cfg.to_dict().get(k) != v]
    now = asdict(cfg)
    diffs += [f"{k}: {v!r} -> {now.get(k)!r}" for k, v in meta["train_config"].items()
              if k not in RESUME_MAY_CHANGE and now.get(k) != v]
    if meta.get("data", {}).get("identity") != data_meta["identity"]:
        diffs.append(f"data: {meta.get('data', {}).get('identity')} -> {data_meta['identity']}")
    if diffs:
        raise ConfigError(f"cannot resume from {meta['path']}: the config differs from the checkpoint's ({'; '.join(diffs)}); "
                          f"resume with the same settings, or start a fresh run with a new --out-dir")


# ----------------------------------------------------------------------------- the training loop


def train(model_cfg: ModelConfig, cfg: TrainConfig, lr_hook=None) -> dict:
    """Train, evaluate, checkpoint. Returns {"history", "val_loss", "unigram_entropy", "step", ...}.

    lr_hook (optional, for ALRS): an object with `on_step(step, model, optimizer) -> dict | None`
    (called before each step's LR is set; may change group["lr_mult"]; a returned dict is logged
    with that step), `state_dict()` / `load_state_dict(d)` (checkpointed), and `per_matrix`
    (True: one optimizer group per matrix). None: ALRS as `cfg.alrs` says (make_alrs).
    """
    rank, world, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    master = rank == 0
    say = tqdm.write if master and not cfg.quiet else (lambda *a, **k: None)
    device, dtype = resolve_device(cfg, local_rank)
    micro = cfg.micro_batch or cfg.global_batch // world
    if cfg.global_batch % (micro * world):
        raise ConfigError(f"global_batch={cfg.global_batch} is not divisible by micro_batch={micro} x world_size={world}; "
                          f"pick a micro_batch that divides global_batch/world_size={cfg.global_batch / world:g}")
    accum = cfg.global_batch // (micro * world)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}; set --max-seq-len {cfg.seq_len}")

    data = _data_for(model_cfg, cfg, local_rank, quiet=cfg.quiet or not master)
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the {cfg.tokenizer} tokenizer has {data.vocab_size} tokens but the model's vocab_size is "
                          f"{model_cfg.vocab_size}; set --vocab-size {data.vocab_size} or more (the paper pads T5's 32100 to 32128)")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=cfg.ddp_timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(cfg.seed)
    model = LoopedLM(model_cfg).to(device)
    if lr_hook is None:
        lr_hook = make_alrs(cfg, model_cfg.arch)
    per_matrix = bool(getattr(lr_hook, "per_matrix", False))
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay, per_matrix), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)
    out_dir = Path(cfg.out_dir)
    start_step, best_val, skipped = 0, math.inf, 0
    if master:
        check_out_dir(out_dir)
    if cfg.resume:
        meta = ckpt.read_meta(out_dir)
        _check_resume(meta, model_cfg, cfg, data.meta)
        state = ckpt.load_state(meta["path"])
        ckpt.load_weights(model, Path(meta["path"]))
        optimizer.load_state_dict(state["optimizer"])
        for g in optimizer.param_groups:  # the device may have changed since the save
            g["fused"], g["foreach"] = (True, None) if fused else (None, None)
        if (state.get("lr_hook") is None) != (lr_hook is None):
            raise ConfigError(f"cannot resume from {meta['path']}: it was trained {'with' if lr_hook is None else 'without'} an LR hook "
                              f"(ALRS); resume with the same setting")
        if lr_hook is not None:
            lr_hook.load_state_dict(state["lr_hook"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start_step, best_val, skipped = state["step"], state["best_val_loss"], state.get("nonfinite_skipped", 0)
        if master:
            _trim_metrics(out_dir, start_step)
        say(f"resumed from {meta['path']} at step {start_step}")
    elif master:
        if (out_dir / "latest").exists():
            say(f"note: starting fresh in {out_dir}; its old checkpoints will be replaced (use --resume to continue them)")
        (out_dir / "metrics.jsonl").write_text("")

    raw = model
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    total = cfg.total_steps()
    stop_at = min(total, cfg.stop_step or total)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    flops = flops_per_token(model_cfg, cfg.seq_len)["total"]
    peak = gpu_peak_flops(device)
    n_params = count_params(model_cfg)
    say(f"model: {json.dumps(model_cfg.to_dict())}\ntrain: {json.dumps(asdict(cfg))}")
    say(f"{model_cfg.arch} K={model_cfg.n_iter}: {n_params / 1e6:.2f}M parameters, effective depth {model_cfg.effective_depth}, "
        f"{flops / 1e6:.1f} MFLOPs/token forward at seq {cfg.seq_len}")
    say(f"{tokens_per_step:,} tokens/step (global batch {cfg.global_batch} = micro {micro} x accum {accum} x world {world}), "
        f"{total} steps = {total * tokens_per_step / 1e6:.1f}M tokens ({total * tokens_per_step / n_params:.2f} tokens/param); "
        f"{device} {str(dtype).removeprefix('torch.')}{' compiled' if cfg.compile else ''}")
    if isinstance(lr_hook, alrs.ALRS):
        say(lr_hook.describe(raw))
    say(f"data: {data.meta['n_train_tokens']:,} train / {data.meta['n_val_tokens']:,} val tokens; "
        f"val unigram entropy {data.unigram_entropy:.3f} nats/token (the loss of the best context-free model)")

    sampler = BatchSampler(data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
    meta_base = dict(model_config=model_cfg.to_dict(), train_config=asdict(cfg), params=n_params,
                     data=dict(source=cfg.data, identity=data.meta["identity"], tokenizer=data.meta["tokenizer"],
                               vocab_size=data.vocab_size, unigram_entropy=data.unigram_entropy))

    def evaluate() -> float:
        return evaluate_loss(raw, data.val, cfg.seq_len, cfg.global_batch, cfg.eval_batches, device, dtype, micro)  # eager, unwrapped

    def save(step: int, val_loss: float | None, best: bool):
        if not master:
            return
        state = dict(step=step, samples_seen=step * cfg.global_batch, optimizer=optimizer.state_dict(), best_val_loss=best_val,
                     rng=dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if device.type == "cuda" else []),
                     lr_hook=lr_hook.state_dict() if lr_hook is not None else None, nonfinite_skipped=skipped)
        ckpt.save_checkpoint(out_dir, raw, state, dict(meta_base, step=step, val_loss=val_loss, best_val_loss=best_val),
                             data.tokenizer, best=best)

    flag, val_loss, done, t_start, nan_steps = {}, None, start_step, time.time(), _nan_steps()
    bar = tqdm(total=total, initial=start_step, disable=not master or cfg.quiet, unit="step", dynamic_ncols=True)
    try:
        with stop_on_signals(flag):
            for step in range(start_step, stop_at):
                t0 = time.time()
                extra = lr_hook.on_step(step, raw, optimizer) if lr_hook is not None else None
                lr = lr_at(step, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr * g["lr_mult"]
                ce_sum = torch.zeros((), device=device)
                aux_sum: dict = {}
                for m in range(accum):
                    first = rank * micro * accum + m * micro  # this rank's rows of the global batch
                    x, y = (torch.from_numpy(a).to(device, non_blocking=True) for a in sampler.batch(step, slice(first, first + micro)))
                    # DDP: all-reduce gradients only on the last micro-step
                    sync = nullcontext() if world == 1 or m == accum - 1 else model.no_sync()
                    with sync:
                        with _autocast(device, dtype):
                            loss, ce, aux = compute_loss(model, x, y)  # (B, T) tokens -> scalar
                        if step + 1 in nan_steps:  # test hook (NAN_ENV): a NaN loss, and so NaN gradients
                            loss, ce = loss * math.nan, ce * math.nan
                        (loss / accum).backward()
                    ce_sum += ce.detach() / accum
                    for k, v in aux.items():
                        aux_sum[k] = aux_sum.get(k, 0.0) + v.detach() / accum
                grad_norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
                # one small all-reduce: mean loss over ranks, and whether any rank was asked to stop
                stop_req = torch.tensor(float(bool(flag)), device=device)
                stats = torch.stack([ce_sum.float(), stop_req, *[v.float() for v in aux_sum.values()]])
                if world > 1:
                    dist.all_reduce(stats)
                    stats /= world  # stats[1] > 0 still means "some rank got a signal"
                loss_val, stop, gn = stats[0].item(), stats[1].item() > 0, grad_norm.item()
                finite = math.isfinite(loss_val) and math.isfinite(gn)
                if not finite and not cfg.skip_nonfinite:
                    raise NonFiniteLossError(f"non-finite {'loss' if not math.isfinite(loss_val) else 'gradient norm'} at step {step + 1} "
                                             f"(loss {loss_val}, grad norm {gn}); stopped before applying it. The last good checkpoint "
                                             f"is {out_dir / 'latest'}; try a lower --lr or --dtype float32, or --skip-nonfinite")
                if finite:
                    optimizer.step()
                else:  # --skip-nonfinite: drop this step's update (the LR schedule and data order move on)
                    skipped += 1
                    say(f"step {step + 1}: non-finite loss {loss_val} / grad norm {gn}; step skipped ({skipped} skipped so far)")
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.time() - t0
                row = dict(step=step + 1, tokens=(step + 1) * tokens_per_step, loss=loss_val, lr=lr, grad_norm=gn,
                           tok_per_s=tokens_per_step / dt, step_s=dt)
                row.update({k: v.item() for k, v in zip(aux_sum, stats[2:])})
                if skipped:
                    row["nonfinite_skipped"] = skipped
                row.update(raw.moe_load_entropy())  # MoE: per-layer expert-load entropy, last micro-batch of rank 0
                if peak:
                    row["mfu"] = 3 * flops * tokens_per_step / dt / (peak * world)
                if extra:
                    row.update(extra)
                log_metrics(out_dir, row)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{row['tok_per_s']:,.0f}", refresh=False)
                done = step + 1
                if done % cfg.eval_interval == 0 or done == total:
                    val_loss = evaluate()
                    improved = val_loss < best_val
                    best_val = min(best_val, val_loss)
                    log_metrics(out_dir, dict(step=done, tokens=done * tokens_per_step, val_loss=val_loss, val_ppl=math.exp(val_loss)))
                    say(f"step {done}: val loss {val_loss:.4f} (ppl {math.exp(val_loss):.1f}), unigram entropy {data.unigram_entropy:.3f}")
                    save(done, val_loss, improved)
                elif stop or done == stop_at:
                    save(done, None, False)
                if stop:
                    say(f"stopped by {flag.get('signal', 'a signal on another rank')} at step {done}; checkpoint written, "
                        f"continue with --resume")
                    break
    except RuntimeError as e:
        if world > 1 and (err := _lost_ranks(e, rank, done + 1, cfg)) is not None:
            raise err from None
        raise
    finally:
        bar.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    result = dict(step=done, total_steps=total, val_loss=val_loss, best_val_loss=best_val, unigram_entropy=data.unigram_entropy,
                  interrupted=bool(flag) or done < total, seconds=time.time() - t_start, params=n_params, out_dir=str(out_dir))
    result["nonfinite_skipped"] = skipped
    if master:
        result["history"] = read_metrics(out_dir)
        if result["history"]:
            result["plot"] = str(plot_metrics(out_dir, data.unigram_entropy))
        if isinstance(lr_hook, alrs.ALRS) and (rep := alrs.report(out_dir, result["history"], lr_hook.ramp_len, done)):
            result["alrs_plot"] = rep[0]
            say(rep[1])
        if val_loss is not None and not result["interrupted"]:
            say(f"final val loss {val_loss:.4f} nats/token (ppl {math.exp(val_loss):.1f}) vs unigram entropy "
                f"{data.unigram_entropy:.3f} after {done} steps, {result['seconds']:.0f}s; checkpoints and loss.png in {out_dir}")
    return result
