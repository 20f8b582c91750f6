"""Training settings: `TrainConfig` (every option of train_minimal.py but the model's) and the paper's presets.

The defaults are the paper's training setup (Section 4 and He et al.'s reference configs); choices it leaves open are
marked (ours). `TrainConfig.from_preset(size, **overrides)` is what the command line builds.
"""

import ast
import inspect
import io
import math
import textwrap
import tokenize
from dataclasses import dataclass, fields

from minimal_asymloop import alrs, depth
from minimal_asymloop.sources import TOKENIZERS
from minimal_asymloop.system import DTYPES, ConfigError, check_device_name, cpu_cores


@dataclass
class TrainConfig:
    # data
    data: str = "stdlib"  # training text: stdlib (Python's own sources, offline) | fineweb-edu[:config] | path/glob of .txt/.jsonl/.parquet
    tokenizer: str = "bpe"  # bpe: a byte-level BPE trained on the data | t5: the paper's T5 tokenizer | smollm (Appendix G)
    bpe_vocab: int | None = None  # vocabulary of the trained BPE; None -> the model's vocab_size
    data_cache: str = "data_cache"  # folder for tokenized data, reused by every run on the same data and tokenizer
    max_data_tokens: int | None = None  # cap on train tokens read from the source; None -> all (fineweb-edu: the budget)
    val_fraction: float | None = None  # share of documents held out for validation; None -> 5% (0.5% for fineweb-edu), by hash
    data_workers: int | None = None  # tokenizer processes preparing data; None -> CPU cores - 1, at most 32 (same tokens for any)
    # batch and budget
    seq_len: int = 1024  # tokens per training sequence
    global_batch: int = 512  # sequences per optimizer step, summed over ranks
    micro_batch: int | None = None  # sequences per forward pass per rank (lower it to fit memory); None -> global_batch / world_size
    tokens: int | None = None  # training budget in tokens: steps = tokens / (global_batch * seq_len); None -> max_steps sets it
    max_steps: int | None = None  # training budget in optimizer steps (overrides tokens); the LR schedule ends here; None -> from tokens
    stop_step: int | None = None  # stop early at this step with a checkpoint; --resume continues the same schedule; None -> run to the end
    # optimizer and schedule: the paper's setup with He et al.'s reference configs (see TRAIN_PRESETS)
    lr: float = 1e-3  # peak learning rate (AdamW); the best of the paper's sweep at 60m
    min_lr_ratio: float = 0.1  # the cosine schedule decays to this fraction of the peak
    warmup_frac: float = 0.1  # linear warmup over this fraction of the steps
    weight_decay: float = 0.1  # AdamW weight decay, (ours) on matrices only: norm scales are not decayed
    beta1: float = 0.9  # AdamW beta1 (first-moment decay)
    beta2: float = 0.95  # AdamW beta2 (second-moment decay)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    # evaluation and checkpoints (a checkpoint is written at every eval)
    eval_interval: int = 250  # steps between validation evaluations, each followed by a checkpoint
    eval_batches: int = 8  # fixed val batches of global_batch sequences, the same for any micro_batch or world size
    log_interval: int = 10  # (ours) steps between reads of the loss from the GPU; every step still gets its row
    # system
    out_dir: str = "out"  # folder for checkpoints, metrics.jsonl and plots
    device: str = "auto"  # where to train: auto picks cuda, then mps (Apple silicon), then cpu
    dtype: str = "auto"  # autocast dtype: auto picks bfloat16 on GPUs with it, float16 + loss scaling on T4/V100, float32 on CPU/MPS
    compile: bool | None = None  # torch.compile the training step (slow start, fast steps); None -> auto: on for CUDA, off elsewhere (ours)
    compile_backend: str = "inductor"  # torch.compile backend (ours): aot_eager checks the capture on CPU in seconds
    seed: int = 1337  # seeds the weights and the data order
    resume: bool = False  # continue the run in out_dir exactly, from its latest checkpoint
    quiet: bool = False  # no prints, no progress bar (notebooks)
    ddp_timeout_s: int = 600  # a rank that dies makes the others fail after this, never hang (ours)
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is inf/NaN (counted, logged) instead of stopping
    max_skips: int = 10  # with skip_nonfinite: stop after this many skipped steps in a row, the run has diverged (ours)
    keep_every: int | None = None  # also keep the checkpoints at multiples of this step; None -> keep latest and best only
    # Weights & Biases (optional extra: pip install -e ".[wandb]"): the same rows as metrics.jsonl, rank 0 only
    wandb: bool = False  # also log to Weights & Biases
    wandb_project: str = "minimal-asymloop"  # the W&B project to log to
    wandb_run_name: str | None = None  # the W&B run's name; None -> wandb picks one
    # ALRS layerwise learning rates (He et al. 2026; alrs.py); --no-alrs and --alrs-range LO HI also work
    alrs: bool | None = None  # ALRS layerwise LRs (full_loop + on: Table 4c); None -> auto: on for asymloop, off otherwise (the paper)
    alrs_fit: str = "ww"  # the alpha fit: ww, weightwatcher's (xmin by KS) | hill_median, Hill at the median (ours: drops eigs <= 1e-5)
    alrs_lo: float = 1.0  # the smallest LR multiplier, for the matrix of smallest alpha
    alrs_hi: float = 5.0  # the largest LR multiplier, for the matrix of largest alpha
    alrs_every: int = 100  # steps between allocations
    alrs_phase: float = 0.2  # allocate while step <= phase * total steps, then freeze
    alrs_ramp: int = 50  # steps of linear transition to each new allocation
    alrs_top: str = "pin"  # embedding and head: pin (top multiplier: He et al.'s code) | base (1x: our reading of 3.3) | fit (by alpha)
    dec_lr_mult: float | None = None  # Table 4b's baseline instead of ALRS: one LR multiplier for all decoder matrices; None -> off
    # (ours) train once, run at any depth: K drawn per optimizer step, after Huginn (depth.py); fixed is the paper
    depth_sampler: str = "fixed"  # K per step: fixed (the model's n_iter) | uniform (depth_min..depth_max) | lognormal_poisson (Huginn's)
    depth_min: int = 1  # uniform: the smallest K drawn
    depth_max: int | None = None  # uniform: the largest K drawn; None -> unset (uniform needs it)
    depth_mean: float | None = None  # lognormal_poisson: the mean K (before the cap); None -> unset (lognormal_poisson needs it)
    depth_cap: int | None = None  # lognormal_poisson: the largest K drawn (bounds time and memory per step); None -> unset (needed)
    backprop_depth: int | None = None  # backpropagate through the last n decoder iterations only (Huginn); None -> all K (so does 0)

    def __post_init__(self):
        for name in ("seq_len", "global_batch", "eval_interval", "eval_batches", "log_interval", "ddp_timeout_s", "max_skips"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("micro_batch", "tokens", "max_steps", "stop_step", "bpe_vocab", "max_data_tokens", "keep_every", "data_workers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
        check_optimizer_values(self)
        check_seed(self.seed)
        for name in ("out_dir", "data_cache"):  # "" would write into the current folder
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"{name} must name a folder, got {getattr(self, name)!r}; e.g. --{name.replace('_', '-')} "
                                  f"{TrainConfig.__dataclass_fields__[name].default}")
        if self.data_workers is not None and self.data_workers > (cores := cpu_cores()):
            raise ConfigError(f"data_workers={self.data_workers} exceeds this machine's {cores} CPU cores (each is a tokenizer "
                              f"process); pass --data-workers {cores} or less, or leave it unset")
        for name in ("alrs_lo", "alrs_hi"):
            check_range(name, getattr(self, name), "(0, 100]", "1 and 5", " (ours: a larger LR multiplier only diverges)")
        if self.val_fraction is not None:
            check_range("val_fraction", self.val_fraction, "(0, 1)", "0.05", ", a share of the documents")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_device_name(self.device)
        if self.tokenizer not in TOKENIZERS:
            raise ConfigError(f"unknown tokenizer {self.tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        if self.max_steps is None and self.tokens is None:
            raise ConfigError("no training budget: set --max-steps or --tokens")
        try:  # the depth sampler's settings, checked before any data preparation
            depth.check(self.depth_sampler, self.depth_min, self.depth_max, self.depth_mean, self.depth_cap)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.backprop_depth is not None and (not isinstance(self.backprop_depth, int) or self.backprop_depth < 0):
            raise ConfigError(f"backprop_depth must be an integer >= 0 (0 or None: backpropagate through every iteration), "
                              f"got {self.backprop_depth!r}")
        alrs_hook(self)  # checks the ALRS settings now, with a clear error, even when ALRS is off
        if self.dec_lr_mult is not None:
            if self.alrs:
                raise ConfigError(f"dec_lr_mult={self.dec_lr_mult} replaces ALRS (the paper's Table 4b compares the two); "
                                  f"drop --alrs true or --dec-lr-mult")
            try:
                alrs.DecoderLRBoost(self.dec_lr_mult)
            except ValueError as e:
                raise ConfigError(str(e)) from None

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


# The paper's setup for its LLaMA-style sizes: FineWeb-Edu, T5 tokenizer, sequence 1024, global batch 512, base LR 1e-3
# (the best of the paper's LR sweep, run at 60m). TrainConfig's AdamW betas (0.9, 0.95), weight decay 0.1, clip 1.0 and
# decay to 0.1x peak: the paper's setup as He et al.'s reference configs spell it out. (ours) weight decay on matrices
# only; (ours) 1e-3 also at 135m/350m/1b, where the paper reports no LR sweep of its own.
_PAPER = dict(data="fineweb-edu", tokenizer="t5", seq_len=1024, global_batch=512, lr=1e-3)
TRAIN_PRESETS = {
    # (ours) sized for a 2-core CPU: data prep + training + evals in <= 5 minutes, see docs/training.md. ALRS off:
    # its 1-5x multipliers on this LR overshoot at 200 steps (docs/training.md); --alrs true turns it on
    "tiny": dict(data="stdlib", tokenizer="bpe", seq_len=128, global_batch=16, max_steps=200,
                 lr=3e-3, eval_interval=50, eval_batches=8, alrs=False),
    # the paper's token budgets; micro_batch (ours) fits an 80 GB GPU in bf16, lower it on smaller GPUs
    "60m": dict(_PAPER, tokens=1_680_000_000, micro_batch=32, eval_interval=250),
    "135m": dict(_PAPER, tokens=3_000_000_000, micro_batch=32, eval_interval=250),
    "350m": dict(_PAPER, tokens=7_000_000_000, micro_batch=16, eval_interval=500),
    "1b": dict(_PAPER, tokens=20_000_000_000, micro_batch=8, eval_interval=500),
    # the paper's Appendix G: about 1.68B tokens of FineWeb-Edu-dedup (the SmolLM corpus) with the SmolLM tokenizer,
    # sequence 1024, global batch 512, AdamW, cosine with 10% warmup, ALRS in [1, 3]. (ours) base LR 1e-3: not stated there
    "olmo8": dict(_PAPER, data="fineweb-edu-dedup", tokenizer="smollm", tokens=1_680_000_000, micro_batch=32,
                  eval_interval=250, alrs_lo=1.0, alrs_hi=3.0),
}
# settings that may change on --resume without changing the result (or only its speed)
# (not keep_every: resuming without it would delete the checkpoints it kept)
RESUME_MAY_CHANGE = {"out_dir", "device", "compile", "compile_backend", "stop_step", "quiet", "resume", "eval_interval", "eval_batches",
                     "micro_batch", "ddp_timeout_s", "data_cache", "skip_nonfinite", "max_skips", "wandb", "wandb_project",
                     "wandb_run_name", "data_workers", "log_interval"}


def check_range(name: str, v, interval: str, example: str, note: str = "", error=ConfigError):
    """Raise `error` unless v lies in `interval`, written as in maths ('(0, 1)', '[0, inf]': a round bracket leaves that
    end out); the message gives the range and which way to go."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    above = number and (v > lo if interval[0] == "(" else v >= lo)
    below = number and (v < hi if interval[-1] == ")" else v <= hi)
    if not (above and below):
        way = "give a number" if not number else "raise it" if not above else "lower it"
        raise error(f"{name} must be in {interval}{note}, got {v!r}; {way} (e.g. {example})")


def check_optimizer_values(cfg, error=ConfigError):
    """The AdamW and schedule settings of `cfg` (a TrainConfig or finetune's FinetuneConfig), each in its valid range."""
    check_range("lr", cfg.lr, "(0, inf)", "1e-3", error=error)
    check_range("beta1", cfg.beta1, "[0, 1)", "0.9", error=error)
    check_range("beta2", cfg.beta2, "[0, 1)", "0.95", error=error)
    check_range("weight_decay", cfg.weight_decay, "[0, inf)", "0.1", error=error)
    check_range("grad_clip", cfg.grad_clip, "(0, inf]", "1.0", " (inf: no clipping)", error=error)
    check_range("warmup_frac", cfg.warmup_frac, "[0, 1]", "0.1", ", a share of the steps", error=error)
    check_range("min_lr_ratio", cfg.min_lr_ratio, "[0, 1]", "0.1", ", a share of the peak LR", error=error)


def check_seed(seed, error=ConfigError):
    """A seed numpy's and torch's generators both take: an integer in [0, 2**63 - 1]."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise error(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}; e.g. --seed 1337")


def alrs_hook(cfg: TrainConfig) -> alrs.ALRS:
    if cfg.alrs_top not in alrs.TOP_MODES:
        raise ConfigError(f"unknown alrs_top {cfg.alrs_top!r}; choose one of {', '.join(alrs.TOP_MODES)} (e.g. --alrs-top base)")
    try:
        return alrs.ALRS(cfg.total_steps(), cfg.alrs_fit, cfg.alrs_lo, cfg.alrs_hi, cfg.alrs_every, cfg.alrs_phase, cfg.alrs_ramp,
                         **alrs.TOP_MODES[cfg.alrs_top])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def field_docs(cls) -> dict[str, str]:
    """Each dataclass field's description: the comment at the end of its line in the source. train_minimal.py's --help
    prints these, so a field's comment is its documentation (a comment on the lines above it is not)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    return {node.target.id: comments.get(node.end_lineno, "") for node in body if isinstance(node, ast.AnnAssign)}
