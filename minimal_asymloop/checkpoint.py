"""Checkpoints: one self-contained folder per save, swapped in atomically.

    out_dir/ckpt_0000500/   model.safetensors  weights (safetensors: loading runs no code)
                            state.pt           optimizer, step, data position, RNG, lr-hook state, fp16 loss scale
                                               (loads with torch.load(weights_only=True))
                            meta.json          format_version, model + train config, step, val loss, data
                            tokenizer.json     so the folder alone can generate text
                            metrics.jsonl      the run's metrics up to this step: --resume restores them from here
                            manifest.json      the checksum (xxh3-128) of every file above, meta.json included (integrity.py)
    out_dir/latest -> ckpt_0000500             symlinks, replaced atomically with os.replace
    out_dir/best   -> ckpt_0000500
    Older ckpt_* folders are deleted, except those at multiples of keep_every (--keep-every) when it is set.

A save writes a temp folder, fsyncs it, renames it into place and only then moves the `latest`
(and `best`) link, so a crash at any moment leaves `latest` pointing at a complete checkpoint. Loading verifies
each file against the manifest before using it; `--resume` falls back past a corrupt `latest` (a damaged meta.json
included) to the newest intact checkpoint. A checkpoint without a manifest (format_version 1, before meta.json was
checksummed) is refused in one line naming the command that adds one.
"""

import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from minimal_asymloop import integrity
from minimal_asymloop.config import RESUME_MAY_CHANGE
from minimal_asymloop.integrity import MANIFEST, CheckpointError, file_checksum  # noqa: F401 (re-exported)
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.runfolder import after_write_failure, os_error_line, why_and_fix
from minimal_asymloop.system import ConfigError

FORMAT_VERSION = 2  # 2: manifest.json covers every file, meta.json included; 1: meta.json held the others' checksums
DELAY_ENV = "MINIMAL_ASYMLOOP_CKPT_DELAY"  # test hook: seconds to sleep after each file and before the link moves
FILES = ("model.safetensors", "state.pt", "tokenizer.json", "meta.json", MANIFEST)
METRICS = "metrics.jsonl"  # the run's metrics.jsonl as it was at the save (a copy; a fine-tuning save has one too)
EXPORT_FILES = ("model.safetensors", "config.json", "tokenizer.json")  # a model-only folder for the Hub (hub.py)


class UnsafeCheckpointError(CheckpointError):
    """A state.pt whose unpickling would run code or build objects a checkpoint never holds: refused, never a fallback."""


# ----------------------------------------------------------------------------- checksums


def verify(ckpt: Path, meta: dict | None, names) -> None:
    """Raise CheckpointError naming the first of `names` whose bytes differ from the checkpoint's manifest.json. A
    model-only export (hub.py) has no manifest: its config.json holds the checksums of the files it has them for."""
    if not (ckpt / "meta.json").exists() and (ckpt / "config.json").exists():
        sums = (meta if meta is not None else read_meta(ckpt)).get("checksums") or {}
        for name in (n for n in names if n in sums):
            if file_checksum(ckpt / name) != sums[name]:
                raise CheckpointError(f"export {ckpt} is corrupt: {name} does not match the checksum in config.json (its bytes "
                                      f"changed after it was written: a disk, copy or transfer error)")
        return
    integrity.verify(ckpt, names)


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(link: Path, target: str):
    """Make `link` a symlink to `target` atomically (temp link, then os.replace). A real folder there is a copy made by
    following links (cp -rL, scp -r) of a checkpoint the run's ckpt_* folders also hold: it is replaced."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def save_checkpoint(out_dir, model: LoopedLM, state: dict, meta: dict, tokenizer: Tokenizer, best: bool = False,
                    keep_every: int | None = None) -> Path:
    """Write a checkpoint of `model` (unwrapped, not DDP/compiled) at meta['step']; move `latest` (and `best`);
    delete older checkpoints except those at multiples of keep_every."""
    out_dir = Path(out_dir)
    name = f"ckpt_{meta['step']:07d}"
    k = 1
    while (out_dir / name).exists():  # same step saved twice (rare): never touch a folder a link may use
        name, k = f"ckpt_{meta['step']:07d}.{k}", k + 1
    tmp = out_dir / f".tmp-{name}-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write(tmp, out_dir, name, model, state, meta, tokenizer, best)
    except (OSError, RuntimeError, SafetensorError) as e:  # disk full, quota, permissions (torch.save wraps OSError in RuntimeError)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_write_failure(out_dir, name, e)) from None
    _collect_garbage(out_dir, keep_every)
    return out_dir / name


def _write_failure(out_dir: Path, name: str, e: Exception) -> str:
    cause = e
    while getattr(cause, "errno", None) is None and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__  # torch.save wraps the OSError of its file in a RuntimeError
    if getattr(cause, "errno", None) is None and (m := re.search(r"os error (\d+)", str(e))):  # safetensors: in its message
        cause = OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    why, fix = why_and_fix(cause if getattr(cause, "errno", None) is not None else e)
    return f"could not write checkpoint {name} to {out_dir}: {why}; {after_write_failure(out_dir, fix)}"


def _write(tmp: Path, out_dir: Path, name: str, model: LoopedLM, state: dict, meta: dict, tokenizer: Tokenizer, best: bool):
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    weights = {n: t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    meta = {"format_version": FORMAT_VERSION, **meta, "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    metrics = out_dir / METRICS
    writers = {
        "model.safetensors": lambda p: save_file(weights, str(p), metadata={"format": "pt"}),
        "state.pt": lambda p: _torch_save(state, p),
        "tokenizer.json": lambda p: tokenizer.save(str(p)),
        "meta.json": lambda p: p.write_text(json.dumps(meta, indent=1)),
        METRICS: lambda p: shutil.copyfile(metrics, p) if metrics.exists() else p.write_bytes(b""),
    }
    for fname, write in writers.items():
        write(tmp / fname)
        _fsync(tmp / fname)
        if delay:
            time.sleep(delay)
    integrity.write_manifest(tmp, list(writers))  # last: it covers every file above
    _fsync(tmp)
    os.rename(tmp, out_dir / name)
    _fsync(out_dir)
    if delay:  # a kill here leaves a complete folder that `latest` does not point at yet
        time.sleep(delay)
    _point(out_dir / "latest", name)
    if best:
        _point(out_dir / "best", name)


def _torch_save(obj, path: Path):
    """torch.save through a Python file: an OSError (a full disk) is then chained to torch's RuntimeError."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _collect_garbage(out_dir: Path, keep_every: int | None = None):
    """Delete checkpoints no link points at (except the newest save of each step at a multiple of keep_every), and temp
    folders left by killed writers."""
    keep = {(out_dir / link).resolve().name for link in ("latest", "best") if (out_dir / link).is_symlink()}
    if keep_every:
        newest = {}  # step -> the newest save of it (ckpt_0000020.1 replaces a corrupt ckpt_0000020 after a fallback)
        for p in sorted(out_dir.glob("ckpt_*"), key=_by_step):
            if _by_step(p)[0] > 0 and _by_step(p)[0] % keep_every == 0:
                newest[_by_step(p)[0]] = p.name
        keep |= set(newest.values())
    for p in out_dir.iterdir():
        stale_tmp = p.name.startswith(".tmp-ckpt_") and not p.name.endswith(f"-{os.getpid()}")
        if (p.name.startswith("ckpt_") and p.name not in keep) or stale_tmp:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- loading


def find_checkpoint(path) -> Path:
    """A checkpoint folder from either itself or a run's out_dir (then its `latest`)."""
    path = Path(path)
    try:
        if (path / "meta.json").exists() or (path / "model.safetensors").exists():
            return path.resolve()  # `latest`/`best` resolve to the real folder: files are read from one checkpoint
        if (path / "latest").exists():
            return (path / "latest").resolve()
        dangling = (path / "latest").is_symlink()
    except OSError as e:
        raise CheckpointError(os_error_line(e, 'cannot read checkpoint file')) from None
    if dangling:
        raise CheckpointError(f"{path}/latest points at a missing folder; the run's checkpoints were deleted or moved")
    raise CheckpointError(f"no checkpoint at {path}: expected a checkpoint folder (with meta.json), a run's out_dir with a "
                          f"'latest' checkpoint, an exported folder (with config.json) or a Hub repo id (hf:owner/name); "
                          f"train one with `python train_minimal.py --out-dir {path}`")


# meta.json fields whose type is checked on load: a wrong type is a corrupt file, not a traceback later
META_TYPES = {"model_config": dict, "train_config": dict, "data": dict, "checksums": dict, "step": int, "finetune": dict}


def read_meta(path) -> dict:
    """meta.json of a training checkpoint, or config.json of a model-only export (hub.py), checked."""
    ckpt = find_checkpoint(path)
    try:
        export = (ckpt / "config.json").exists() and not (ckpt / "meta.json").exists()  # weights, config and tokenizer only
        name, needed = ("config.json", EXPORT_FILES) if export else ("meta.json", FILES)
        missing = [f for f in needed if not (ckpt / f).exists()]
        if missing == [MANIFEST]:
            _refuse_without_manifest(ckpt)
        if missing:
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
        if not export:
            verify(ckpt, None, ["meta.json"])  # before a byte of it is used
        meta = json.loads((ckpt / name).read_text())
    except OSError as e:
        raise CheckpointError(os_error_line(e, 'cannot read checkpoint file')) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} holds a {type(meta).__name__}, not an object")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} has no format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format_version {version}, newer than this code's {FORMAT_VERSION}; "
                              f"update minimal-asymloop to load it")
    for key, kind in META_TYPES.items():
        if key in meta and meta[key] is not None and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} field {key!r} should be a JSON "
                                  f"{'object' if kind is dict else 'integer'}, got {json.dumps(meta[key])[:40]}")
    if "model_config" not in meta:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} has no model_config")
    meta["path"] = str(ckpt)
    return meta


def _refuse_without_manifest(ckpt: Path):
    """A checkpoint saved before manifests (format_version 1): its meta.json cannot be verified, so it is not used."""
    try:
        version = json.loads((ckpt / "meta.json").read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        version = None
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format_version {version}, newer than this code's {FORMAT_VERSION}; "
                              f"update minimal-asymloop to load it")
    raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST}: it was saved before meta.json was checksummed (format_version 1), "
                          f"so its meta.json cannot be verified; if you trust it, add one with "
                          f"`python -m minimal_asymloop.integrity {ckpt}`")


def model_config_from_meta(meta: dict) -> ModelConfig:
    try:
        return ModelConfig(**meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {meta.get('path')} has a model config this code cannot build ({e})") from None


def read_weights(ckpt: Path, meta: dict | None = None) -> dict:
    """model.safetensors as tensors, verified: its checksum (when meta has one), readable, every value finite."""
    if meta is not None:
        verify(ckpt, meta, ["model.safetensors"])
    try:
        weights = load_file(str(ckpt / "model.safetensors"))
    except OSError as e:
        raise CheckpointError(os_error_line(e, 'cannot read checkpoint file')) from None
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt or truncated: model.safetensors cannot be read ({e})") from None
    if weights and all(n.startswith("model.") for n in weights):  # an export's transformers names (hub.py): our names inside
        weights = {n.removeprefix("model."): t for n, t in weights.items()}
    bad = next((n for n, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: its weights hold inf/NaN values (first in {bad}); a run never "
                              f"saves them, so the file was damaged or written by other code")
    return weights


def load_weights(model: LoopedLM, ckpt: Path, meta: dict | None = None):
    """Load a checkpoint's weights into `model`, verified (read_weights); meta: the checkpoint's (read when not given)."""
    weights = read_weights(ckpt, meta if meta is not None else read_meta(ckpt))
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [f"{n} {tuple(weights[n].shape)} vs {tuple(own[n].shape)}" for n in own if n in weights and weights[n].shape != own[n].shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"checkpoint {ckpt} does not match its model config: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}, shape mismatches {shapes[:4]}")
    model.load_state_dict(weights)


def load_model(path, device="cpu") -> tuple[LoopedLM, Tokenizer, dict]:
    """(model in eval mode on `device`, tokenizer, meta) from a checkpoint folder, a run's out_dir, an export,
    or a Hugging Face Hub repo id (`owner/name` or `hf:owner/name`; the rule is in hub.py). Every file is verified
    against its checksum."""
    repo = hub_repo_id(path)
    meta = read_meta(resolve(path))
    if repo:
        meta["hub_repo"] = repo
    ckpt = Path(meta["path"])
    model = LoopedLM(model_config_from_meta(meta))
    load_weights(model, ckpt, meta)
    verify(ckpt, meta, ["tokenizer.json"])
    try:
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: tokenizer.json cannot be read ({e})") from None
    return model.to(device).eval(), tokenizer, meta


def load_state(path, meta: dict | None = None) -> dict:
    """The training state (optimizer, step, RNG, ...) of a checkpoint, verified; never unpickles code."""
    ckpt = find_checkpoint(path)
    if not (ckpt / "state.pt").exists():
        raise CheckpointError(f"checkpoint {ckpt} has no state.pt (an export holds the model only); resuming needs a "
                              f"training checkpoint, a run's out_dir")
    verify(ckpt, meta if meta is not None else read_meta(ckpt), ["state.pt"])
    try:
        return torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(os_error_line(e, 'cannot read checkpoint file')) from None
    except Exception as e:  # truncated zip, bad pickle opcode, forbidden global
        if "Weights only load failed" in str(e):  # a pickled call or class that weights_only refused; torch's advice is not ours
            raise UnsafeCheckpointError(f"refused to load {ckpt}/state.pt: it contains pickled code or objects, which are never "
                                        f"run (it may be malicious or not written by this trainer); resume from a checkpoint "
                                        f"you trust") from None
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: state.pt cannot be loaded ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None


# ----------------------------------------------------------------------------- --resume: the newest intact checkpoint


def _by_step(p: Path) -> tuple[int, int]:
    m = re.fullmatch(r"ckpt_(\d{7})(?:\.(\d+))?", p.name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (-1, -1)


def newest_intact(out_dir, say=print) -> tuple[dict, dict]:
    """(meta, state) of the checkpoint to resume from: `latest` when intact (every file matches its checksum and loads),
    else the newest intact one of the others, said in one line. With none intact, one line naming the first fault."""
    out_dir = Path(out_dir)
    latest = out_dir / "latest"
    try:
        first = [latest.resolve()] if latest.is_symlink() else []
        others = sorted((p for p in out_dir.glob("ckpt_*") if _by_step(p)[0] >= 0 and p.is_dir()), key=_by_step, reverse=True)
    except OSError as e:
        raise CheckpointError(os_error_line(e, 'cannot read checkpoint file')) from None
    candidates = first + [p for p in others if p not in first]
    if not candidates:
        find_checkpoint(out_dir)  # the usual "no checkpoint at ..." line
        raise CheckpointError(f"no checkpoint to resume in {out_dir}: it holds checkpoint files but no 'latest' link and no "
                              f"ckpt_* folder of a run; start without --resume, or point --out-dir at a run's folder")
    faults = []
    for folder in candidates:
        try:
            meta = read_meta(folder)
            verify(folder, meta, ["model.safetensors", "tokenizer.json", *([METRICS] if (folder / METRICS).exists() else [])])
            state = load_state(folder, meta)
            read_weights(folder)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            faults.append((folder, str(e)))
            continue
        if faults:
            say(f"note: {faults[0][1]}; resuming from {folder.name} (step {meta.get('step')}), the newest intact checkpoint")
        return meta, state
    if first and not first[0].exists():
        faults.insert(0, (first[0], f"{latest} points at a missing folder; the run's checkpoints were deleted or moved"))
    raise CheckpointError(f"{faults[0][1]}; no intact checkpoint to fall back on in {out_dir} "
                          f"({len(candidates)} checked: {', '.join(p.name for p in candidates)})")


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


def check_resume(meta: dict, model_cfg: ModelConfig, cfg, data_meta: dict | None = None):
    """Refuse a resume whose model, training settings (but those RESUME_MAY_CHANGE) or data differ from the checkpoint's
    (data_meta None: before the data is prepared, the settings only)."""
    diffs = [f"{k}: {v!r} -> {model_cfg.to_dict().get(k)!r}" for k, v in meta["model_config"].items() if model_cfg.to_dict().get(k) != v]
    now = asdict(cfg)
    diffs += [f"{k}: {v!r} -> {now.get(k)!r}" for k, v in meta["train_config"].items()
              if k not in RESUME_MAY_CHANGE and now.get(k) != v]
    if data_meta is not None and meta.get("data", {}).get("identity") != data_meta["identity"]:
        diffs.append(f"data: {meta.get('data', {}).get('identity')} -> {data_meta['identity']}")
    if diffs:
        raise ConfigError(f"cannot resume from {meta['path']}: the config differs from the checkpoint's ({'; '.join(diffs)}); "
                          f"resume with the same settings, or start a fresh run with a new --out-dir")
