"""Prepared data: a source's documents -> memory-mapped uint16/uint32 token shards + a held-out val split (batches.py reads them).

Where documents and tokenizers come from (stdlib, local files, FineWeb-Edu; BPE, T5, SmolLM; the val split by hash)
is sources.py. Preparation runs once per (source, tokenizer) and is cached under `data_cache/`, nanoGPT/llm.c style:
documents are tokenized, joined with an end-of-text token and written as flat binary shards that
training memory-maps. Tokenizer processes (--data-workers) work on batches while the source streams;
results are written in source order, so the tokens never depend on the number of workers. Shards are
committed one by one: an interrupted preparation resumes at its last finished shard. Batches are a
pure function of (seed, step), so resume is exact.

    python -m minimal_asymloop.data --data stdlib        # prepare (and print stats) without training
"""

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from minimal_asymloop import integrity, sources
from minimal_asymloop.runfolder import naming
from minimal_asymloop.sources import (
    SMOLLM_TOKENIZER,
    T5_REPO,
    TOKENIZERS,
    DataError,
    default_val_fraction,
    document_stream,
    eot_id,
    is_val,
    iter_documents,
    load_smollm_tokenizer,
    load_t5_tokenizer,
    require_hub,
    source_identity,
    train_bpe,
)
from minimal_asymloop.system import cpu_cores

DATA_FORMAT = 1  # bump when the on-disk layout changes; part of the cache key
SHARD_TOKENS = 100_000_000  # llm.c-sized shards (ours); a shard is also the unit that an interrupted preparation resumes at
BATCH_DOCS, BATCH_CHARS = 256, 2_000_000  # one tokenizer task (ours); they fix where a capped preparation stops: keep them


# ----------------------------------------------------------------------------- prepared data


class Tokens:
    """One split as a single logical 1-D token array over memory-mapped shards."""

    def __init__(self, paths: list[Path], dtype):
        self.shards = [np.memmap(p, dtype=dtype, mode="r") for p in paths]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self):
        return int(self.starts[-1])

    def window(self, start: int, n: int) -> np.ndarray:
        """tokens[start:start+n] as int64, crossing shard boundaries if needed."""
        out, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while n > 0:
            off = start - int(self.starts[i])
            piece = self.shards[i][off:off + n]
            out.append(piece)
            start, n, i = start + len(piece), n - len(piece), i + 1
        return np.concatenate(out).astype(np.int64)


@dataclass
class Prepared:
    path: Path
    meta: dict
    train: Tokens
    val: Tokens
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the val split's own unigram distribution: the best val loss
        a model that ignores context could reach. A trained LM must go clearly below it."""
        return self.meta["unigram_entropy"]


def entropy_nats(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def cache_key(ident: dict, tok_ident: dict, val_fraction: float) -> str:
    blob = json.dumps(dict(format=DATA_FORMAT, source=ident, tokenizer=tok_ident, val_fraction=val_fraction), sort_keys=True)
    slug = ident["kind"] + ("-py" + ident["python"] if ident["kind"] == "stdlib" else "")
    tname = tok_ident["name"] + (str(tok_ident["vocab"]) if tok_ident["name"] == "bpe" else "")
    return f"{slug}-{tname}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def prepare(source: str = "stdlib", tokenizer: str = "bpe", bpe_vocab: int = 8192, cache_dir: str = "data_cache",
            max_tokens: int | None = None, val_fraction: float | None = None, bpe_sample_chars: int = 4_000_000,
            quiet: bool = False, build: bool = True, workers: int | None = None) -> Prepared:
    """Prepare (or reuse) tokenized shards for `source` and return them memory-mapped.

    max_tokens caps the train tokens read from streaming/local sources (None: everything).
    build=False raises FileNotFoundError instead of preparing (DDP ranks waiting for rank 0).
    val_fraction: share of documents held out, by hash; default 5% (ours; 0.5% for fineweb-edu).
    workers: tokenizer processes (None: default_workers()); the tokens never depend on it.
    An interrupted preparation resumes at its last finished shard on the next call.
    """
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise DataError(f"data workers must be a positive integer or None (one per CPU core but one), got {workers!r}")
    if workers is not None and workers > cpu_cores():  # the tokens never depend on it; more processes than cores only cost memory
        if not quiet:
            print(f"note: {workers} data workers capped at this machine's {cpu_cores()} CPU cores", file=sys.stderr)
        workers = cpu_cores()
    ident = source_identity(source, max_tokens)
    val_fraction = val_fraction if val_fraction is not None else default_val_fraction(ident)
    tok_ident = {"t5": dict(name="t5", repo=T5_REPO), "smollm": dict(name="smollm", repo=SMOLLM_TOKENIZER)}.get(
        tokenizer, dict(name="bpe", vocab=bpe_vocab, sample_chars=bpe_sample_chars))
    folder = Path(cache_dir) / cache_key(ident, tok_ident, val_fraction)
    if not (folder / "meta.json").exists():
        if not build:
            raise FileNotFoundError(folder / "meta.json")
        _build(folder, source, ident, tok_ident, val_fraction, max_tokens, quiet, workers or default_workers())
    return load_prepared(folder)


def default_workers() -> int:
    """One tokenizer process per CPU core, leaving one core to stream documents and write shards, and at most 32:
    one process feeds them all (ours; not measured on a many-core host)."""
    return max(1, min(cpu_cores() - 1, 32))


def load_prepared(folder) -> Prepared:
    """The prepared data in `folder`, every file verified against its manifest.json and every token below the vocabulary."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        files = ["meta.json", "tokenizer.json", *meta["train_files"], *meta["val_files"]]
        verify_prepared(folder, files)
        dtype = np.dtype(meta["dtype"])
        train = Tokens([folder / f for f in meta["train_files"]], dtype)
        val = Tokens([folder / f for f in meta["val_files"]], dtype)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except DataError as e:
        raise DataError(f"{e}; delete {folder} to re-prepare it") from None
    except Exception as e:  # OSError, a missing key, a bad value; tokenizers raises a bare Exception on bad JSON
        raise DataError(f"prepared data at {folder} is incomplete or corrupt ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                        f"delete that folder to re-prepare") from None
    if len(train) != meta["n_train_tokens"] or len(val) != meta["n_val_tokens"]:
        raise DataError(f"prepared data at {folder} has truncated shards; delete that folder to re-prepare")
    top = max(int(s.max()) for s in train.shards + val.shards)
    if top >= meta["vocab_size"]:
        raise DataError(f"prepared data at {folder} holds token id {top}, outside its tokenizer's {meta['vocab_size']} tokens (damaged "
                        f"shards); delete that folder to re-prepare")
    return Prepared(folder, meta, train, val, tok)


def verify_prepared(folder: Path, files: list[str]):
    """Check the files against folder/manifest.json. A folder prepared before manifests gets one now, said in one line:
    from then on every open verifies it."""
    if not (folder / integrity.MANIFEST).exists():
        integrity.write_manifest(folder, files)
        print(f"note: prepared data at {folder} had no {integrity.MANIFEST} (prepared before shards were checksummed); recorded "
              f"the checksums of its {len(files)} files now, and later opens verify them", file=sys.stderr)
    integrity.verify(folder, files, DataError, "prepared data")


def _build(folder: Path, source, ident, tok_ident, val_fraction, max_tokens, quiet, workers):
    """Tokenize the source into a work folder shard by shard, then rename it into place.

    The work folder survives a failure: the next call resumes it at its last finished shard. A lock
    serializes builders of one cache entry (DDP ranks on a shared disk); the loser reuses the winner's.
    """
    if ident["kind"] in ("fineweb-edu", "smollm-corpus"):
        require_hub(f"--data {source}")  # before anything slow, and before the tokenizer's own check
    work = folder.parent / f".partial-{folder.name}"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "lock", "w") as lock:
        try:
            import fcntl

            fcntl.lockf(lock, fcntl.LOCK_EX)  # waits while another process builds this entry; not inherited by forked workers
        except ImportError:  # Windows: no lock; one builder at a time is then up to the user
            pass
        if (folder / "meta.json").exists():  # another process built it while we waited
            return
        _tokenize_into(work, source, ident, tok_ident, val_fraction, max_tokens, quiet, folder, workers)
        if folder.exists():  # a stale, unfinished folder of that name is in the way
            shutil.rmtree(folder)
        os.replace(work, folder)  # still locked: a waiting process then finds meta.json and returns
        (folder / "progress.json").unlink()
        (folder / "lock").unlink()


def _write_json(path: Path, obj):
    """Atomic: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_suffix(".tmp")
    with naming(tmp):
        tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _get_tokenizer(work: Path, source, ident, tok_ident, val_fraction, max_tokens, say) -> Tokenizer:
    """The tokenizer, saved in the work folder first so that a resumed preparation reuses it."""
    if (work / "tokenizer.json").exists():
        return Tokenizer.from_file(str(work / "tokenizer.json"))
    if tok_ident["name"] in ("t5", "smollm"):
        tok = load_t5_tokenizer() if tok_ident["name"] == "t5" else load_smollm_tokenizer()
    else:  # BPE learns from a sample of the TRAIN split only, spread over the corpus (not its alphabetical head)
        want = tok_ident["sample_chars"] if not max_tokens else min(tok_ident["sample_chars"], 4 * max_tokens)  # ~4 chars/token
        sample, n = [], 0
        for key, text in iter_documents(source, ident):
            if not is_val(key, val_fraction):
                sample.append(text)
                n += len(text)
                if n >= 4 * want:
                    break
        sample = sample[::max(1, round(n / want))]
        say(f"  training byte-level BPE (vocab {tok_ident['vocab']}) on {sum(map(len, sample)) / 1e6:.1f}M characters")
        tok = train_bpe(sample, tok_ident["vocab"])
    tok.save(str(work / "tokenizer.tmp"))
    os.replace(work / "tokenizer.tmp", work / "tokenizer.json")
    return tok


def document_batches(docs, where, max_tokens):
    """Group documents into batches of BATCH_DOCS documents or BATCH_CHARS characters (fewer when capped, to stop
    near the cap). Yields (batch, position after it)."""
    batch, chars, max_chars = [], 0, min(BATCH_CHARS, max_tokens or BATCH_CHARS)
    for key, text in docs:
        batch.append((key, text))
        chars += len(text)
        if len(batch) >= BATCH_DOCS or chars >= max_chars:
            yield batch, where()
            batch, chars = [], 0
    if batch:
        yield batch, where()


def encode_batch(tok: Tokenizer, eot: int, dtype, val_fraction: float, batch) -> dict:
    """{split: (tokens, n_docs)}: each document's ids and an end-of-text token, concatenated per split."""
    ids = {"train": [], "val": []}
    for (key, _), enc in zip(batch, tok.encode_batch([t for _, t in batch], add_special_tokens=False)):
        ids["val" if is_val(key, val_fraction) else "train"].append(enc.ids + [eot])
    return {s: (np.fromiter(chain.from_iterable(d), dtype, count=sum(map(len, d))), len(d)) for s, d in ids.items()}


_worker = {}  # a tokenizer process's tokenizer and settings, set once by _init_worker


def _init_worker(tok_json: str, eot: int, dtype, val_fraction: float, parent: int):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent alone stops, in one line
    _worker.update(tok=Tokenizer.from_str(tok_json), eot=eot, dtype=dtype, val_fraction=val_fraction)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int):
    """A killed (SIGKILL) parent cannot stop its pool: the workers stop themselves, as torch's DataLoader workers do."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _encode_in_worker(batch):
    return encode_batch(_worker["tok"], _worker["eot"], _worker["dtype"], _worker["val_fraction"], batch)


def encoded_batches(batches, tok: Tokenizer, eot: int, dtype, val_fraction: float, workers: int):
    """encode_batch over (batch, position) pairs, in order. workers=1: in this process (the tokenizers library
    threads each batch); more: a process pool, fed while the source streams, with 2 batches per worker in flight."""
    if workers == 1:
        for batch, pos in batches:
            yield encode_batch(tok, eot, dtype, val_fraction, batch), pos
        return
    # fork on Linux, like torch's DataLoader: spawn would re-run a user's script that lacks an `if __name__ == "__main__"` guard
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(tok.to_str(), eot, dtype, val_fraction, os.getpid()))
    pending, saved = deque(), os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited: tokenizers' Rust threads stay off in the workers, no warning
        try:
            pool.submit(int).result()  # starts the workers
        finally:
            if saved is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        for batch, pos in batches:
            pending.append((pool.submit(_encode_in_worker, batch), pos))
            if len(pending) >= 2 * workers:
                f, p = pending.popleft()
                yield f.result(), p
        while pending:
            f, p = pending.popleft()
            yield f.result(), p
    finally:  # also when the caller stops at the cap: drop the batches not started
        pool.shutdown(wait=True, cancel_futures=True)


def _tokenize_into(work: Path, source, ident, tok_ident, val_fraction, max_tokens, quiet, folder, workers):
    t0 = time.time()
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    progress = _read_progress(work)
    if progress:
        say(f"resuming the preparation of {source!r} in {work} after {len(progress['files'])} shard file(s), "
            f"{progress['n_train_tokens']:,} train tokens")
    else:
        say(f"preparing {source!r} with the {tok_ident['name']} tokenizer into {folder} (once; cached)")
    tok = _get_tokenizer(work, source, ident, tok_ident, val_fraction, max_tokens, say)
    progress = write_shards(work, source, ident, tok, val_fraction, max_tokens, workers, quiet, seconds_before=time.time() - t0)
    n_docs = {s: progress[f"n_{s}_docs"] for s in ("train", "val")}
    if not n_docs["val"] or not n_docs["train"]:
        raise DataError(f"{source!r} gave {n_docs['train']} train and {n_docs['val']} val documents at val_fraction={val_fraction}; "
                        f"both splits need documents: add data or raise val_fraction")
    val = Tokens([work / f for f in progress["val_files"]], progress["dtype"])
    counts = np.bincount(val.window(0, len(val)))
    meta = dict(format=DATA_FORMAT, source=source, identity=ident, tokenizer=tok_ident, vocab_size=tok.get_vocab_size(),
                eot_id=eot_id(tok), dtype=progress["dtype"], val_fraction=val_fraction, train_files=progress["train_files"],
                val_files=progress["val_files"], n_train_tokens=progress["n_train_tokens"], n_val_tokens=progress["n_val_tokens"],
                n_train_docs=n_docs["train"], n_val_docs=n_docs["val"], unigram_entropy=entropy_nats(counts),
                prepare_seconds=round(progress["seconds"], 1), workers=workers)
    with naming(work / "meta.json"):
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
    integrity.write_manifest(work, ["meta.json", "tokenizer.json", *meta["train_files"], *meta["val_files"]])
    say(f"  {meta['n_train_tokens'] / 1e6:.2f}M train / {meta['n_val_tokens'] / 1e6:.2f}M val tokens from "
        f"{n_docs['train']}+{n_docs['val']} documents in {meta['prepare_seconds']:.0f}s")


def _read_progress(work: Path) -> dict | None:
    """The progress.json of an interrupted preparation, after checking that its finished shards survived intact."""
    if not (work / "progress.json").exists():
        return None
    progress = json.loads((work / "progress.json").read_text())
    for f, n in progress["files"].items():
        if not (work / f).exists() or (work / f).stat().st_size != n * np.dtype(progress["dtype"]).itemsize:
            raise DataError(f"shard {work / f} of an interrupted preparation is missing or truncated; delete {work} to start over")
    return progress


def write_shards(work: Path, source: str, ident: dict, tok: Tokenizer, val_fraction: float, max_tokens: int | None = None,
                 workers: int = 1, quiet: bool = True, seconds_before: float = 0.0) -> dict:
    """Stream, tokenize and append shards to `work` (from where its progress.json stops), committing progress.json after
    each shard; returns the progress. A shard closes after the batch that brings its train tokens to SHARD_TOKENS, or
    at the cap or the source's end."""
    t0 = time.time() - seconds_before
    dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
    progress = _read_progress(work) or dict(dtype=np.dtype(dtype).name, position=None, finished=False, shards=0, files={},
                                            train_files=[], val_files=[], n_train_tokens=0, n_val_tokens=0, n_train_docs=0,
                                            n_val_docs=0, seconds=0.0)
    if progress["finished"]:
        return progress
    docs, where = document_stream(source, ident, progress["position"])
    batches = encoded_batches(document_batches(docs, where, max_tokens), tok, eot_id(tok), dtype, val_fraction, workers)
    bar = tqdm(desc="  tokenizing", unit=" tok", unit_scale=True, disable=quiet, total=max_tokens, initial=progress["n_train_tokens"])
    buf, pos = {"train": [], "val": []}, progress["position"]

    def commit(pos, finished):
        for split, arrays in buf.items():
            if sum(map(len, arrays)):  # an empty file could not be memory-mapped
                name = f"{split}_{progress['shards']:06d}.bin"
                a = np.concatenate(arrays)
                with naming(work / name), open(work / name, "wb") as f:
                    f.write(a.data)  # (not a.tofile: its short-write error has no errno and no path)
                    f.flush()
                    os.fsync(f.fileno())  # on disk before progress.json says it is
                progress[f"{split}_files"].append(name)
                progress["files"][name] = len(a)
            arrays.clear()
        progress.update(shards=progress["shards"] + 1, position=pos, finished=finished, seconds=progress["seconds"] + time.time() - t0)
        _write_json(work / "progress.json", progress)

    try:
        for out, pos in batches:
            for split, (a, n) in out.items():
                buf[split].append(a)
                progress[f"n_{split}_tokens"] += len(a)
                progress[f"n_{split}_docs"] += n
            bar.update(len(out["train"][0]))
            capped = bool(max_tokens) and progress["n_train_tokens"] >= max_tokens
            if capped or sum(map(len, buf["train"])) >= SHARD_TOKENS:
                commit(pos, finished=capped)
                t0 = time.time()
            if capped:
                break
        else:
            commit(pos, finished=True)
    finally:
        batches.close()  # stops the tokenizer processes now, also on an error
        bar.close()
    return progress


def main(argv=None):
    # sources.py's docstring lists the values of --data and --tokenizer
    p = argparse.ArgumentParser(description=f"{__doc__}\n{sources.__doc__}", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--tokenizer", default="bpe", choices=TOKENIZERS)
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--data-cache", default="data_cache")
    p.add_argument("--max-tokens", type=lambda s: int(float(s)), default=None)
    p.add_argument("--data-workers", type=int, default=None, help="tokenizer processes (default: CPU cores - 1, at most 32)")
    args = p.parse_args(argv)
    try:
        d = prepare(args.data, args.tokenizer, args.bpe_vocab, args.data_cache, args.max_tokens, workers=args.data_workers)
    except DataError as e:
        sys.exit(f"error: {e}")
    m = d.meta
    print(f"{d.path}: {m['n_train_tokens']:,} train / {m['n_val_tokens']:,} val tokens, vocab {m['vocab_size']}, "
          f"{m['dtype']}, val unigram entropy {d.unigram_entropy:.3f} nats/token "
          f"(ppl {math.exp(d.unigram_entropy):.0f})")


if __name__ == "__main__":
    main()
