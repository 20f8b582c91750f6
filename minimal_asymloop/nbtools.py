"""Execute the teaching notebooks in place, as CI's nbval run will, and keep their committed JSON free of churn.

    python -m minimal_asymloop.nbtools run notebooks/00_tour.ipynb   # execute in place (inline figures), strip, time it
    python -m minimal_asymloop.nbtools strip notebooks/*.ipynb       # only remove the volatile metadata
    python -m minimal_asymloop.nbtools check notebooks/*.ipynb       # exit 1 if any notebook carries volatile metadata

A notebook is run from a temporary working directory, so a path that only works from notebooks/ fails here first.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

CELL_VOLATILE = ("execution", "collapsed", "scrolled", "ExecuteTime")  # timestamps and UI state: they change every run
NB_VOLATILE = ("widgets",)


def volatile(nb: dict) -> list[str]:
    """Where a notebook carries metadata that changes from run to run (an empty list: none)."""
    found = [f"cell {i}: {k}" for i, c in enumerate(nb["cells"]) for k in CELL_VOLATILE if k in c.get("metadata", {})]
    found += [f"notebook: {k}" for k in NB_VOLATILE if k in nb.get("metadata", {})]
    if "version" in nb.get("metadata", {}).get("language_info", {}):
        found.append("notebook: language_info.version")
    return found


def strip(nb: dict) -> dict:
    for c in nb["cells"]:
        for k in CELL_VOLATILE:
            c.get("metadata", {}).pop(k, None)
    for k in NB_VOLATILE:
        nb.get("metadata", {}).pop(k, None)
    nb.get("metadata", {}).get("language_info", {}).pop("version", None)
    return nb


def write(path: Path, nb: dict):
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def run(path: Path, timeout: int = 900) -> float:
    """Execute `path` top to bottom with the inline backend from a temporary directory; write it back stripped."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_backend = os.environ.pop("MPLBACKEND", None)  # the inline backend stores each figure in its cell
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory() as cwd:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    finally:
        if env_backend is not None:
            os.environ["MPLBACKEND"] = env_backend
    seconds = time.time() - t0
    write(path, strip(json.loads(nbformat.writes(nb))))
    return seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run", "strip", "check"))
    p.add_argument("paths", nargs="+", type=Path)
    args = p.parse_args(argv)
    bad = 0
    for path in args.paths:
        if args.command == "run":
            print(f"{path}: {run(path):.0f} s", flush=True)
        elif args.command == "strip":
            write(path, strip(json.loads(path.read_text())))
        elif found := volatile(json.loads(path.read_text())):
            bad += 1
            print(f"{path}: volatile metadata at {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}; "
                  f"python -m minimal_asymloop.nbtools strip {path}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
