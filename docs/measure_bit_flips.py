"""Flip every bit of a checkpoint's meta.json and manifest.json, one at a time, and count how many loads are refused
(docs/reliability.md). `read_meta` is what sample, evaluate, finetune, hub export and --resume call first.

    python train_minimal.py --max-steps 2 --eval-interval 2 --out-dir /tmp/flip_run   # any run's out_dir will do
    python docs/measure_bit_flips.py /tmp/flip_run                                     # ~2 minutes on a loaded CPU
"""

import shutil
import sys
import tempfile
from pathlib import Path

from minimal_asymloop import checkpoint as ckpt


def main(run: str):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(ckpt.find_checkpoint(run), Path(tmp) / "ckpt"))
        for name in ("meta.json", "manifest.json"):
            orig, refused = (folder / name).read_bytes(), 0
            for bit in range(8 * len(orig)):
                flipped = bytearray(orig)
                flipped[bit // 8] ^= 1 << (bit % 8)
                (folder / name).write_bytes(bytes(flipped))
                try:
                    ckpt.read_meta(folder)
                    ckpt.verify(folder, None, ["model.safetensors", "state.pt", "tokenizer.json", "metrics.jsonl"])
                except ckpt.CheckpointError:
                    refused += 1
            (folder / name).write_bytes(orig)
            print(f"{name}: {8 * len(orig):,} single-bit flips, {refused:,} refused in one line, {8 * len(orig) - refused} loaded")


if __name__ == "__main__":
    main(sys.argv[1])
