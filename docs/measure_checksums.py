"""What checkpoint checksums cost at the paper's 60m size (docs/reliability.md): the time to hash model.safetensors and
state.pt of a 60m AsymLoop model with its AdamW state, built without training, against the time to write them.

    python docs/measure_checksums.py            # writes to a temporary folder, prints one table
"""

import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.flops import count_params
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.optim import param_groups


def hash_file(path: Path, h) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    h.hexdigest()
    return time.perf_counter() - t0


def main():
    cfg = ModelConfig.from_preset("60m", "asymloop")
    model = LoopedLM(cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    for p in model.parameters():  # one step on zero gradients: the optimizer state of a real run, without training
        p.grad = torch.zeros_like(p)
    opt.step()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(tmp / "model.safetensors"))
        t_weights = time.perf_counter() - t0
        t0 = time.perf_counter()
        ckpt._torch_save(dict(step=1, optimizer=opt.state_dict()), tmp / "state.pt")
        t_state = time.perf_counter() - t0
        files = [tmp / "model.safetensors", tmp / "state.pt"]
        size = sum(f.stat().st_size for f in files)
        for f in files:  # warm the page cache: a save hashes what it just wrote
            f.read_bytes()
        print(f"60m asymloop: {count_params(cfg) / 1e6:.1f}M parameters; model.safetensors + state.pt = {size / 1e6:.0f} MB, "
              f"written in {t_weights + t_state:.2f} s; torch {torch.__version__}, Python {sys.version.split()[0]}")
        print("| hash | seconds for both files | MB/s |\n|---|---|---|")
        for name, make in (("xxh3_128 (used)", xxhash.xxh3_128), ("sha256", hashlib.sha256), ("blake2b", hashlib.blake2b)):
            t = sum(hash_file(f, make()) for f in files)
            print(f"| {name} | {t:.2f} | {size / t / 1e6:.0f} |")


if __name__ == "__main__":
    main()
