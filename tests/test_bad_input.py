"""Bad input: every case ends in ONE line naming the problem and the fix, through the command line a user runs.

One table-driven test; each row builds what it needs (files, a broken checkpoint) and names the expected last line.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import DATA, MODEL
from safetensors.torch import load_file, save_file
from test_reliability import rechecksum

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop import evaluate, finetune, hub, sample
from minimal_asymloop.model import ModelConfig


def _train_argv(data_cache, out, *extra):
    """The CLI for the conftest test model and data slice, 2 steps."""
    model = [a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    data = ["--data", DATA["data"], "--bpe-vocab", str(DATA["bpe_vocab"]), "--max-data-tokens", str(DATA["max_data_tokens"]),
            "--val-fraction", str(DATA["val_fraction"]), "--data-cache", str(data_cache)]
    run = ["--seq-len", "32", "--global-batch", "8", "--micro-batch", "8", "--max-steps", "2", "--eval-interval", "2",
           "--eval-batches", "1", "--device", "cpu", "--dtype", "float32", "--seed", "0", "--quiet", "--out-dir", str(out)]
    return model + data + run + list(extra)


@pytest.fixture(scope="module")
def cli_run(data_cache, tmp_path_factory):
    """out_dir of a finished 2-step CLI run (asymloop), to resume with bad settings or a broken checkpoint."""
    out = tmp_path_factory.mktemp("cli_run") / "out"
    train_minimal.main(_train_argv(data_cache, out))
    return out


def _copy_run(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _ckpt_copy(tiny_checkpoint, dst: Path) -> Path:
    shutil.copytree(ckpt.find_checkpoint(tiny_checkpoint), dst)
    return dst


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path.parent


def _edit_meta(folder: Path, recheck: bool = True, **changes) -> Path:
    """Change meta.json's fields; recheck: and rewrite the manifest to match (a checkpoint another tool wrote), so that
    the check of what it says is reached."""
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))
    return rechecksum(folder) if recheck else folder


def _edit_text(file: Path, old: str, new: str) -> Path:
    """Replace `old` by `new` once in a file, as a careless editor would: one character changes."""
    text = file.read_text()
    assert old in text
    file.write_text(text.replace(old, new, 1))
    return file.parent


def _without(folder: Path, name: str) -> Path:
    (folder / name).unlink()
    return folder


def _dir_for(folder: Path, name: str) -> Path:
    """Replace a checkpoint file by a folder of the same name: reading it is a real OS error (EISDIR), even as root."""
    (folder / name).unlink()
    (folder / name).mkdir()
    return folder


def _truncate(file: Path) -> Path:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file.parent


def _k_three_to_two(tiny_checkpoint, t: Path) -> Path:
    """A copy of the checkpoint whose meta.json says K=2 instead of 3: one character, another model if it loaded."""
    return _edit_text(_ckpt_copy(tiny_checkpoint, t / "k") / "meta.json", '"n_iter": 3', '"n_iter": 2')


def _small_corpus(folder: Path) -> Path:
    for i in range(8):  # eight short documents: both splits get some, but the train split holds far less than one batch
        _write(folder / f"doc{i}.txt", f"def f{i}(x):\n    return x + {i}\n".encode())
    return folder


def flip_tensor_bytes(folder: Path) -> Path:
    """Invert 64 bytes in the middle of model.safetensors' tensor data, its JSON header untouched: still loads."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # an 8-byte header length, the header, then the tensor bytes
    mid = (start + len(data)) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))
    return folder


def _nan_weights(folder: Path) -> Path:
    w = load_file(str(folder / "model.safetensors"))
    name = sorted(w)[0]
    w[name] = w[name] * float("nan")
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return rechecksum(folder)  # a "valid" file of NaNs: only the finiteness check catches it


def _gsm8k(folder: Path) -> Path:
    rows = [dict(question=f"Tom has {i} apples and buys 2. How many now?", answer=f"{i}+2={i + 2}\n#### {i + 2}") for i in range(8)]
    for split in ("train", "test"):
        _write(folder / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    return folder


def _with_no_data(option: str, value: str):
    """argv builder: the test run with `option value` and a --data that does not exist (reaching the data is a failure)."""
    return lambda d, t, r, c: _train_argv(d, t / "o", option, value, "--data", str(t / "nope.txt"))


def _gsm8k_with(folder: Path, train: bytes) -> Path:
    """A GSM8K folder whose train.jsonl holds `train`."""
    _gsm8k(folder)
    return _write(folder / "train.jsonl", train)


def _ft_argv(t: Path, ckpt_dir, out, *extra) -> list[str]:
    return ["--ckpt", str(ckpt_dir), "--data", str(_gsm8k(t / "gsm8k")), "--out-dir", str(out), "--n-dev", "2", "--seq-len", "64",
            "--epochs", "1", "--global-batch", "2", "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32", "--quiet", *extra]


def _finetuned(t: Path, ckpt_dir) -> Path:
    """out_dir of a finished (3-step) fine-tuning run."""
    finetune.main(_ft_argv(t, ckpt_dir, t / "ft"))
    return t / "ft"


DENSE = ModelConfig(arch="dense", **MODEL).to_dict()  # asymloop weights under a dense config: another architecture's checkpoint

# (id, command line: "train" or "sample", argv builder (data_cache, tmp, cli_run, tiny_checkpoint) -> argv, expected in the last line)
T, S, E, F, H = "train", "sample", "evaluate", "finetune", "hub"
MAINS = {T: train_minimal.main, S: sample.main, E: evaluate.main, F: finetune.main, H: hub.main}
CASES = [
    ("unknown-size", T, lambda d, t, r, c: _train_argv(d, t / "o", "--size", "7b"), "unknown size '7b'; choose one of tiny, 60m"),
    ("unknown-arch", T, lambda d, t, r, c: _train_argv(d, t / "o", "--arch", "loop"), "unknown arch 'loop'; choose one of dense"),
    ("unknown-key", T, lambda d, t, r, c: _train_argv(d, t / "o", "--d-modle", "64"), "unknown option '--d-modle'; did you mean --d-model"),
    ("wrong-type-float", T, lambda d, t, r, c: _train_argv(d, t / "o", "--lr", "fast"), "argument --lr: expected a number, got 'fast'"),
    ("wrong-type-int", T, lambda d, t, r, c: _train_argv(d, t / "o", "--n-layer", "2.5"),
     "argument --n-layer: expected an integer, got '2.5'"),
    ("wrong-type-bool", T, lambda d, t, r, c: _train_argv(d, t / "o", "--qk-norm", "maybe"),
     "argument --qk-norm: expected true or false, got 'maybe'"),
    ("n_iter<1", T, lambda d, t, r, c: _train_argv(d, t / "o", "--n-iter", "0"), "n_iter (K) must be an integer >= 1, got 0"),
    ("n_enc-out-of-range", T, lambda d, t, r, c: _train_argv(d, t / "o", "--n-enc", "2"),
     "n_enc=2 must be in 1..1 (n_layer=2) so encoder and decoder are non-empty"),
    ("seq_len>max_seq_len", T, lambda d, t, r, c: _train_argv(d, t / "o", "--seq-len", "128"),
     "seq_len=128 exceeds the model's max_seq_len=64; set --max-seq-len 128"),
    ("data-missing", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(t / "nope.txt")), "no data files found at"),
    ("data-empty", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "e" / "a.txt", b""))),
     "are empty (1 file(s), 0 bytes); point --data at files with text"),
    ("data-unreadable-parquet", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "p" / "a.parquet", b"junk"))),
     "could not read the data at"),
    ("data-unreadable-jsonl", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "j" / "a.jsonl", b'{"text": "a"\n'))),
     "JSON parse error"),
    ("data-not-utf8", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "l" / "a.txt", b"caf\xe9 ol\xe9\n"))),
     "a.txt (byte 0xe9 at offset 3) is not UTF-8 text; convert it (e.g. iconv -f latin1 -t utf-8) or remove it"),
    ("split-smaller-than-a-batch", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_small_corpus(t / "s")),
                                                                    "--val-fraction", "0.5", "--data-cache", str(t / "dc")),
     "fewer than one batch of 8 sequences; use more data or a smaller --global-batch / --seq-len"),
    ("tokenizer-vocab-mismatch", T, lambda d, t, r, c: _train_argv(d, t / "o", "--vocab-size", "256"),
     "tokenizer has 512 tokens but the model's vocab_size is 256; set --vocab-size 512"),
    ("out-dir-unwritable", T, lambda d, t, r, c: _train_argv(d, _write(t / "f", b"x") / "f" / "out"),
     "(Not a directory); choose a writable --out-dir"),
    ("resume-no-checkpoint", T, lambda d, t, r, c: _train_argv(d, t / "o", "--resume"), "no checkpoint at"),
    ("resume-other-arch", T, lambda d, t, r, c: _train_argv(d, r, "--resume", "--arch", "full_loop"),
     "the config differs from the checkpoint's (arch: 'asymloop' -> 'full_loop'"),
    ("resume-corrupt-state", T, lambda d, t, r, c: _train_argv(d, _write(_copy_run(r, t / "r") / "latest" / "state.pt", b"junk")
                                                               .parent, "--resume"),
     "is corrupt: state.pt does not match the checksum in manifest.json"),
    # values checked when the config is built, before any data is prepared, with the valid range and the way to go
    ("lr-negative", T, lambda d, t, r, c: _train_argv(d, t / "o", "--lr", "-0.01", "--data", str(t / "nope.txt")),
     "lr must be in (0, inf), got -0.01; raise it"),
    ("lr-nan", T, lambda d, t, r, c: _train_argv(d, t / "o", "--lr", "nan"), "lr must be in (0, inf), got nan; give a number"),
    ("beta1>1", T, lambda d, t, r, c: _train_argv(d, t / "o", "--beta1", "2"), "beta1 must be in [0, 1), got 2.0; lower it"),
    ("grad-clip-negative", T, lambda d, t, r, c: _train_argv(d, t / "o", "--grad-clip", "-1"),
     "grad_clip must be in (0, inf] (inf: no clipping), got -1.0; raise it"),
    ("warmup-frac-negative", T, lambda d, t, r, c: _train_argv(d, t / "o", "--warmup-frac", "-1"),
     "warmup_frac must be in [0, 1], a share of the steps, got -1.0; raise it"),
    ("val-fraction-1.5", T, lambda d, t, r, c: _train_argv(d, t / "o", "--val-fraction", "1.5"),
     "val_fraction must be in (0, 1), a share of the documents, got 1.5; lower it"),
    ("resume-stop-step-passed", T, lambda d, t, r, c: _train_argv(d, _copy_run(r, t / "r"), "--resume", "--stop-step", "1"),
     "--stop-step 1 is not after the checkpoint's step 2: nothing to do; pass a --stop-step in 3..2, or drop it"),
    ("resume-flipped-weights", T, lambda d, t, r, c: _train_argv(d, flip_tensor_bytes(_copy_run(r, t / "r") / "latest").parent,
                                                                 "--resume"),
     "is corrupt: model.safetensors does not match the checksum in manifest.json"),
    ("train-into-a-finetune-folder", T, lambda d, t, r, c: _train_argv(d, _finetuned(t, c), "--resume"),
     "holds a fine-tuning run; pretraining there would overwrite its metrics.jsonl and checkpoints; pretrain into a new --out-dir"),
    ("ckpt-other-arch", S, lambda d, t, r, c: ["--ckpt", str(_edit_meta(_ckpt_copy(c, t / "k"), model_config=DENSE))],
     "does not match its model config"),
    ("ckpt-truncated", S, lambda d, t, r, c: ["--ckpt", str(_truncate(_ckpt_copy(c, t / "k") / "model.safetensors"))],
     "is corrupt: model.safetensors does not match the checksum in manifest.json"),
    ("ckpt-truncated-rechecksummed", S, lambda d, t, r, c: ["--ckpt", str(rechecksum(_truncate(_ckpt_copy(c, t / "k") /
                                                                                               "model.safetensors")))],
     "is corrupt or truncated: model.safetensors cannot be read"),
    # meta.json is covered by the manifest: one changed character is caught before a field of it is used
    ("ckpt-meta-one-char", S, lambda d, t, r, c: ["--ckpt", str(_k_three_to_two(c, t))],
     "is corrupt: meta.json does not match the checksum in manifest.json"),
    ("eval-meta-one-char", E, lambda d, t, r, c: ["--ckpt", str(_k_three_to_two(c, t)), "--device", "cpu"],
     "is corrupt: meta.json does not match the checksum in manifest.json"),
    ("hub-export-meta-one-char", H, lambda d, t, r, c: ["export", "--ckpt", str(_k_three_to_two(c, t)), "--to", str(t / "x")],
     "is corrupt: meta.json does not match the checksum in manifest.json"),
    ("finetune-meta-one-char", F, lambda d, t, r, c: _ft_argv(t, _k_three_to_two(c, t), t / "ft"),
     "is corrupt: meta.json does not match the checksum in manifest.json"),
    ("ckpt-manifest-damaged", S, lambda d, t, r, c: ["--ckpt", str(_write(_ckpt_copy(c, t / "k") / "manifest.json", b"{"))],
     "is corrupt: manifest.json is not a valid manifest"),
    ("ckpt-without-manifest", S, lambda d, t, r, c: ["--ckpt", str(_without(_ckpt_copy(c, t / "k"), "manifest.json"))],
     "has no manifest.json: it was saved before meta.json was checksummed (format_version 1), so its meta.json cannot be "
     "verified; if you trust it, add one with `python -m minimal_asymloop.integrity "),
    ("resume-only-junk-weights", T, lambda d, t, r, c: _train_argv(d, _write(t / "j" / "model.safetensors", bytes(range(250)) * 4),
                                                                   "--resume"),
     "no checkpoint to resume in"),
    ("ckpt-corrupt-meta", S, lambda d, t, r, c: ["--ckpt", str(rechecksum(_write(_ckpt_copy(c, t / "k") / "meta.json", b"{")))],
     "is corrupt: meta.json is not valid JSON"),
    ("ckpt-incomplete", S, lambda d, t, r, c: ["--ckpt", str(_without(_ckpt_copy(c, t / "k"), "state.pt"))],
     "is incomplete: missing state.pt"),
    ("ckpt-newer-format", S, lambda d, t, r, c: ["--ckpt", str(_edit_meta(_ckpt_copy(c, t / "k"), format_version=ckpt.FORMAT_VERSION + 1))],
     f"has format_version {ckpt.FORMAT_VERSION + 1}, newer than this code's {ckpt.FORMAT_VERSION}; update minimal-asymloop to load it"),
    ("ckpt-missing", S, lambda d, t, r, c: ["--ckpt", str(t / "nothing")], "no checkpoint at"),
    ("ckpt-flipped-weights", S, lambda d, t, r, c: ["--ckpt", str(flip_tensor_bytes(_ckpt_copy(c, t / "k")))],
     "is corrupt: model.safetensors does not match the checksum in manifest.json"),
    ("ckpt-nan-weights", S, lambda d, t, r, c: ["--ckpt", str(_nan_weights(_ckpt_copy(c, t / "k")))],
     "is corrupt: its weights hold inf/NaN values (first in "),
    ("ckpt-meta-wrong-type", S, lambda d, t, r, c: ["--ckpt", str(_edit_meta(_ckpt_copy(c, t / "k"), model_config="x"))],
     "is corrupt: meta.json field 'model_config' should be a JSON object, got \"x\""),
    ("ckpt-meta-is-a-folder", S, lambda d, t, r, c: ["--ckpt", str(_dir_for(_ckpt_copy(c, t / "k"), "meta.json"))],
     "meta.json: it is a folder, not a file"),
    ("eval-flipped-weights", E, lambda d, t, r, c: ["--ckpt", str(flip_tensor_bytes(_ckpt_copy(c, t / "k"))), "--device", "cpu"],
     "is corrupt: model.safetensors does not match the checksum in manifest.json"),
    ("eval-out-under-a-file", E, lambda d, t, r, c: ["--ckpt", str(c), "--device", "cpu", "--eval-batches", "1",
                                                     "--out", str(_write(t / "f", b"x") / "f" / "eval.json")],
     "f/.eval.json.tmp-"),
    ("hub-export-flipped-weights", H, lambda d, t, r, c: ["export", "--ckpt", str(flip_tensor_bytes(_ckpt_copy(c, t / "k"))),
                                                          "--to", str(t / "x")],
     "is corrupt: model.safetensors does not match the checksum in manifest.json"),
    ("hub-export-under-a-file", H, lambda d, t, r, c: ["export", "--ckpt", str(c), "--to", str(_write(t / "f", b"x") / "f" / "x")],
     "f: it exists and is not a folder; choose another path or remove it"),
    ("finetune-into-a-pretraining-folder", F, lambda d, t, r, c: _ft_argv(t, c, _copy_run(r, t / "r")),
     "holds a pretraining run; fine-tuning there would overwrite its metrics.jsonl and checkpoints; fine-tune into a new --out-dir"),
    ("finetune-seq-len>max", F, lambda d, t, r, c: _ft_argv(t, c, t / "ft", "--seq-len", "4096"),
     "seq_len=4096 exceeds the model's max_seq_len=64; pass --seq-len 64 or less"),
    ("finetune-lr-negative", F, lambda d, t, r, c: _ft_argv(t, c, t / "ft", "--lr", "-1"), "lr must be in (0, inf), got -1.0; raise it"),
    # values out of range, answered before any data is prepared (--data points nowhere: reaching it would be another error)
    *[(f"{opt}={v}", T, _with_no_data(f"--{opt}", v), want)
      for opt, v, want in [
          ("seed", "-1", "seed must be an integer in [0, 2**63 - 1], got -1"),
          ("seed", "1e30", "seed must be an integer in [0, 2**63 - 1], got 1000000000000000019884624838656"),
          ("init-std", "-1", "init_std must be a finite number > 0, got -1.0"),
          ("init-std", "nan", "init_std must be a finite number > 0, got nan"),
          ("init-std", "inf", "init_std must be a finite number > 0, got inf"),
          ("rope-theta", "-1", "rope_theta must be a finite number > 0, got -1.0"),
          ("rope-theta", "0", "rope_theta must be a finite number > 0, got 0.0"),
          ("rope-theta", "nan", "rope_theta must be a finite number > 0, got nan"),
          ("rope-theta", "inf", "rope_theta must be a finite number > 0, got inf"),
          ("norm-eps", "-1", "norm_eps must be a finite number > 0, got -1.0"),
          ("norm-eps", "nan", "norm_eps must be a finite number > 0, got nan"),
          ("norm-eps", "inf", "norm_eps must be a finite number > 0, got inf"),
          ("moe-balance-weight", "nan", "moe_balance_weight must be a finite number >= 0, got nan"),
          ("moe-balance-weight", "inf", "moe_balance_weight must be a finite number >= 0, got inf"),
          ("alrs-hi", "inf", "alrs_hi must be in (0, 100] (ours: a larger LR multiplier only diverges), got inf; lower it"),
          ("alrs-hi", "1e30", "alrs_hi must be in (0, 100] (ours: a larger LR multiplier only diverges), got 1e+30; lower it"),
          ("out-dir", "", "out_dir must name a folder, got ''; e.g. --out-dir out"),
          ("data-cache", "", "data_cache must name a folder, got ''; e.g. --data-cache data_cache"),
          ("data-workers", "100000", "data_workers=100000 exceeds this machine's "),
          ("n-layer", "100000000", "this model needs at least "),
          ("d-model", "1000000", "this model needs at least "),
          ("vocab-size", "1e10", "this model needs at least "),
          ("max-seq-len", "1e10", "this model needs at least "),
      ]],
    ("eval-batches-1e9", T, lambda d, t, r, c: _train_argv(d, t / "o", "--eval-batches", "1e9"),
     "--eval-batches asks for 8,000,000,000 evaluation windows of 33 tokens"),
    ("beta2-0-is-valid", T, lambda d, t, r, c: _train_argv(d, t / "o", "--beta2", "0", "--stop-step", "1", "--seq-len", "9999"),
     "seq_len=9999 exceeds the model's max_seq_len=64"),  # beta2=0 passes the checks: the next problem is reported
    ("data-jsonl-text-a-number", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "j" / "a.jsonl", b'{"text": 5}\n')),
                                                                   "--data-cache", str(t / "dc")),
     "document 1 has a 'text' of 5, not a string"),
    ("data-jsonl-text-null", T, lambda d, t, r, c: _train_argv(d, t / "o", "--data", str(_write(t / "j" / "a.jsonl", b'{"text": null}\n')),
                                                               "--data-cache", str(t / "dc")),
     "document 1 has a 'text' of null, not a string"),
    ("sample-temperature-nan", S, lambda d, t, r, c: ["--ckpt", str(c), "--temperature", "nan"],
     "--temperature must be >= 0 (0 = greedy) and finite, got nan"),
    ("eval-device-tpu", E, lambda d, t, r, c: ["--ckpt", str(c), "--device", "tpu"], "unknown device 'tpu'; choose one of auto, cuda"),
    ("eval-batches-1000000", E, lambda d, t, r, c: ["--ckpt", str(c), "--device", "cpu", "--eval-batches", "1000000"],
     "--eval-batches asks for 8,000,000 evaluation windows of 33 tokens"),
    ("finetune-device-tpu", F, lambda d, t, r, c: _ft_argv(t, c, t / "ft", "--device", "tpu"), "unknown device 'tpu'; choose one of auto"),
    ("finetune-dtype-foo", F, lambda d, t, r, c: _ft_argv(t, c, t / "ft", "--dtype", "foo"), "unknown dtype 'foo'; choose one of auto"),
    ("finetune-seed-negative", F, lambda d, t, r, c: _ft_argv(t, c, t / "ft", "--seed", "-1"), "seed must be an integer in [0, 2**63 - 1]"),
    ("finetune-not-utf8", F, lambda d, t, r, c: [*_ft_argv(t, c, t / "ft"), "--data", str(_gsm8k_with(t / "g", b"caf\xe9\n"))],
     "train.jsonl (byte 0xe9 at offset 3) is not UTF-8 text"),
    ("finetune-row-a-list", F, lambda d, t, r, c: [*_ft_argv(t, c, t / "ft"), "--data", str(_gsm8k_with(t / "g", b"[1, 2]\n"))],
     "train.jsonl:1 is [1, 2], not a JSON object"),
    ("finetune-row-null", F, lambda d, t, r, c: [*_ft_argv(t, c, t / "ft"), "--data", str(_gsm8k_with(t / "g", b"null\n"))],
     "train.jsonl:1 is null, not a JSON object"),
    ("finetune-out-dir-under-a-file", F, lambda d, t, r, c: _ft_argv(t, c, _write(t / "f", b"x") / "f" / "ft"),
     "(Not a directory); choose a writable --out-dir"),
]


@pytest.mark.parametrize("name, cli, argv, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line(name, cli, argv, expected, data_cache, tmp_path, cli_run, tiny_checkpoint, capsys):
    args = argv(data_cache, tmp_path, cli_run, tiny_checkpoint)
    main = MAINS[cli]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if isinstance(e.value.code, str):  # sys.exit("error: ..."): Python prints exactly this line to stderr
        line = e.value.code
        assert "\n" not in line and line.startswith("error: ")
    else:  # argparse: usage, then "prog: error: ..." as the last line, exit code 2
        assert e.value.code == 2
        line = err.strip().splitlines()[-1]
        assert ": error: " in line
    assert expected in line, line
