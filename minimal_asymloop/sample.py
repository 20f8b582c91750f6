"""Sample text from a trained checkpoint, with KV-cached generation and its own tokenizer.

    python -m minimal_asymloop.sample --ckpt out/tiny --prompt "def main(" --max-new-tokens 100
    python -m minimal_asymloop.sample --ckpt out/tiny --prompt "import " --n-iter 6   # test-time depth

--ckpt takes a checkpoint folder, a run's out_dir (its `latest`), an exported folder or a Hugging Face Hub
repo id (owner/name; hf:owner/name always means the Hub). The text goes to stdout,
one block per sample; what was loaded goes to stderr.
"""

import argparse
import sys

import torch

from minimal_asymloop.checkpoint import CheckpointError, load_model
from minimal_asymloop.runfolder import os_error_line
from minimal_asymloop.sources import DataError, eot_id
from minimal_asymloop.system import ConfigError, mps_error, pick_device


def doc_end_id(tokenizer) -> int | None:
    """The tokenizer's document separator (BPE's or T5's, as `sources.eot_id` finds it), or None if it has none."""
    try:
        return eot_id(tokenizer)
    except DataError:
        return None


def encode_prompt(tokenizer, prompt: str, vocab_size: int) -> list[int]:
    """Prompt ids; an empty prompt starts a fresh document (the separator token)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids if prompt else []
    if not ids:
        eot = doc_end_id(tokenizer)
        if eot is None:
            raise ValueError("empty --prompt and the tokenizer has no document separator to start from; give a --prompt")
        ids = [eot]
    if max(ids) >= vocab_size:
        raise ValueError(f"the prompt has token id {max(ids)} but the model's vocabulary is {vocab_size}: "
                         f"the checkpoint's tokenizer does not match its model")
    return ids


def sample(model, tokenizer, prompt: str = "", max_new_tokens: int = 100, temperature: float = 0.8, top_k: int | None = None,
           n_iter: int | None = None, num_samples: int = 1, seed: int = 0, use_cache: bool = True) -> list[str]:
    """num_samples continuations of prompt (prompt included), each cut at the first generated document end."""
    ids = encode_prompt(tokenizer, prompt, model.config.vocab_size)
    device = next(model.parameters()).device
    idx = torch.tensor([ids] * num_samples, device=device)  # (num_samples, T)
    torch.manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature, top_k, n_iter, use_cache).tolist()
    eot, texts = doc_end_id(tokenizer), []
    for row in out:
        new = row[len(ids):]
        if eot in new:  # (ours) a generated separator ends the document: stop the text there
            new = new[:new.index(eot)]
        texts.append(tokenizer.decode(ids + new))  # decoded together: byte-level pieces may straddle the join
    return texts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint folder, a run's out_dir (uses its latest checkpoint), an exported "
                                                 "folder, or a Hub repo id (owner/name, or hf:owner/name)")
    p.add_argument("--prompt", default="", help="text to continue; empty: start a new document")
    p.add_argument("--n-iter", type=int, default=None, help="loop iterations K at test time (default: the trained K)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cuda, cuda:N, mps or cpu")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; for comparison)")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "num_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.n_iter is not None and args.n_iter < 1:
        p.error(f"--n-iter must be >= 1, got {args.n_iter}")
    if not args.temperature >= 0 or args.temperature == float("inf"):  # nan fails every comparison
        p.error(f"--temperature must be >= 0 (0 = greedy) and finite, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k must be >= 1, got {args.top_k}")
    try:
        device = pick_device(args.device)
        model, tokenizer, meta = load_model(args.ckpt, device)
    except (CheckpointError, ConfigError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: {os_error_line(e, 'cannot read')}")
    cfg = model.config
    if args.n_iter is not None and cfg.arch == "dense":
        p.error("--n-iter applies to looped models (full_loop, asymloop); this checkpoint is dense")
    print(f"{meta['path']}: {cfg.arch}, step {meta.get('step')}, trained K={cfg.n_iter}, sampling at "
          f"K={args.n_iter or cfg.n_iter}, {'KV cache' if not args.no_cache else 'no cache'}, {device}", file=sys.stderr)
    try:
        texts = sample(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.n_iter,
                       args.num_samples, args.seed, not args.no_cache)
    except ValueError as e:
        sys.exit(f"error: {e}")
    except (RuntimeError, TypeError) as e:
        if (err := mps_error(e)) is None:  # an op or dtype MPS lacks: one line naming the fix
            raise
        sys.exit(f"error: {err}")
    print("\n\n---\n\n".join(texts))
    return texts


if __name__ == "__main__":
    main()
