"""The sampling CLI, end to end on the checkpoint of a short tiny training run (conftest's tiny_checkpoint)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_reliability import rechecksum

from minimal_asymloop.checkpoint import load_model
from minimal_asymloop.sample import main, sample

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minimal_asymloop.sample", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_cli_end_to_end(tiny_checkpoint, capsys):
    args = ["--ckpt", tiny_checkpoint, "--prompt", "def main(", "--max-new-tokens", 24, "--top-k", 20, "--seed", 1, "--device", "cpu"]
    r = run_cli(*args)  # a real process: python -m minimal_asymloop.sample
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def main(") and len(r.stdout.strip()) > len("def main(")
    assert "asymloop" in r.stderr and "KV cache" in r.stderr
    main([str(a) for a in args])  # in-process (saves a torch import): same seed, same text
    assert capsys.readouterr().out == r.stdout
    main([str(a) for a in args[:-4]] + ["--seed", "2", "--device", "cpu"])
    assert capsys.readouterr().out != r.stdout  # another seed, another text


def test_cli_text_is_the_models_greedy_continuation(tiny_checkpoint, capsys):
    model, tok, _ = load_model(tiny_checkpoint)
    ids = tok.encode("import ", add_special_tokens=False).ids
    for k in (None, 5):  # the trained K=3 and a deeper test-time K
        texts = main(["--ckpt", str(tiny_checkpoint), "--prompt", "import ", "--max-new-tokens", "16", "--temperature", "0",
                      "--device", "cpu"] + ([] if k is None else ["--n-iter", str(k)]))
        out = model.generate(torch.tensor([ids]), 16, temperature=0, n_iter=k, use_cache=False)[0].tolist()
        eot = tok.token_to_id("<|endoftext|>")
        new = out[len(ids):]
        new = new[:new.index(eot)] if eot in new else new
        assert texts == [tok.decode(ids + new)]
        assert capsys.readouterr().out.strip() == texts[0].strip()


def test_sample_num_samples_and_empty_prompt(tiny_checkpoint):
    model, tok, _ = load_model(tiny_checkpoint)
    texts = sample(model, tok, "", max_new_tokens=12, temperature=1.0, num_samples=3, seed=0)
    assert len(texts) == 3 and len(set(texts)) > 1  # independent samples from the start of a document
    assert texts == sample(model, tok, "", max_new_tokens=12, temperature=1.0, num_samples=3, seed=0)


def cli_error(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code != 0
    return str(e.value.code) + capsys.readouterr().err


def test_cli_errors(tiny_checkpoint, tmp_path, capsys):
    msg = cli_error(capsys, "--ckpt", tmp_path / "nope", "--prompt", "x")
    assert "no checkpoint at" in msg and "train_minimal.py" in msg
    assert "--n-iter must be >= 1" in cli_error(capsys, "--ckpt", tiny_checkpoint, "--n-iter", 0)
    assert "--temperature must be >= 0" in cli_error(capsys, "--ckpt", tiny_checkpoint, "--temperature", -1)

    bad = tmp_path / "bad"
    shutil.copytree((tiny_checkpoint / "latest").resolve(), bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["model_config"]["d_model"] = 64  # weights no longer fit the config
    (bad / "meta.json").write_text(json.dumps(meta))
    assert "meta.json does not match the checksum in manifest.json" in cli_error(capsys, "--ckpt", bad)
    rechecksum(bad)  # as another tool would write it: the config itself is then checked
    assert "does not match its model config" in cli_error(capsys, "--ckpt", bad)

    meta["model_config"]["d_model"], meta["model_config"]["arch"] = 32, "transformer"
    (bad / "meta.json").write_text(json.dumps(meta))
    rechecksum(bad)
    assert "model config this code cannot build" in cli_error(capsys, "--ckpt", bad)

    meta["model_config"]["arch"] = "asymloop"
    (bad / "meta.json").write_text(json.dumps(meta))
    rechecksum(bad)
    (bad / "tokenizer.json").write_text("{not json")
    assert "is corrupt: tokenizer.json does not match the checksum in manifest.json" in cli_error(capsys, "--ckpt", bad)
    rechecksum(bad)  # a manifest rewritten to match (another tool's checkpoint): the parse still fails in one line
    assert "tokenizer.json cannot be read" in cli_error(capsys, "--ckpt", bad)


def test_prompt_outside_the_model_vocabulary_is_refused(tiny_checkpoint, capsys):
    model, tok, _ = load_model(tiny_checkpoint)
    model.config.vocab_size = 8  # as if the tokenizer were bigger than the model it was saved with
    with pytest.raises(ValueError, match="tokenizer does not match its model"):
        sample(model, tok, "def main():", max_new_tokens=1)


def test_an_empty_prompt_starts_a_document_or_asks_for_a_prompt():
    from tokenizers import Tokenizer, models

    from minimal_asymloop.sample import encode_prompt
    from minimal_asymloop.sources import train_bpe

    bpe = train_bpe(["def f(x): return x"] * 20, 300)
    assert encode_prompt(bpe, "", 300) == [0]  # <|endoftext|> is id 0: a fresh document
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))  # no document separator at all
    with pytest.raises(ValueError, match="no document separator to start from; give a --prompt"):
        encode_prompt(bare, "", 2)
