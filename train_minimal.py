"""Train Dense, Full Loop or AsymLoop language models, nanoGPT-style.

    python train_minimal.py                                  # tiny AsymLoop K=3 on the stdlib corpus, CPU, <= 5 min
    python train_minimal.py --size 60m                       # the paper's 60M AsymLoop K=3, FineWeb-Edu + T5 (GPU)
    python train_minimal.py --size 60m --arch full_loop      # its depth-matched Full Loop K=2 baseline
    torchrun --standalone --nproc_per_node 8 train_minimal.py --size 135m
    python train_minimal.py --resume                         # continue the run in --out-dir exactly
    python train_minimal.py --size 60m --moe                 # sparse MoE FFNs: 8 experts of width 1024, top-2
    python train_minimal.py --size olmo8 --arch full_loop    # the paper's OLMo-style model (Appendix G), K=2
    python train_minimal.py --size 60m --wandb --wandb-project asymloop   # also log to Weights & Biases (pip install -e ".[wandb]")

--size picks the model and its training settings; every ModelConfig and TrainConfig field can then be
overridden, e.g. `--d-model 256 --lr 3e-4 --qk-norm false --max-steps 100`. Unknown keys are errors. Booleans work as
bare flags (`--compile`) and with values (`--compile false`); `auto` (or `none`) gives an option its automatic value.
`--help --size 60m` shows what that preset sets. A run stopped by SIGTERM or SIGINT checkpoints and exits
143 or 130 (128 + the signal), so that a scheduler requeues it; `--resume` continues it.
"""

import argparse
import difflib
import math
import signal
import sys
import types
from dataclasses import fields
from pathlib import Path

from minimal_asymloop.alrs import FIT_FNS, TOP_MODES
from minimal_asymloop.checkpoint import CheckpointError
from minimal_asymloop.config import TRAIN_PRESETS, TrainConfig, field_docs
from minimal_asymloop.model import ARCHS, BACKBONES, CONTEXTS, PAPER_MOE, PRESETS, ModelConfig
from minimal_asymloop.runfolder import RunFolderError, os_error_line
from minimal_asymloop.sources import TOKENIZERS, DataError
from minimal_asymloop.system import DEVICES, DTYPES, ConfigError, DistributedError
from minimal_asymloop.trainer import NonFiniteLossError, train


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _parse_int(s: str) -> int:
    try:
        v = float(s)  # accepts 1.68e9 for --tokens
    except ValueError:
        v = math.nan
    if not v.is_integer():
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}")
    return int(v)


def _parse_float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None


def _kind(f) -> type:
    """bool, int, float or str: a dataclass field's type without its `| None`."""
    return [t for t in (f.type.__args__ if isinstance(f.type, types.UnionType) else (f.type,)) if t is not type(None)][0]


def _field_parser(f):
    """argparse type for a dataclass field, from its annotation (`int | None` accepts 'auto' and 'none')."""
    base = {bool: _parse_bool, int: _parse_int, float: _parse_float, str: str}[_kind(f)]
    optional = isinstance(f.type, types.UnionType)
    # "auto" and "none" leave an optional setting to its default (`--compile auto`); a str field keeps "none" as a value:
    # `--context none` is the "without Global KV" ablation, not "unset"
    return lambda s: None if optional and base is not str and s.lower() in ("none", "null", "auto") else base(s)


# the values of the fields that take one of a few; the dataclasses check them against the same tuples
CHOICES = dict(arch=ARCHS, context=CONTEXTS, backbone=BACKBONES, tokenizer=TOKENIZERS, alrs_fit=tuple(FIT_FNS), alrs_top=tuple(TOP_MODES),
               device=(*DEVICES, "cuda:N"), dtype=DTYPES)


def _show(v) -> str:
    """A value as you would type it on the command line."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) and abs(v) >= 1_000_000:
        return f"{v:_}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def option_help(f, doc: str, size: str, preset: dict) -> str:
    """One option's --help line: the field's comment (what it does), its default (what None means, from the comment's
    "; None -> ..." part) and what the --size preset sets it to."""
    what, _, none_means = doc.partition("; None -> ")
    default = none_means if f.default is None else _show(f.default)
    sets = f"; --size {size} sets {_show(preset[f.name])}" if f.name in preset else ""
    return f"{what} (default: {default}{sets})".replace("%", "%%")  # argparse %-formats help strings


def build_parser(size: str = "tiny") -> argparse.ArgumentParser:
    """The command line; the help of each option comes from its config field's comment (config.field_docs), and shows
    what the --size preset `size` sets."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--size", default="tiny", metavar="{" + ",".join(PRESETS) + "}",
                   help="the model and its training settings: tiny (ours) runs in minutes on a CPU, the others are the paper's "
                        "sizes (default: tiny)")
    model_docs = field_docs(ModelConfig)
    arch = next(f for f in fields(ModelConfig) if f.name == "arch")
    p.add_argument("--arch", default="asymloop", metavar="{" + ",".join(ARCHS) + "}", help=option_help(arch, model_docs["arch"], size, {}))
    p.add_argument("--moe", action="store_true", help="the paper's sparse MoE FFNs: 8 SwiGLU experts, top-2, "
                   "moe_d_ff = d_ff/2 (1024 at 60m/135m); --moe-* options override")
    for title, cls, presets in (("model (ModelConfig)", ModelConfig, PRESETS), ("training (TrainConfig)", TrainConfig, TRAIN_PRESETS)):
        group, docs = p.add_argument_group(title), field_docs(cls)
        for f in fields(cls):
            if f.name == "arch":
                continue
            kind = _kind(f)
            kw = dict(nargs="?", const=True) if kind is bool else {}  # `--qk-norm` alone means true, `--qk-norm false` false
            metavar = "{" + ",".join(CHOICES[f.name]) + "}" if f.name in CHOICES else kind.__name__.upper()
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_field_parser(f), default=argparse.SUPPRESS,
                               metavar=metavar, help=option_help(f, docs[f.name], size, presets.get(size, {})), **kw)
    alrs = p.add_argument_group("ALRS shortcuts")
    alrs.add_argument("--no-alrs", dest="alrs", action="store_false", default=argparse.SUPPRESS, help="one LR for all matrices")
    alrs.add_argument("--alrs-range", nargs=2, type=float, metavar=("LO", "HI"), default=argparse.SUPPRESS,
                      help="ALRS multiplier range (default 1 5); sets --alrs-lo and --alrs-hi")
    return p


def interrupted_state(out_dir) -> str:
    """What an interrupted run leaves in out_dir, and how to go on."""
    latest = Path(out_dir) / "latest"
    if latest.exists():
        return f"the last checkpoint, {latest.resolve().name}, is intact: continue with --resume"
    return "no checkpoint was written: start the run again (a data preparation continues where it stopped)"


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--size", default="tiny")
    p = build_parser(pre.parse_known_args(argv)[0].size)  # --help shows what the chosen preset sets
    args, unknown = p.parse_known_args(argv)
    if unknown:
        known = [o for a in p._actions for o in a.option_strings]
        bad = [u for u in unknown if u.startswith("-")] or unknown
        hint = difflib.get_close_matches(bad[0].split("=")[0], known, n=1)
        p.error(f"unknown option {bad[0]!r}" + (f"; did you mean {hint[0]}?" if hint else "") + " (--help lists every option)")
    given = vars(args)
    size, arch, moe = given.pop("size"), given.pop("arch"), given.pop("moe")
    if "alrs_range" in given:
        given["alrs_lo"], given["alrs_hi"] = given.pop("alrs_range")
    model_names = {f.name for f in fields(ModelConfig)}
    try:
        model_over = {k: v for k, v in given.items() if k in model_names}
        model_cfg = ModelConfig.from_preset(size, arch, **({**PAPER_MOE, **model_over} if moe else model_over))
        train_over = {k: v for k, v in given.items() if k not in model_names}
        train_over.setdefault("out_dir", f"out/{size}-{arch}{'-moe' if model_cfg.moe_experts else ''}-k{model_cfg.n_iter}")
        train_cfg = TrainConfig.from_preset(size, **train_over)
    except ValueError as e:
        p.error(str(e))
    try:
        result = train(model_cfg, train_cfg)
    except (ConfigError, DataError, CheckpointError, NonFiniteLossError, DistributedError, RunFolderError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a file system fault no check above names: the path, why and the fix, in one line
        sys.exit(f"error: {os_error_line(e)}")
    except KeyboardInterrupt:  # Ctrl-C during start-up (data preparation), or a second Ctrl-C: no traceback
        print(f"error: interrupted by Ctrl-C; {interrupted_state(train_cfg.out_dir)}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    if result["step"] < min(result["total_steps"], train_cfg.stop_step or math.inf):  # a signal stopped it, here or on another rank
        sys.exit(128 + signal.Signals[result["signal"] or "SIGTERM"])


if __name__ == "__main__":
    main()
