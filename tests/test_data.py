"""Data preparation: stdlib corpus, a local FineWeb-Edu-shaped parquet, the offline Hub, batches and shards."""

import random
import time

import numpy as np
import pytest

from minimal_asymloop import data as D

FINEWEB_COLUMNS = ["text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score"]


def write_fineweb_parquet(path, n_docs=300, seed=0):
    """A parquet file with FineWeb-Edu's schema and seeded pseudo-English text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    words = "the a of learning water energy cell plant students teacher history river light can is are which when".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))).capitalize() + "." for _ in range(n_docs)]
    ids = [f"<urn:uuid:{i:08d}-test>" for i in range(n_docs)]
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
    val_ids = [i for i in ids if D.is_val(i, 0.1)]
    assert d.meta["n_val_docs"] == len(val_ids) > 0 and d.meta["n_train_docs"] == len(ids) - len(val_ids)
    assert d.vocab_size <= 300 and d.meta["dtype"] == "uint16"
    # the val split is exactly the held-out documents, in order, each ended by the end-of-text token
    eot = d.meta["eot_id"]
    val = np.asarray(d.val.window(0, len(d.val)))
    docs = np.split(val, np.flatnonzero(val == eot) + 1)[:-1]
    held_out = [t for t, i in zip(texts, ids) if D.is_val(i, 0.1)]
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
    with pytest.raises(D.DataError, match="no 'text' column"):
        D.prepare(str(tmp_path / "x.jsonl"), "bpe", 280, str(tmp_path / "cache"), quiet=True)
    with pytest.raises(D.DataError, match="no data files found at .*missing"):
        D.prepare(str(tmp_path / "missing" / "*.parquet"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(D.DataError, match="unknown tokenizer 'gpt2'; choose one of bpe, t5"):
        D.prepare("stdlib", "gpt2")


def test_offline_hub_fails_fast_with_alternatives(tmp_path, monkeypatch):
    t0 = time.time()
    with pytest.raises(D.DataError, match=r"offline mode is on.*--data stdlib.*--data PATH"):
        D.prepare("fineweb-edu", "t5", cache_dir=str(tmp_path))
    with pytest.raises(D.DataError, match=r"T5 tokenizer.*offline mode.*--tokenizer bpe"):
        D.load_t5_tokenizer()
    # no offline flags, but the Hub endpoint refuses connections (a closed local port: no network used)
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(D.DataError, match=r"http://127.0.0.1:9 is unreachable .*--data stdlib"):
        D.prepare("fineweb-edu", "bpe", cache_dir=str(tmp_path))
    assert time.time() - t0 < 30  # seconds, never the minutes of datasets' own retries


def test_stdlib_corpus_choices():
    root, files = D.stdlib_files()
    rel = {f.relative_to(root).as_posix() for f in files}
    assert {"os.py", "json/__init__.py", "asyncio/tasks.py"} <= rel
    assert not any(part in ("site-packages", "test", "tests", "idle_test") for r in rel for part in r.split("/"))
    assert "pydoc_data/topics.py" not in rel and "encodings/cp1252.py" not in rel and "encodings/utf_8.py" in rel
    val = [r for r in sorted(rel) if D.is_val(r, 0.05)]
    assert 0.02 < len(val) / len(rel) < 0.09  # about 5% of files, spread by hash over the alphabet
    assert len({r[0] for r in val}) > 5


def test_batch_sampler_is_deterministic_and_partitions_ranks(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "a.bin")
    tk = D.Tokens([tmp_path / "a.bin"], np.uint16)
    s1, s2 = D.BatchSampler(tk, 9, 8, seed=1), D.BatchSampler(tk, 9, 8, seed=1)
    assert np.array_equal(s1.window_ids(5), s2.window_ids(5)) and not np.array_equal(s1.window_ids(5), s1.window_ids(6))
    assert not np.array_equal(s1.window_ids(0), D.BatchSampler(tk, 9, 8, seed=2).window_ids(0))
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
