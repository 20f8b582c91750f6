"""One run per folder, and file-system errors said in one line.

`hold(out_dir, kind)` is held for a whole training or fine-tuning run: an exclusive `fcntl.flock` on out_dir/.lock,
which holds the pid and the kind of run. The OS releases it when the process exits in any way, kill -9 included, so
a stale lock never blocks a resume; a second run into the same folder is refused at once, naming the holder's pid.
A folder keeps its kind: fine-tuning refuses a pretraining run's folder and the other way round.

`os_error_line(e, ...)` turns an OSError (permissions, a full disk, a file where a folder should be) into
"<what> <path>: <why>; <fix>".
"""

import errno
import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

from minimal_asymloop.system import ConfigError, check_out_dir

LOCK = ".lock"
KINDS = ("pretraining", "fine-tuning")


class RunFolderError(RuntimeError):
    """A run folder in use by another run, of another kind, or a file-system error; the message says what to do."""


# errno -> (why, fix)
WHY = {
    errno.ENOSPC: ("the disk is full", "free disk space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EFBIG: ("a file size limit was hit", "raise the limit (ulimit -f) or free space"),
    errno.EACCES: ("permission denied", "fix the permissions (chmod/chown) or choose another path"),
    errno.EPERM: ("permission denied", "fix the permissions (chmod/chown) or choose another path"),
    errno.EROFS: ("the file system is read-only", "choose a path on a writable file system"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose a path whose parents are folders"),
    errno.EISDIR: ("it is a folder, not a file", "give a file path"),
    errno.EEXIST: ("it exists and is not a folder", "choose another path or remove it"),
    errno.ENOENT: ("no such file or folder", "check the path"),
    errno.EIO: ("an I/O error (failing disk or network file system)", "check the disk and retry"),
}


def why_and_fix(e: BaseException) -> tuple[str, str]:
    """(why, fix) for an OSError; other errors: (their text in one line, 'see the message')."""
    code = getattr(e, "errno", None)
    if code in WHY:
        return WHY[code]
    text = getattr(e, "strerror", None) or " ".join(str(e).split())
    return f"{type(e).__name__}: {text}", "see the message"


def os_error_line(e: OSError, what: str = "cannot use") -> str:
    """One line for an OSError: '<what> <path>: <why>; <fix>'."""
    why, fix = why_and_fix(e)
    path = e.filename if getattr(e, "filename", None) is not None else "a file"
    return f"{what} {path}: {why}; {fix}"


@contextmanager
def naming(path):
    """Give an OSError raised inside the block the path it happened on, when it has none (a write that hits a full
    disk reports ENOSPC without a file name), so that os_error_line can say where."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def after_write_failure(out_dir: Path, fix: str) -> str:
    """What a failed write leaves and what to do, the same words for a checkpoint and for metrics.jsonl."""
    latest = out_dir / "latest"
    if latest.exists():
        return f"the previous checkpoint {latest.resolve().name} is intact; {fix}, then continue with --resume"
    return f"no earlier checkpoint exists, so there is nothing to resume; {fix}, then start the run again"


def folder_kind(out_dir: Path) -> str | None:
    """The kind of run a folder holds: from its lock file, else from its latest checkpoint, else None (a new folder)."""
    try:
        kind = json.loads((out_dir / LOCK).read_text()).get("kind")
        if kind in KINDS:
            return kind
    except (OSError, ValueError, AttributeError):
        pass
    try:
        meta = json.loads((out_dir / "latest" / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return "fine-tuning" if isinstance(meta, dict) and "finetune" in meta else "pretraining"


@contextmanager
def hold(out_dir, kind: str, enabled: bool = True):
    """Hold out_dir for one run of `kind` (pretraining or fine-tuning) until the block ends. enabled=False (DDP ranks
    other than 0) holds nothing."""
    if not enabled:
        yield
        return
    out_dir = Path(out_dir)
    try:
        check_out_dir(out_dir)  # creates it; an unwritable path fails here in one line
    except ConfigError as e:
        raise RunFolderError(str(e)) from None
    other = folder_kind(out_dir)
    if other is not None and other != kind:
        hint = "fine-tune into a new --out-dir" if kind == "fine-tuning" else "pretrain into a new --out-dir"
        raise RunFolderError(f"--out-dir {out_dir} holds a {other} run; {kind} there would overwrite its metrics.jsonl and "
                             f"checkpoints; {hint}")
    fd = os.open(out_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise RunFolderError(f"--out-dir {out_dir} is in use by another run (pid {holder}); wait for it to finish or stop it "
                                 f"(kill {holder}), or choose another --out-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dict(pid=os.getpid(), kind=kind)).encode() + b"\n", 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays, naming the folder's kind


def _holder(fd: int) -> str:
    """The pid holding the flock on fd's file: from the kernel's lock table (Linux), since the pid written in the file can
    be a stale one's when another process holds the lock; else the one the file names."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:  # "1: FLOCK  ADVISORY  WRITE 4242 00:2e:1234 0 EOF"; waiters have "->"
            for parts in (line.split() for line in f):
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].split(":") == [
                        f"{os.major(st.st_dev):02x}", f"{os.minor(st.st_dev):02x}", str(st.st_ino)]:
                    return parts[4]
    except (OSError, ValueError, IndexError):
        pass
    try:
        return str(json.loads(os.pread(fd, 4096, 0).decode()).get("pid", "unknown"))
    except (OSError, ValueError, AttributeError):
        return "unknown"
