"""Where the repository's files are, whatever the working directory (a notebook, a script, a test, Colab)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the clone: this package is installed from it in editable mode
RESULTS = REPO / "notebooks" / "results"  # the committed experiment results the notebooks plot
OUT = REPO / "out"  # run folders (git-ignored)
DATA_CACHE = str(REPO / "data_cache")  # one prepared-data cache shared by the notebooks and the experiments
REPO_URL = "https://github.com/minimal-asymloop/minimal-asymloop"  # what the notebooks' Colab cell clones
