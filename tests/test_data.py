"""Data preparation: stdlib corpus, a local FineWeb-Edu-shaped parquet, the offline Hub, batches and shards,
parallel tokenizing (same tokens for any worker count), resume after an interruption, budgets and epochs."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minimal_asymloop import batches as B
from minimal_asymloop import data as D
from minimal_asymloop import sources as S

FINEWEB_COLUMNS = ["text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score"]


def write_fineweb_parquet(path, n_docs=300, seed=0, first_id=0):
    """A parquet file with FineWeb-Edu's schema and seeded pseudo-English text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    words = "the a of learning water energy cell plant students teacher history river light can is are which when".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))).capitalize() + "." for _ in range(n_docs)]
    ids = [f"<urn:uuid:{i:08d}-test>" for i in range(first_id, first_id + n_docs)]
    table = pa.table({
        "text": texts, "id": ids, "dump": ["CC-MAIN-2024-10"] * n_docs, "url": [f"https://example.org/{i}" for i in range(n_docs)],
        "file_path": ["s3://commoncrawl/x.warc.gz"] * n_docs, "language": ["en"] * n_docs,
        "language_score": [0.95] * n_docs, "token_count": [len(t.split()) for t in texts],
        "score": [3.1] * n_docs, "int_score": [3] * n_docs,
    })
    assert table.column_names == FINEWEB_COLUMNS
    pq.write_table(table, path)
    return texts, ids


def test_local_parquet_with_fineweb_schema(tmp_path, monkeypatch):
    texts, ids = write_fineweb_parquet(tmp_path / "part-000.parquet")
    d = D.prepare(str(tmp_path / "*.parquet"), "bpe", 300, str(tmp_path / "cache"), val_fraction=0.1, quiet=True)
    val_ids = [i for i in ids if S.is_val(i, 0.1)]
    assert d.meta["n_val_docs"] == len(val_ids) > 0 and d.meta["n_train_docs"] == len(ids) - len(val_ids)
    assert d.vocab_size <= 300 and d.meta["dtype"] == "uint16"
    # the val split is exactly the held-out documents, in order, each ended by the end-of-text token
    eot = d.meta["eot_id"]
    val = np.asarray(d.val.window(0, len(d.val)))
    docs = np.split(val, np.flatnonzero(val == eot) + 1)[:-1]
    held_out = [t for t, i in zip(texts, ids) if S.is_val(i, 0.1)]
    assert [d.tokenizer.decode(doc[:-1].tolist()) for doc in docs] == held_out
    assert len(d.train) + len(d.val) == d.meta["n_train_tokens"] + d.meta["n_val_tokens"]
    assert 0 < d.unigram_entropy < np.log(d.vocab_size)
    # a second call reuses the cache instead of preparing again
    monkeypatch.setattr(D, "_build", lambda *a, **k: pytest.fail("prepared twice"))
    assert D.prepare(str(tmp_path / "*.parquet"), "bpe", 300, str(tmp_path / "cache"), val_fraction=0.1).path == d.path


def test_local_txt_and_jsonl_and_bad_inputs(tmp_path):
    (tmp_path / "txt").mkdir()
    for i in range(30):
        (tmp_path / "txt" / f"{i}.txt").write_text(f"document {i}\nsecond line of {i}\n" * 20)
    d = D.prepare(str(tmp_path / "txt"), "bpe", 280, str(tmp_path / "cache"), val_fraction=0.2, quiet=True)
    assert d.meta["n_train_docs"] + d.meta["n_val_docs"] == 30  # one .txt file = one document
    (tmp_path / "x.jsonl").write_text('{"content": "no text field"}\n')
    with pytest.raises(S.DataError, match="no 'text' column"):
        D.prepare(str(tmp_path / "x.jsonl"), "bpe", 280, str(tmp_path / "cache"), quiet=True)
    with pytest.raises(S.DataError, match="no data files found at .*missing"):
        D.prepare(str(tmp_path / "missing" / "*.parquet"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(S.DataError, match="unknown tokenizer 'gpt2'; choose one of bpe, t5"):
        D.prepare("stdlib", "gpt2")


def test_offline_hub_fails_fast_with_alternatives(tmp_path, monkeypatch):
    t0 = time.time()
    with pytest.raises(S.DataError, match=r"offline mode is on.*--data stdlib.*--data PATH"):
        D.prepare("fineweb-edu", "t5", cache_dir=str(tmp_path))
    with pytest.raises(S.DataError, match=r"T5 tokenizer.*offline mode.*--tokenizer bpe"):
        S.load_t5_tokenizer()
    # no offline flags, but the Hub endpoint refuses connections (a closed local port: no network used)
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(S.DataError, match=r"http://127.0.0.1:9 is unreachable .*--data stdlib"):
        D.prepare("fineweb-edu", "bpe", cache_dir=str(tmp_path))
    assert time.time() - t0 < 30  # seconds, never the minutes of datasets' own retries


def test_stdlib_corpus_choices():
    root, files = S.stdlib_files()
    rel = {f.relative_to(root).as_posix() for f in files}
    assert {"os.py", "json/__init__.py", "asyncio/tasks.py"} <= rel
    assert not any(part in ("site-packages", "test", "tests", "idle_test") for r in rel for part in r.split("/"))
    assert "pydoc_data/topics.py" not in rel and "encodings/cp1252.py" not in rel and "encodings/utf_8.py" in rel
    val = [r for r in sorted(rel) if S.is_val(r, 0.05)]
    assert 0.02 < len(val) / len(rel) < 0.09  # about 5% of files, spread by hash over the alphabet
    assert len({r[0] for r in val}) > 5


def test_batch_sampler_is_deterministic_and_partitions_ranks(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "a.bin")
    tk = D.Tokens([tmp_path / "a.bin"], np.uint16)
    s1, s2 = B.BatchSampler(tk, 9, 8, seed=1), B.BatchSampler(tk, 9, 8, seed=1)
    assert np.array_equal(s1.window_ids(5), s2.window_ids(5)) and not np.array_equal(s1.window_ids(5), s1.window_ids(6))
    assert not np.array_equal(s1.window_ids(0), B.BatchSampler(tk, 9, 8, seed=2).window_ids(0))
    epoch = np.concatenate([s1.window_ids(s) for s in range(s1.n_windows // 8)])
    assert len(set(epoch.tolist())) == len(epoch)  # no window twice within an epoch
    x, y = s1.batch(3, slice(0, 8))
    assert x.shape == (8, 9) and np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal(x[:, 0] % 9, np.zeros(8))
    ranks = [s1.batch(3, slice(r * 4, r * 4 + 4))[0] for r in range(2)]  # two ranks, four rows each
    assert np.array_equal(np.concatenate(ranks), x)


def test_tokens_window_crosses_shards(tmp_path):
    parts = [np.arange(0, 7, dtype=np.uint32), np.arange(7, 10, dtype=np.uint32), np.arange(10, 20, dtype=np.uint32)]
    for i, p in enumerate(parts):
        p.tofile(tmp_path / f"t{i}.bin")
    tk = D.Tokens([tmp_path / f"t{i}.bin" for i in range(3)], np.uint32)
    assert len(tk) == 20 and tk.window(5, 8).tolist() == list(range(5, 13)) and tk.window(0, 20).tolist() == list(range(20))


# ----------------------------------------------------------------------------- parallel, sharded, resumable preparation


def serial_reference(source, tok, val_fraction, max_tokens):
    """The tokens of the serial pipeline that preceded the process pool (one process, batch by batch, stop at the cap
    after a whole batch), kept here to show that workers and shards change no token."""
    eot, out, total, batch, chars = S.eot_id(tok), {"train": [], "val": []}, 0, [], 0

    def flush():
        nonlocal total
        for (split, _), enc in zip(batch, tok.encode_batch([t for _, t in batch], add_special_tokens=False)):
            out[split] += enc.ids + [eot]
            total += (len(enc.ids) + 1) * (split == "train")
        batch.clear()

    for key, text in S.iter_documents(source, S.source_identity(source, max_tokens)):
        batch.append(("val" if S.is_val(key, val_fraction) else "train", text))
        chars += len(text)
        if len(batch) >= 256 or chars >= min(2_000_000, max_tokens or 2_000_000):
            flush()
            chars = 0
            if max_tokens and total >= max_tokens:
                break
    flush()
    return out


def two_parquet_files(folder):
    folder.mkdir()
    write_fineweb_parquet(folder / "part-0.parquet", n_docs=300, seed=1)
    write_fineweb_parquet(folder / "part-1.parquet", n_docs=300, seed=2, first_id=300)
    return str(folder / "*.parquet")


def tokens_of(d):
    return {s: getattr(d, s).window(0, len(getattr(d, s))).tolist() for s in ("train", "val")}


@pytest.mark.parametrize("max_tokens", [None, 30_000])  # the whole source, and a cap that stops mid-stream
def test_workers_and_shards_change_no_token(tmp_path, monkeypatch, max_tokens):
    source = two_parquet_files(tmp_path / "src")
    monkeypatch.setattr(D, "SHARD_TOKENS", 4000)  # many shards from a small source
    one, two = (D.prepare(source, "bpe", 300, str(tmp_path / f"cache{w}"), max_tokens=max_tokens, val_fraction=0.1, quiet=True,
                          workers=w) for w in (1, 2))
    assert one.meta["workers"] == 1 and two.meta["workers"] == 2 and one.path.name == two.path.name
    assert one.tokenizer.to_str() == two.tokenizer.to_str()
    assert tokens_of(one) == tokens_of(two) == serial_reference(source, one.tokenizer, 0.1, max_tokens)
    n_docs, n_train = two.meta["n_train_docs"] + two.meta["n_val_docs"], two.meta["n_train_tokens"]
    assert len(two.meta["train_files"]) >= 3
    assert n_docs == 600 if not max_tokens else (n_docs < 600 and max_tokens <= n_train < 2 * max_tokens)
    assert sorted(p.name for p in two.path.iterdir()) == sorted(["manifest.json", "meta.json", "tokenizer.json"] + two.meta["train_files"] +
                                                                two.meta["val_files"])
    assert [p.name for p in (tmp_path / "cache2").iterdir()] == [two.path.name]  # no work folder left behind


def test_interrupted_preparation_resumes_at_its_last_shard(tmp_path, monkeypatch):
    source = two_parquet_files(tmp_path / "src")
    monkeypatch.setattr(D, "SHARD_TOKENS", 4000)
    monkeypatch.setattr(D, "BATCH_DOCS", 40)  # 15 batches
    whole = D.prepare(source, "bpe", 300, str(tmp_path / "whole"), val_fraction=0.1, quiet=True, workers=1)
    batches = D.document_batches

    def network_drops(docs, where, max_tokens):  # the stream fails in the second file, at its 14th batch
        for i, b in enumerate(batches(docs, where, max_tokens)):
            if i == 13:
                raise ConnectionError("network is down")
            yield b

    monkeypatch.setattr(D, "document_batches", network_drops)
    with pytest.raises(ConnectionError):
        D.prepare(source, "bpe", 300, str(tmp_path / "cache"), val_fraction=0.1, quiet=True, workers=2)
    work = tmp_path / "cache" / f".partial-{whole.path.name}"
    progress = D.json.loads((work / "progress.json").read_text())
    assert 300 < progress["position"]["docs"] < 600 and not progress["finished"] and len(progress["train_files"]) >= 2
    done = {f: (work / f).stat().st_ino for f in progress["files"]}
    before = {f: (work / f).stat().st_mtime_ns for f in progress["files"]}

    opened = []
    stream = S.document_stream
    monkeypatch.setattr(D, "document_batches", batches)
    # patch data's name for it: the one write_shards calls
    monkeypatch.setattr(D, "document_stream", lambda s, i, position=None: opened.append(position) or stream(s, i, position))
    resumed = D.prepare(source, "bpe", 300, str(tmp_path / "cache"), val_fraction=0.1, quiet=True, workers=1)
    assert opened == [progress["position"]]  # one stream, opened where the last finished shard ended (no BPE retraining either)
    assert tokens_of(resumed) == tokens_of(whole)
    assert resumed.meta["n_train_docs"] == whole.meta["n_train_docs"] and resumed.meta["unigram_entropy"] == whole.meta["unigram_entropy"]
    assert {f: ((resumed.path / f).stat().st_ino, (resumed.path / f).stat().st_mtime_ns) for f in done} == {
        f: (done[f], before[f]) for f in done}  # the finished shards were kept, not rewritten
    assert not work.exists()


KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from minimal_asymloop import data as D
D.SHARD_TOKENS = 1
write_json = D._write_json
def write_then_die(path, obj):
    write_json(path, obj)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception handler: like a killed job
D._write_json = write_then_die
vocab, max_tokens, val_fraction = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
D.prepare("stdlib", "bpe", vocab, sys.argv[1], max_tokens=max_tokens, val_fraction=val_fraction, quiet=True, workers=2)
"""


def processes_with_arg(arg):
    """Pids of live processes with `arg` on their command line (forked pool workers share their parent's)."""
    pids = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if arg.encode() in (p / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(p.name))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_killed_preparation_resumes_with_the_same_tokens(tmp_path, stdlib_data):
    m = stdlib_data.meta  # the session's slice of the stdlib corpus, prepared without interruption
    settings = (m["tokenizer"]["vocab"], m["identity"]["max_tokens"], m["val_fraction"])
    r = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST_SHARD, str(tmp_path), *map(str, settings)], capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(Path(D.__file__).parents[1])}, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    deadline = time.time() + 10
    while processes_with_arg(str(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_with_arg(str(tmp_path))  # the killed run's tokenizer processes stopped themselves
    work = tmp_path / f".partial-{stdlib_data.path.name}"
    assert len(D.json.loads((work / "progress.json").read_text())["train_files"]) == 1
    d = D.prepare("stdlib", "bpe", settings[0], str(tmp_path), max_tokens=settings[1], val_fraction=settings[2], quiet=True, workers=1)
    assert d.path.name == stdlib_data.path.name and len(d.meta["train_files"]) > 1 and tokens_of(d) == tokens_of(stdlib_data)


# ----------------------------------------------------------------------------- budgets and epochs


def test_budget_picks_a_fineweb_sample_or_names_the_fix(capsys, tmp_path):
    from minimal_asymloop.batches import data_for_run as _data_for
    from minimal_asymloop.model import ModelConfig
    from minimal_asymloop.trainer import ConfigError, TrainConfig

    assert S.fineweb_for_budget("fineweb-edu", 1_680_000_000) == ("fineweb-edu", None)
    assert S.fineweb_for_budget("stdlib", 10**12) == ("stdlib", None)
    source, note = S.fineweb_for_budget("fineweb-edu", 20 * 10**9)
    assert source == "fineweb-edu:sample-100BT" and "exceeds FineWeb-Edu sample-10BT" in note
    with pytest.raises(S.DataError, match=r"exceeds FineWeb-Edu sample-10BT .*use --data fineweb-edu:sample-100BT.*--max-data-tokens"):
        S.fineweb_for_budget("fineweb-edu:sample-10BT", 20 * 10**9)
    with pytest.raises(S.DataError, match=r"fineweb-edu:default"):
        S.fineweb_for_budget("fineweb-edu", 400 * 10**9)
    # the 1b preset: the note comes first, then the offline Hub stops it with the sample it would stream
    cfg = TrainConfig.from_preset("1b", data_cache=str(tmp_path))
    with pytest.raises(S.DataError, match=r"--data fineweb-edu:sample-100BT needs the Hugging Face Hub"):
        _data_for(ModelConfig.from_preset("1b"), cfg, 0, quiet=False)
    assert "20.0B-token budget exceeds FineWeb-Edu sample-10BT (about 10B tokens); streaming sample-100BT" in capsys.readouterr().out
    with pytest.raises(S.DataError, match="data workers must be a positive integer"):
        D.prepare("stdlib", workers=0)
    with pytest.raises(ConfigError, match="data_workers must be a positive integer"):
        TrainConfig(max_steps=1, data_workers=0)


def test_repeated_data_prints_its_epochs_once(tiny_configs, capsys):
    from minimal_asymloop.batches import data_for_run as _data_for

    mcfg, cfg = tiny_configs(max_steps=20)  # 20 x 8 sequences: well inside one epoch
    _data_for(mcfg, cfg, 0, quiet=False)
    assert "repeats" not in capsys.readouterr().out
    mcfg, cfg = tiny_configs(max_steps=1000)
    data = _data_for(mcfg, cfg, 0, quiet=False)
    windows = (len(data.train) - 1) // 32
    out = capsys.readouterr().out
    assert out.count("note: data repeats") == 1 and f"repeats: {8000 / windows:.2f} epochs (the budget is 8,000 sequences" in out
    assert f"holds {windows:,}, {len(data.train):,} tokens" in out


def test_default_workers_leave_a_core_to_the_stream(monkeypatch):
    for cores, workers in ((1, 1), (2, 1), (16, 15), (128, 32)):
        monkeypatch.setattr(D.os, "sched_getaffinity", lambda _, n=cores: set(range(n)), raising=False)
        assert D.default_workers() == workers
