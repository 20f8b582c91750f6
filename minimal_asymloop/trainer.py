"""Training: the loop (one process or DDP under torchrun) and its phases: set-up, resume, steps, evaluation, checkpoints.

`train(model_cfg, train_cfg)` is the whole job and works from a notebook; `train_minimal.py` is a
thin nanoGPT-style command line over it. The settings and presets are in config.py, the optimizer groups and LR schedule in
optim.py, the loss in loss.py, the batches in batches.py, each step's logged row in metrics.py, and device and dtype,
autocast, signals, RNG, GPU peaks for MFU and the other plumbing in system.py.
"""

import json
import math
import os
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from minimal_asymloop import alrs, depth
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.batches import BatchSampler, check_eval_windows, data_for_run, evaluate_loss  # noqa: F401 (re-exported)
from minimal_asymloop.config import RESUME_MAY_CHANGE, TRAIN_PRESETS, TrainConfig  # noqa: F401 (TRAIN_PRESETS re-exported)
from minimal_asymloop.flops import check_fits, count_params, flops_per_token, train_flops_per_token
from minimal_asymloop.loss import compute_loss
from minimal_asymloop.metrics import (  # noqa: F401 (re-exported)
    NonFiniteLossError,
    log_metrics,
    log_steps,
    perplexity,
    plot_metrics,
    plot_stable_rank,
    read_metrics,
    restore_metrics,
    trim_metrics,
)
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.optim import lr_at, make_alrs, param_groups  # noqa: F401 (re-exported)
from minimal_asymloop.runfolder import hold
from minimal_asymloop.system import (  # noqa: F401 (gpu_peak_flops: re-exported for tests)
    ConfigError,
    DistributedError,
    autocast_context,
    check_out_dir,
    compile_preflight,
    gpu_peak_flops,
    grad_scaler,
    init_process_group,
    lost_ranks_error,
    mps_error,
    peak_flops_or_reason,
    resolve_device,
    restore_rng,
    rng_state,
    stop_on_signals,
    synchronize,
    wandb_module,
)

NAN_ENV = "MINIMAL_ASYMLOOP_NAN_STEPS"  # test hook: comma-separated steps (1-based) whose loss is made NaN


def _nan_steps() -> set[int]:
    return {int(s) for s in os.environ.get(NAN_ENV, "").split(",") if s.strip()}


# ----------------------------------------------------------------------------- the training loop


def train(model_cfg: ModelConfig, cfg: TrainConfig, lr_hook=None) -> dict:
    """`_train` with out_dir held for the whole run (runfolder.hold; under DDP by rank 0): one run per folder."""
    with hold(cfg.out_dir, "pretraining", enabled=int(os.environ.get("RANK", 0)) == 0):
        return _train(model_cfg, cfg, lr_hook)


def _train(model_cfg: ModelConfig, cfg: TrainConfig, lr_hook=None) -> dict:
    """Train, evaluate, checkpoint. Returns {"history", "val_loss", "unigram_entropy", "step", ...}.

    lr_hook (optional, for ALRS): an object with `on_step(step, model, optimizer) -> dict | None`
    (called before each step's LR is set; may change group["lr_mult"]; a returned dict is logged
    with that step), `state_dict()` / `load_state_dict(d)` (checkpointed), and `per_matrix`
    (True: one optimizer group per matrix). None: ALRS as `cfg.alrs` says (make_alrs).
    """
    run = set_up(model_cfg, cfg, lr_hook)  # data, model, optimizer; resume; compile and DDP
    flag, t_start = {}, time.time()  # flag["signal"]: set by SIGINT/SIGTERM
    try:
        with stop_on_signals(flag):
            for step in range(run.step, run.stop_at):
                stop = optimizer_step(run, step, flag)  # True: some rank was asked to stop
                evaluate_and_checkpoint(run, stop)
                if stop:
                    run.say(f"stopped by {flag.get('signal', 'a signal on another rank')} at step {run.step}; checkpoint written, "
                            f"continue with --resume")
                    break
    except (RuntimeError, TypeError) as e:
        if isinstance(e, RuntimeError) and run.world > 1 and (err := lost_ranks_error(e, run.rank, run.step + 1, cfg)) is not None:
            raise err from None
        if (err := mps_error(e)) is not None:  # an op or dtype MPS lacks: one line naming the fix
            raise err from None
        raise
    finally:
        run.bar.close()
        if run.world > 1 and dist.is_initialized():
            # free the DDP wrapper first: if its Reducer drops the last reference to a gloo process group, the group's
            # destructor can deadlock with a worker thread that needs the GIL (seen at exit on CPU)
            run.model = None
            dist.destroy_process_group()
        if run.wandb is not None:
            run.wandb.finish()
    return wrap_up(run, flag, time.time() - t_start)


# ----------------------------------------------------------------------------- set-up and resume


@dataclass
class Run:
    """One training run's state, read and updated by the phases of `train` (a record, not a trainer class)."""

    model_cfg: ModelConfig
    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    micro: int  # sequences per forward pass per rank
    accum: int  # micro-batches per optimizer step per rank
    data: object  # data.Prepared: train/val tokens, tokenizer, meta
    raw: LoopedLM  # the model itself: evaluation, checkpoints, ALRS
    optimizer: torch.optim.Optimizer
    lr_hook: object
    out_dir: Path
    say: object  # print on rank 0 unless quiet
    model: torch.nn.Module = None  # what the step calls: raw, compiled and/or DDP-wrapped
    sampler: BatchSampler = None
    bar: tqdm = None
    wandb: object = None  # the wandb run (rank 0, --wandb), or None
    wandb_id: str | None = None  # the W&B run a resumed run continues (saved in every checkpoint)
    peak_flops: float | None = None  # GPU peak bf16 dense FLOP/s for MFU, None: no MFU
    step: int = 0  # optimizer steps done
    stop_at: int = 0
    best_val: float = math.inf
    val_loss: float | None = None
    skipped: int = 0  # non-finite steps skipped (--skip-nonfinite), all told
    skipped_in_row: int = 0
    scaler: torch.amp.GradScaler = None  # fp16's loss scaler; disabled (a pass-through) for bf16 and fp32
    overflow_skipped: int = 0  # fp16 steps the scaler skipped because the gradients overflowed, all told
    first_step: int = 0  # the step this process started at (0, or where it resumed)
    pending: list = field(default_factory=list)  # (step, lr, stats on the device, extra, fp16 loss scale) of the steps not logged yet
    stat_names: list = field(default_factory=list)  # the names of a pending step's stats[3:]: MoE's aux losses, load entropies
    t_log: float = 0.0  # when the first pending step started
    compiled: bool = False  # the step runs torch.compile'd (compile_and_wrap decides)
    saves: int = 0  # checkpoints this process wrote
    depth_sampler: depth.DepthSampler = None  # K per optimizer step (--depth-sampler; fixed: the model's n_iter)

    @property
    def master(self) -> bool:
        return self.rank == 0


def set_up(model_cfg: ModelConfig, cfg: TrainConfig, lr_hook) -> Run:
    """Check the batch arithmetic, prepare data, build model and optimizer, resume if asked, then compile/DDP."""
    rank, world, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    wandb = wandb_module(cfg) if rank == 0 else None  # fail now if --wandb cannot work, not after data preparation
    device, dtype = resolve_device(cfg, local_rank)
    micro = cfg.micro_batch or cfg.global_batch // world
    if cfg.global_batch % (micro * world):
        raise ConfigError(f"global_batch={cfg.global_batch} is not divisible by micro_batch={micro} x world_size={world}; "
                          f"pick a micro_batch that divides global_batch/world_size={cfg.global_batch / world:g}")
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}; set --max-seq-len {cfg.seq_len}")
    try:  # seeded alike on every rank: the same K everywhere without a broadcast
        depths = depth.DepthSampler(cfg.depth_sampler, model_cfg.n_iter, cfg.depth_min, cfg.depth_max, cfg.depth_mean,
                                     cfg.depth_cap, cfg.seed)
        depth.check_model(model_cfg, depths, cfg.backprop_depth)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    check_fits(model_cfg, device)  # --n-layer 1000000: refused with its size now, not an allocator error after data preparation
    found = None
    if cfg.resume:  # the checkpoint, and a changed model or data option refused, before any data is prepared
        found = ckpt.newest_intact(cfg.out_dir, tqdm.write if rank == 0 and not cfg.quiet else (lambda *a, **k: None))
        ckpt.check_resume(found[0], model_cfg, cfg)
    data = data_for_run(model_cfg, cfg, local_rank, quiet=cfg.quiet or rank != 0)
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the {cfg.tokenizer} tokenizer has {data.vocab_size} tokens but the model's vocab_size is "
                          f"{model_cfg.vocab_size}; set --vocab-size {data.vocab_size} or more (the paper pads T5's 32100 to 32128)")
    check_eval_windows(data.val, cfg.seq_len, cfg.eval_batches * cfg.global_batch)  # before the first step, not at the first eval
    if world > 1:
        init_process_group(device, cfg.ddp_timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(cfg.seed)
    raw = LoopedLM(model_cfg).to(device)
    if lr_hook is None:
        lr_hook = make_alrs(cfg, model_cfg.arch)
    per_matrix = bool(getattr(lr_hook, "per_matrix", False))
    # fused: one kernel per step, and it can skip a non-finite step on the device (optimizer_step)
    optimizer = torch.optim.AdamW(param_groups(raw, cfg.weight_decay, per_matrix), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
    run = Run(model_cfg, cfg, rank, world, device, dtype, micro, cfg.global_batch // (micro * world), data, raw, optimizer, lr_hook,
              Path(cfg.out_dir), tqdm.write if rank == 0 and not cfg.quiet else (lambda *a, **k: None), scaler=grad_scaler(device, dtype),
              depth_sampler=depths)
    if run.master:
        check_out_dir(run.out_dir)
    if cfg.resume:
        resume(run, *found)
    elif run.master:
        if (run.out_dir / "latest").exists():
            run.say(f"note: starting fresh in {run.out_dir}; its old checkpoints will be replaced (use --resume to continue them)")
        (run.out_dir / "metrics.jsonl").write_text("")

    run.first_step = run.step
    run.model = compile_and_wrap(run)
    run.stop_at = min(cfg.total_steps(), cfg.stop_step or cfg.total_steps())
    run.sampler = BatchSampler(data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
    run.peak_flops = peak_flops_or_reason(device, run.say)
    describe(run)
    if wandb is not None:
        run.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,  # a resumed run continues its W&B run
                               config=dict(model=model_cfg.to_dict(), train=asdict(cfg), params=count_params(model_cfg)),
                               id=run.wandb_id, resume="allow" if run.wandb_id else None)
    run.bar = tqdm(total=cfg.total_steps(), initial=run.step, disable=not run.master or cfg.quiet, unit="step", dynamic_ncols=True)
    return run


def resume(run: Run, meta: dict, state: dict):
    """Load weights, optimizer, LR-hook state, RNG and counters from the checkpoint newest_intact found (out_dir/latest or,
    when it is corrupt, the newest intact one); restore the metrics up to it."""
    ckpt.check_resume(meta, run.model_cfg, run.cfg, run.data.meta)  # the prepared data's identity too
    if run.cfg.stop_step is not None and run.cfg.stop_step <= state["step"]:
        raise ConfigError(f"--stop-step {run.cfg.stop_step} is not after the checkpoint's step {state['step']}: nothing to do; "
                          f"pass a --stop-step in {state['step'] + 1}..{run.cfg.total_steps()}, or drop it")
    ckpt.load_weights(run.raw, Path(meta["path"]), meta)
    run.optimizer.load_state_dict(state["optimizer"])
    for g in run.optimizer.param_groups:  # the checkpoint may come from another device, or an unfused optimizer
        g["fused"], g["foreach"] = True, None
    if (state.get("lr_hook") is None) != (run.lr_hook is None):
        raise ConfigError(f"cannot resume from {meta['path']}: it was trained {'with' if run.lr_hook is None else 'without'} an LR hook "
                          f"(ALRS); resume with the same setting")
    if run.lr_hook is not None:
        run.lr_hook.load_state_dict(state["lr_hook"])
    restore_rng(state["rng"], run.device)
    if state.get("depth") is not None:  # the depth sampler's generator continues where it stopped
        run.depth_sampler.load_state_dict(state["depth"])
    if run.scaler.is_enabled() and state.get("grad_scaler"):  # fp16: the loss scale and its growth count continue
        run.scaler.load_state_dict(state["grad_scaler"])
    run.step, run.best_val, run.skipped = state["step"], state["best_val_loss"], state.get("nonfinite_skipped", 0)
    run.overflow_skipped = state.get("overflow_skipped", 0)
    run.wandb_id = state.get("wandb_id")
    if run.master:
        restore_metrics(run.out_dir, Path(meta["path"]) / ckpt.METRICS, run.step, run.say)  # the checkpoint's copy
    run.say(f"resumed from {meta['path']} at step {run.step}")


def compile_and_wrap(run: Run) -> torch.nn.Module:
    """The module the training step calls. Compile the model, then wrap it in DDP, the order PyTorch documents
    ("Where to apply torch.compile?", docs.pytorch.org/docs/stable/compile/programming_model.where_to_apply_compile.html):
    DDP's forward marks itself active, so dynamo compiles the inner model with DDPOptimizer, which splits the graph at
    gradient-bucket boundaries and so overlaps the all-reduce with backward. Evaluation runs `run.raw`, eagerly."""
    model = run.raw
    run.compiled = compile_on(run.cfg, run.device)
    if run.compiled:
        if run.cfg.compile_backend not in (known := torch.compiler.list_backends(exclude_tags=())):
            raise ConfigError(f"unknown compile_backend {run.cfg.compile_backend!r}; choose one of {', '.join(known)} (default inductor)")
        if run.device.type == "cuda" and run.cfg.compile_backend == "inductor" and (why := compile_preflight()):
            if run.cfg.compile:  # asked for explicitly: stop now, not at the first step
                raise ConfigError(why)
            warnings.warn(f"WARNING: training EAGER, several times slower: {why}", RuntimeWarning, stacklevel=2)
            run.say(f"WARNING: training EAGER, several times slower: {why}")
            run.compiled = False
    if run.compiled:
        model = torch.compile(model, backend=run.cfg.compile_backend)
    if run.world > 1:
        # the RoPE tables are the only buffers and never change: no broadcast before each forward; gradients live in
        # DDP's all-reduce buckets, saving a copy per step
        model = DDP(model, device_ids=[run.device.index] if run.device.type == "cuda" else None, broadcast_buffers=False,
                    gradient_as_bucket_view=True)
    return model


def compile_on(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.compile if cfg.compile is not None else device.type == "cuda"  # auto: on for CUDA, off for CPU (ours)


def describe(run: Run):
    cfg, mc, tokens_per_step = run.cfg, run.model_cfg, run.cfg.global_batch * run.cfg.seq_len
    n_params, total = count_params(mc), cfg.total_steps()
    run.say(f"model: {json.dumps(mc.to_dict())}\ntrain: {json.dumps(asdict(cfg))}")
    run.say(f"{mc.arch} K={mc.n_iter}: {n_params / 1e6:.2f}M parameters, effective depth {mc.effective_depth}, "
            f"{flops_per_token(mc, cfg.seq_len)['total'] / 1e6:.1f} MFLOPs/token forward at seq {cfg.seq_len}")
    run.say(f"{tokens_per_step:,} tokens/step (global batch {cfg.global_batch} = micro {run.micro} x accum {run.accum} x world "
            f"{run.world}), {total} steps = {total * tokens_per_step / 1e6:.1f}M tokens ({total * tokens_per_step / n_params:.2f} "
            f"tokens/param); {run.device} {str(run.dtype).removeprefix('torch.')}{' with loss scaling' if run.scaler.is_enabled() else ''}"
            f"{' compiled' if run.compiled else ''}")
    if cfg.depth_sampler != "fixed" or cfg.backprop_depth:
        flops = train_flops_per_token(mc, cfg.seq_len, run.depth_sampler.pmf(), cfg.backprop_depth)
        run.say(f"depth: {run.depth_sampler.describe()}; backprop through "
                f"{f'the last {cfg.backprop_depth}' if cfg.backprop_depth else 'every'} iteration(s); {flops / 1e6:.1f} MFLOPs/token "
                f"training, averaged over K (validation runs at the model's K={mc.n_iter})")
    if isinstance(run.lr_hook, alrs.ALRS):
        run.say(run.lr_hook.describe(run.raw))
    run.say(f"data: {run.data.meta['n_train_tokens']:,} train / {run.data.meta['n_val_tokens']:,} val tokens; "
            f"val unigram entropy {run.data.unigram_entropy:.3f} nats/token (the loss of the best context-free model)")


# ----------------------------------------------------------------------------- one optimizer step


def optimizer_step(run: Run, step: int, flag: dict) -> bool:
    """Set the LR, accumulate gradients over micro-batches, clip, step (the update of a non-finite step is skipped on the
    device), and queue the step's stats; every log_interval steps (and before a checkpoint) `log_steps` reads them.
    Nothing here waits for the GPU. Returns True when any rank was asked to stop (a signal set `flag` here or elsewhere)."""
    cfg = run.cfg
    if not run.pending:
        run.t_log = time.time()  # the GPU is idle here: the last log_steps or evaluation waited for it
    extra = run.lr_hook.on_step(step, run.raw, run.optimizer) if run.lr_hook is not None else None
    lr = lr_at(step, cfg)
    for g in run.optimizer.param_groups:
        g["lr"] = lr * g["lr_mult"]
    k = run.depth_sampler.draw()  # this step's K: one draw per optimizer step, the same for every micro-batch and rank
    extra = {**(extra or {}), "n_iter": k}
    ce_sum, aux_sum = accumulate_gradients(run, step, k)
    run.scaler.unscale_(run.optimizer)  # fp16: true gradients before clipping (a no-op for bf16 and fp32)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw.parameters(), cfg.grad_clip)
    # one small all-reduce (asynchronous on NCCL): mean loss over ranks, grad norm, and whether any rank was asked to stop
    stats = torch.stack([ce_sum.float(), grad_norm.float(), torch.full((), float(bool(flag)), device=run.device),
                         *[v.float() for v in aux_sum.values()]])
    if run.world > 1:
        dist.all_reduce(stats)
        stats /= run.world  # stats[2] > 0 still means "some rank got a signal"; grad norms are equal on every rank
    if run.scaler.is_enabled():  # fp16: the scaler skips an overflowed update (found_inf from unscale_) and lowers the scale
        scale = run.scaler.get_scale()  # the loss scale this step ran at (a host read each step: fp16 GPUs only)
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:  # the fused AdamW skips its whole update (moments and step count too) where found_inf is 1, on the device (ours)
        scale = None
        run.optimizer.found_inf = (~torch.isfinite(stats[:2]).all()).float()
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    entropy = run.raw.moe_load_entropy()  # MoE: per-layer expert-load entropy, last micro-batch of this rank
    run.stat_names = [*aux_sum, *entropy]  # the names of stats[3:]
    run.pending.append((step, lr, torch.cat([stats, *[e.float().view(1) for e in entropy.values()]]), extra, scale))
    run.step = step + 1
    stop = run.world == 1 and bool(flag)  # one process reads its own flag; ranks agree on theirs at the next log
    if stop or run.step == run.first_step + 1 or run.step % cfg.log_interval == 0 or checkpoint_due(run, run.step):
        stop = log_steps(run) or stop
    return stop


def checkpoint_due(run: Run, done: int) -> bool:
    """Whether evaluate_and_checkpoint writes a checkpoint after `done` steps without a stop (a stop always writes one)."""
    cfg = run.cfg
    return done % cfg.eval_interval == 0 or done in (cfg.total_steps(), run.stop_at) or bool(cfg.keep_every and done % cfg.keep_every == 0)


def accumulate_gradients(run: Run, step: int, k: int) -> tuple[torch.Tensor, dict]:
    """Forward and backward over this rank's `accum` micro-batches of the step's global batch, at K = k decoder iterations;
    (mean CE, mean aux losses)."""
    ce_sum, aux_sum, nan_steps = torch.zeros((), device=run.device), {}, _nan_steps()
    sampled = run.cfg.depth_sampler != "fixed" or run.cfg.backprop_depth
    depth_kw = dict(n_iter=k, backprop_depth=run.cfg.backprop_depth) if sampled else {}  # fixed: the model's own K, as before
    for m in range(run.accum):
        first = run.rank * run.micro * run.accum + m * run.micro  # this rank's rows of the global batch
        x, y = run.sampler.batch_on(step, slice(first, first + run.micro), run.device)  # pinned, non-blocking on CUDA
        # DDP: all-reduce gradients only on the last micro-step
        with nullcontext() if run.world == 1 or m == run.accum - 1 else run.model.no_sync():
            with autocast_context(run.device, run.dtype):
                loss, ce, aux = compute_loss(run.model, x, y, **depth_kw)  # (B, T) tokens -> scalar
            if step + 1 in nan_steps:  # test hook (NAN_ENV): a NaN loss, and so NaN gradients
                loss, ce = loss * math.nan, ce * math.nan
            run.scaler.scale(loss / run.accum).backward()  # fp16: scaled so small gradients survive; else unchanged
        ce_sum += ce.detach() / run.accum
        for k, v in aux.items():
            aux_sum[k] = aux_sum.get(k, 0.0) + v.detach() / run.accum
    return ce_sum, aux_sum


# ----------------------------------------------------------------------------- evaluate and checkpoint


def evaluate_and_checkpoint(run: Run, stop: bool):
    """At every eval_interval (and the last step): val loss and stable ranks, logged, then a checkpoint. A checkpoint
    without evaluation at a stop, at stop_step and at multiples of keep_every."""
    cfg, done = run.cfg, run.step
    if done % cfg.eval_interval == 0 or done == cfg.total_steps():
        run.val_loss = evaluate_loss(run.raw, run.data.val, cfg.seq_len, cfg.global_batch, cfg.eval_batches, run.device, run.dtype,
                                     run.micro)  # eager, unwrapped
        improved = run.val_loss < run.best_val
        run.best_val = min(run.best_val, run.val_loss)
        row = dict(step=done, tokens=done * cfg.global_batch * cfg.seq_len, val_loss=run.val_loss, val_ppl=perplexity(run.val_loss))
        if run.master:  # the normalized stable rank of the paper's Figure 4: one SVD per matrix, so rank 0 only
            row.update(alrs.stable_rank_summary(run.raw))
        log_metrics(run.out_dir, row, run.wandb)
        run.say(f"step {done}: val loss {run.val_loss:.4f} (ppl {perplexity(run.val_loss):.1f}), unigram entropy "
                f"{run.data.unigram_entropy:.3f}")
        save(run, run.val_loss, improved)
    elif stop or checkpoint_due(run, done):
        save(run, None, False)


def save(run: Run, val_loss: float | None, best: bool):
    if not run.master:
        return
    cfg, data = run.cfg, run.data
    state = dict(step=run.step, samples_seen=run.step * cfg.global_batch, optimizer=run.optimizer.state_dict(), best_val_loss=run.best_val,
                 rng=rng_state(run.device), lr_hook=run.lr_hook.state_dict() if run.lr_hook is not None else None,
                 nonfinite_skipped=run.skipped, wandb_id=run.wandb.id if run.wandb is not None else run.wandb_id,
                 grad_scaler=run.scaler.state_dict(), overflow_skipped=run.overflow_skipped, depth=run.depth_sampler.state_dict())
    meta = dict(model_config=run.model_cfg.to_dict(), train_config=asdict(cfg), params=count_params(run.model_cfg),
                data=dict(source=cfg.data, identity=data.meta["identity"], tokenizer=data.meta["tokenizer"], vocab_size=data.vocab_size,
                          unigram_entropy=data.unigram_entropy),
                step=run.step, val_loss=val_loss, best_val_loss=run.best_val)
    ckpt.save_checkpoint(run.out_dir, run.raw, state, meta, data.tokenizer, best=best, keep_every=cfg.keep_every)
    run.saves += 1


# ----------------------------------------------------------------------------- wrap-up


def wrap_up(run: Run, flag: dict, seconds: float) -> dict:
    """The result dict; on rank 0 the metrics history, loss.png, srank.png and the ALRS report."""
    done, total = run.step, run.cfg.total_steps()
    result = dict(step=done, total_steps=total, val_loss=run.val_loss, best_val_loss=run.best_val, unigram_entropy=run.data.unigram_entropy,
                  interrupted=bool(flag) or done < total, seconds=seconds, params=count_params(run.model_cfg), out_dir=str(run.out_dir),
                  nonfinite_skipped=run.skipped, overflow_skipped=run.overflow_skipped, signal=flag.get("signal"))
    if not run.master:
        return result
    result["history"] = read_metrics(run.out_dir)
    if result["history"]:
        result["plot"] = str(plot_metrics(run.out_dir, run.data.unigram_entropy))
    if (srank := plot_stable_rank(run.out_dir)) is not None:
        result["srank_plot"] = str(srank)
    if isinstance(run.lr_hook, alrs.ALRS) and (rep := alrs.report(run.out_dir, result["history"], run.lr_hook.ramp_len, done)):
        result["alrs_plot"] = rep[0]
        run.say(rep[1])
    if run.scaler.is_enabled():
        run.say(f"fp16 loss scaling: {run.overflow_skipped} of {done} steps skipped for gradient overflow; loss scale now "
                f"{run.scaler.get_scale():g}")
    if run.val_loss is not None and not result["interrupted"]:
        run.say(f"final val loss {run.val_loss:.4f} nats/token (ppl {perplexity(run.val_loss):.1f}) vs unigram entropy "
                f"{run.data.unigram_entropy:.3f} after {done} steps, {seconds:.0f}s; checkpoints and loss.png in {run.out_dir}")
    return result
