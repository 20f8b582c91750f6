"""Checkpoints: one self-contained folder per save, swapped in atomically.

    out_dir/ckpt_0000500/   model.safetensors  weights (safetensors: loading runs no code)
                            state.pt           optimizer, step, data position, RNG, lr-hook state, fp16 loss scale
                                               (loads with torch.load(weights_only=True))
                            meta.json          format_version, model + train config, step, val loss, data
                            tokenizer.json     so the folder alone can generate text
    out_dir/latest -> ckpt_0000500             symlinks, replaced atomically with os.replace
    out_dir/best   -> ckpt_0000500
    Older ckpt_* folders are deleted, except those at multiples of keep_every (--keep-every) when it is set.

A save writes a temp folder, fsyncs it, renames it into place and only then moves the `latest`
(and `best`) link, so a crash at any moment leaves `latest` pointing at a complete checkpoint.
"""

import errno
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from minimal_asymloop.model import LoopedLM, ModelConfig

FORMAT_VERSION = 1
DELAY_ENV = "MINIMAL_ASYMLOOP_CKPT_DELAY"  # test hook: seconds to sleep after each file and before the link moves
FILES = ("model.safetensors", "state.pt", "tokenizer.json", "meta.json")
EXPORT_FILES = ("model.safetensors", "config.json", "tokenizer.json")  # a model-only folder for the Hub (hub.py)


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, too new or incompatible; the message says which."""


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(link: Path, target: str):
    """Make `link` a symlink to `target` atomically (temp link, then os.replace)."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def save_checkpoint(out_dir, model: LoopedLM, state: dict, meta: dict, tokenizer: Tokenizer, best: bool = False,
                    keep_every: int | None = None) -> Path:
    """Write a checkpoint of `model` (unwrapped, not DDP/compiled) at meta['step']; move `latest` (and `best`);
    delete older checkpoints except those at multiples of keep_every."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"ckpt_{meta['step']:07d}"
    k = 1
    while (out_dir / name).exists():  # same step saved twice (rare): never touch a folder a link may use
        name, k = f"ckpt_{meta['step']:07d}.{k}", k + 1
    tmp = out_dir / f".tmp-{name}-{os.getpid()}"
    try:
        _write(tmp, out_dir, name, model, state, meta, tokenizer, best)
    except (OSError, RuntimeError, SafetensorError) as e:  # disk full, quota, permissions (torch.save wraps OSError in RuntimeError)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_write_failure(out_dir, name, e)) from None
    _collect_garbage(out_dir, keep_every)
    return out_dir / name


def _write_failure(out_dir: Path, name: str, e: Exception) -> str:
    code = getattr(e, "errno", None)
    if code is None and (m := re.search(r"os error (\d+)", str(e))):  # safetensors reports the OS error in its message
        code = int(m.group(1))
    why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded", errno.EFBIG: "a file size limit was hit",
           errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "the file system is read-only"}.get(
        code, f"{type(e).__name__}: {' '.join(str(e).split())}")
    latest = out_dir / "latest"
    kept = f"the previous checkpoint {latest.resolve().name} is intact" if latest.exists() else "no earlier checkpoint exists"
    return (f"could not write checkpoint {name} to {out_dir}: {why}; {kept}; free disk space or fix --out-dir's permissions, "
            f"then continue with --resume")


def _write(tmp: Path, out_dir: Path, name: str, model: LoopedLM, state: dict, meta: dict, tokenizer: Tokenizer, best: bool):
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    weights = {n: t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    meta = {"format_version": FORMAT_VERSION, **meta, "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    writers = {
        "model.safetensors": lambda p: save_file(weights, str(p), metadata={"format": "pt"}),
        "state.pt": lambda p: torch.save(state, p),
        "tokenizer.json": lambda p: tokenizer.save(str(p)),
        "meta.json": lambda p: p.write_text(json.dumps(meta, indent=1)),
    }
    for fname in FILES:
        writers[fname](tmp / fname)
        _fsync(tmp / fname)
        if delay:
            time.sleep(delay)
    _fsync(tmp)
    os.rename(tmp, out_dir / name)
    _fsync(out_dir)
    if delay:  # a kill here leaves a complete folder that `latest` does not point at yet
        time.sleep(delay)
    _point(out_dir / "latest", name)
    if best:
        _point(out_dir / "best", name)


def _collect_garbage(out_dir: Path, keep_every: int | None = None):
    """Delete checkpoints no link points at (except ckpt_NNNNNNN at multiples of keep_every), and temp folders
    left by killed writers."""
    keep = {(out_dir / link).resolve().name for link in ("latest", "best") if (out_dir / link).is_symlink()}
    if keep_every:
        keep |= {p.name for p in out_dir.glob("ckpt_*") if re.fullmatch(r"ckpt_\d{7}", p.name) and int(p.name[5:]) % keep_every == 0}
    for p in out_dir.iterdir():
        stale_tmp = p.name.startswith(".tmp-ckpt_") and not p.name.endswith(f"-{os.getpid()}")
        if (p.name.startswith("ckpt_") and p.name not in keep) or stale_tmp:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- loading


def find_checkpoint(path) -> Path:
    """A checkpoint folder from either itself or a run's out_dir (then its `latest`)."""
    path = Path(path)
    if (path / "meta.json").exists() or (path / "model.safetensors").exists():
        return path.resolve()  # `latest`/`best` resolve to the real folder: files are read from one checkpoint
    if (path / "latest").exists():
        return (path / "latest").resolve()
    if (path / "latest").is_symlink():
        raise CheckpointError(f"{path}/latest points at a missing folder; the run's checkpoints were deleted or moved")
    raise CheckpointError(f"no checkpoint at {path}: expected a checkpoint folder (with meta.json), a run's out_dir with a "
                          f"'latest' checkpoint, an exported folder (with config.json) or a Hub repo id (hf:owner/name); "
                          f"train one with `python train_minimal.py --out-dir {path}`")


def read_meta(path) -> dict:
    """meta.json of a training checkpoint, or config.json of a model-only export (hub.py), checked."""
    ckpt = find_checkpoint(path)
    export = (ckpt / "config.json").exists() and not (ckpt / "meta.json").exists()  # weights, config and tokenizer only
    name, needed = ("config.json", EXPORT_FILES) if export else ("meta.json", FILES)
    missing = [f for f in needed if not (ckpt / f).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
    try:
        meta = json.loads((ckpt / name).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is not valid JSON ({e})") from None
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} has no format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format_version {version}, newer than this code's {FORMAT_VERSION}; "
                              f"update minimal-asymloop to load it")
    meta["path"] = str(ckpt)
    return meta


def model_config_from_meta(meta: dict) -> ModelConfig:
    try:
        return ModelConfig(**meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {meta.get('path')} has a model config this code cannot build ({e})") from None


def load_weights(model: LoopedLM, ckpt: Path):
    try:
        weights = load_file(str(ckpt / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt or truncated: model.safetensors cannot be read ({e})") from None
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [f"{n} {tuple(weights[n].shape)} vs {tuple(own[n].shape)}" for n in own if n in weights and weights[n].shape != own[n].shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"checkpoint {ckpt} does not match its model config: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}, shape mismatches {shapes[:4]}")
    model.load_state_dict(weights)


def load_model(path, device="cpu") -> tuple[LoopedLM, Tokenizer, dict]:
    """(model in eval mode on `device`, tokenizer, meta) from a checkpoint folder, a run's out_dir, an export,
    or a Hugging Face Hub repo id (`owner/name` or `hf:owner/name`; the rule is in hub.py)."""
    repo = hub_repo_id(path)
    meta = read_meta(resolve(path))
    if repo:
        meta["hub_repo"] = repo
    ckpt = Path(meta["path"])
    model = LoopedLM(model_config_from_meta(meta))
    load_weights(model, ckpt)
    try:
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: tokenizer.json cannot be read ({e})") from None
    return model.to(device).eval(), tokenizer, meta


def load_state(path) -> dict:
    """The training state (optimizer, step, RNG, ...) of a checkpoint; never unpickles code."""
    ckpt = find_checkpoint(path)
    if not (ckpt / "state.pt").exists():
        raise CheckpointError(f"checkpoint {ckpt} has no state.pt (an export holds the model only); resuming needs a "
                              f"training checkpoint, a run's out_dir")
    try:
        return torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle opcode, forbidden global: all mean "corrupt"
        if "Unsupported global" in str(e):  # a pickled call (code) that weights_only refused to run
            raise CheckpointError(f"refused to load {ckpt}/state.pt: it contains pickled code, which is never run (it may be "
                                  f"malicious or not written by this trainer); resume from a checkpoint you trust") from None
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: state.pt cannot be loaded ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None


HUB_PREFIX = "hf:"
ALLOW = ["*.safetensors", "*.json"]  # weights, config, tokenizer: data only, never code or pickles
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name, as the Hub spells repo ids


# ----------------------------------------------------------------------------- --ckpt: a local path or a Hub repo


def hub_repo_id(spec: str) -> str | None:
    """The Hub repo id that `spec` names, or None when it names a local path (the rule in the module doc)."""
    spec = str(spec)
    if spec.startswith(HUB_PREFIX):
        repo = spec[len(HUB_PREFIX):].lstrip("/")  # hf:owner/name or hf://owner/name
        if not REPO_ID.fullmatch(repo):
            raise CheckpointError(f"{spec!r} is not a Hub repo id: write hf:owner/name")
        return repo
    if Path(spec).expanduser().exists() or not REPO_ID.fullmatch(spec) or Path(spec.split("/")[0]).is_dir():
        return None
    return spec


def resolve(spec) -> Path:
    """A local folder for --ckpt `spec`: itself when local, else a download of the Hub repo's weights and JSON."""
    repo = hub_repo_id(spec)
    if repo is None:
        path = Path(spec).expanduser()
        if not path.exists() and REPO_ID.fullmatch(str(spec)):  # owner/name whose owner is a local folder
            raise CheckpointError(f"no checkpoint at {spec}: read as a local path because ./{str(spec).split('/')[0]} is a "
                                  f"folder; for the Hub repo {spec} write hf:{spec}")
        return path
    if not str(spec).startswith(HUB_PREFIX):  # say which reading was taken: a typo'd local path must not pass unnoticed
        print(f"{spec}: no local folder of that name; loading the Hugging Face Hub repo {repo} "
              f"(write ./{spec} for a local path)", file=sys.stderr)
    return download(repo)


def download(repo: str) -> Path:
    """The Hub repo's *.safetensors and *.json in the local Hugging Face cache (fetched once); fails fast offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError  # where 0.24 and 2.x both have them

    from minimal_asymloop.sources import hub_offline_reason

    offline = hub_offline_reason(f"the model {repo}")  # None when reachable; else offline mode, and the cache still serves
    try:
        return Path(snapshot_download(repo, allow_patterns=ALLOW))
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise CheckpointError(f"the Hugging Face Hub has no model repo {repo} that you can read ({type(e).__name__}); check "
                              f"the name, or log in with `hf auth login` for a private or gated repo") from None
    except (OSError, ValueError) as e:  # LocalEntryNotFoundError (not cached, offline), connection errors, invalid ids
        why = offline or f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise CheckpointError(f"cannot load {repo}: {why}, and it is not in the local Hugging Face cache; run once with the "
                              f"Hub reachable, or pass a local folder (an export or a run's out_dir)") from None
