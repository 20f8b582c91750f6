"""Checksums of every byte a run depends on: one manifest.json per checkpoint folder and per prepared data folder.

    folder/manifest.json   {"format": 1, "hash": "xxh3_128", "files": {"meta.json": "xxh3_128:<hex>", ...}}

The manifest is written last, after every file it lists is on disk, and covers meta.json too: a changed byte anywhere,
the manifest itself included, is caught before the file is used (a changed manifest no longer matches its files).
It catches disk, copy and transfer errors, not forgery: anyone who can write a file can rewrite the manifest, which is
why state.pt is also loaded with `weights_only=True`.

    python -m minimal_asymloop.integrity PATH   # give the checkpoints saved before manifests (format_version 1) in PATH
                                                # (a checkpoint, a run's out_dir or a folder of runs) their manifests
"""

import json
import os
import sys
from pathlib import Path

import xxhash

from minimal_asymloop.runfolder import naming, os_error_line

MANIFEST = "manifest.json"
CHECKSUM = "xxh3_128"  # (ours) ~10x sha256's speed on one core (docs/reliability.md)


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, too new or incompatible; the message says which."""


def file_checksum(path) -> str:
    """`xxh3_128:<hex>` of a file's bytes, read in 16 MiB chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return f"{CHECKSUM}:{h.hexdigest()}"


def write_manifest(folder, names):
    """Record the checksum of each of `names` in folder/manifest.json (atomically, fsynced)."""
    folder = Path(folder)
    files = {n: file_checksum(folder / n) for n in names}
    tmp = folder / f".{MANIFEST}.tmp"
    with naming(tmp), open(tmp, "w") as f:
        f.write(json.dumps(dict(format=1, hash=CHECKSUM, files=files), indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder, error=CheckpointError, what: str = "checkpoint") -> dict:
    """{file name: checksum} from folder/manifest.json, or `error` in one line (missing: FileNotFoundError)."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest.get("files") if manifest.get("format") == 1 and manifest.get("hash") == CHECKSUM else None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(os_error_line(e, "cannot read")) from None
    except (ValueError, AttributeError) as e:
        raise error(f"{what} {folder} is corrupt: {MANIFEST} is not a valid manifest ({type(e).__name__}: {e})") from None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise error(f"{what} {folder} is corrupt: {MANIFEST} is not a valid manifest (format 1, hash {CHECKSUM} and a 'files' "
                    f"object of checksums)")
    return files


def verify(folder, names, error=CheckpointError, what: str = "checkpoint") -> None:
    """Raise `error` naming the first of `names` that the manifest does not list or whose bytes differ from it."""
    folder = Path(folder)
    try:
        files = read_manifest(folder, error, what)
    except FileNotFoundError:
        raise error(f"{what} {folder} has no {MANIFEST}; it cannot be verified") from None
    for name in names:
        if name not in files:
            raise error(f"{what} {folder} is corrupt: {name} is not listed in its {MANIFEST} (a damaged manifest)")
        try:
            got = file_checksum(folder / name)
        except OSError as e:
            raise error(os_error_line(e, f"cannot read {what} file")) from None
        if got != files[name]:
            raise error(f"{what} {folder} is corrupt: {name} does not match the checksum in {MANIFEST} (its bytes changed "
                        f"after it was written: a disk, copy or transfer error)")


def upgrade(folder) -> list[str]:
    """Write the manifest of a format_version 1 checkpoint: its weights, state and tokenizer checked against the checksums
    its meta.json recorded; meta.json itself taken as it is (the user vouches for it). Returns the files covered."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    sums = meta.get("checksums") or {}
    names = ["model.safetensors", "state.pt", "tokenizer.json"]
    for name in names:
        if name in sums and file_checksum(folder / name) != sums[name]:
            raise CheckpointError(f"checkpoint {folder} is corrupt: {name} does not match the checksum in meta.json; no manifest written")
    write_manifest(folder, [*names, "meta.json"])
    return [*names, "meta.json"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit("usage: python -m minimal_asymloop.integrity PATH   (a checkpoint folder, a run's out_dir or a folder of runs)")
    root = Path(argv[0])
    old = sorted({m.parent for m in [root / "meta.json", *root.rglob("meta.json")]
                  if m.is_file() and (m.parent / "state.pt").exists() and not (m.parent / MANIFEST).exists()})
    if not old:
        sys.exit(f"error: no checkpoint without a {MANIFEST} under {root}")
    for folder in old:
        try:
            names = upgrade(folder)
        except (CheckpointError, OSError, ValueError) as e:
            sys.exit(f"error: {e}")
        print(f"wrote {folder / MANIFEST} covering {', '.join(names)}")


if __name__ == "__main__":
    main()
