"""The trainer: loss falls, exact resume, schedule, parameter groups, checkpoints and clear errors."""

import json
import math

import pytest
import torch
from test_reliability import rechecksum

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.trainer import ConfigError, NonFiniteLossError, TrainConfig, evaluate_loss, lr_at, param_groups, read_metrics, train


def test_tiny_run_loss_falls_and_writes_everything(tiny_configs, stdlib_data):
    mcfg, tcfg = tiny_configs(max_steps=40, eval_interval=20)
    res = train(mcfg, tcfg)
    rows = [r for r in res["history"] if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all({"tokens", "lr", "grad_norm", "tok_per_s"} <= set(r) for r in rows)
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first == pytest.approx(math.log(512), abs=0.3)  # starts near uniform over the vocabulary
    assert last < first - 0.6, (first, last)
    vals = [r for r in res["history"] if "val_loss" in r]
    assert [r["step"] for r in vals] == [20, 40] and res["val_loss"] == vals[-1]["val_loss"]
    assert res["val_loss"] < res["unigram_entropy"] + 0.5  # tiny model, 40 steps: close to the unigram model already
    out = tcfg.out_dir
    meta = json.loads(open(f"{out}/latest/meta.json").read())
    assert meta["step"] == 40 and meta["format_version"] == ckpt.FORMAT_VERSION and meta["model_config"]["arch"] == "asymloop"
    assert (ckpt.find_checkpoint(out).name, (ckpt.find_checkpoint(f"{out}/best")).name) == ("ckpt_0000040", "ckpt_0000040")
    model, tok, meta = ckpt.load_model(out)
    assert tok.get_vocab_size() == stdlib_data.vocab_size
    again = evaluate_loss(model, stdlib_data.val, 32, 8, 2)  # the same fixed batches give the same loss
    assert again == pytest.approx(res["val_loss"], abs=1e-6)
    assert (tmp := __import__("pathlib").Path(out) / "loss.png").exists() and tmp.stat().st_size > 1000


def test_exact_resume_2n_equals_n_plus_n(tiny_configs, tmp_path):
    mcfg, full = tiny_configs(max_steps=12, eval_interval=4, out_dir=str(tmp_path / "full"))
    train(mcfg, full)
    _, half = tiny_configs(max_steps=12, eval_interval=4, out_dir=str(tmp_path / "half"), stop_step=6)
    res = train(mcfg, half)
    assert res["step"] == 6 and res["interrupted"]
    _, rest = tiny_configs(max_steps=12, eval_interval=4, out_dir=str(tmp_path / "half"), resume=True)
    train(mcfg, rest)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "half")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):  # identical losses, LRs and val losses at every step, not just close
        assert {k: ra[k] for k in ("loss", "lr", "grad_norm", "val_loss") if k in ra} == \
               {k: rb[k] for k in ("loss", "lr", "grad_norm", "val_loss") if k in rb}


def test_resume_with_incompatible_config_is_a_clear_error(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=4, eval_interval=2)
    train(mcfg, tcfg)
    _, other = tiny_configs(max_steps=4, eval_interval=2, lr=1e-2, resume=True)
    with pytest.raises(ConfigError, match=r"cannot resume .*lr: 0.003 -> 0.01"):
        train(mcfg, other)
    bigger = ModelConfig(**{**mcfg.to_dict(), "n_iter": 5})
    with pytest.raises(ConfigError, match=r"n_iter: 3 -> 5"):
        train(bigger, TrainConfig(**{**tcfg.__dict__, "resume": True}))


def test_lr_schedule_warmup_cosine_to_tenth():
    cfg = TrainConfig(max_steps=100, lr=1e-3)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # 10% linear warmup
    assert max(lrs) == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4, rel=1e-2)  # cosine to 0.1x
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 0.9e-3)  # halfway through the decay


def test_param_groups_decay_only_matrices():
    model = LoopedLM(ModelConfig(arch="asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=64, max_seq_len=16))
    groups = param_groups(model, 0.1)
    assert [g["name"] for g in groups] == ["matrices", "vectors"]
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and all(p.dim() == 1 for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    per = param_groups(model, 0.1, per_matrix=True)
    names = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert {g["name"] for g in per[:-1]} == names and all(len(g["params"]) == 1 for g in per[:-1])
    assert all(g["lr_mult"] == 1.0 for g in per) and "embed.weight" in names and "head.weight" in names


def test_non_finite_loss_stops_with_step_and_keeps_last_good_checkpoint(tiny_configs):
    class Poison:  # an lr_hook that breaks the weights before step 6
        per_matrix = False

        def on_step(self, step, model, optimizer):
            if step == 5:
                with torch.no_grad():
                    model.head.weight.fill_(float("nan"))

        def state_dict(self):
            return {}

        def load_state_dict(self, d):
            pass

    mcfg, tcfg = tiny_configs(max_steps=10, eval_interval=4)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 6"):
        train(mcfg, tcfg, lr_hook=Poison())
    assert json.loads(open(f"{tcfg.out_dir}/latest/meta.json").read())["step"] == 4
    assert max(r["step"] for r in read_metrics(tcfg.out_dir)) == 5


@pytest.mark.parametrize("argv, message", [
    (["--size", "7b"], "unknown size '7b'; choose one of tiny, 60m, 135m, 350m, 1b"),
    (["--lrr", "3"], "unknown option '--lrr'; did you mean --lr?"),
    (["--arch", "loop"], "unknown arch 'loop'; choose one of dense, full_loop, asymloop"),
    (["--dtype", "fp16"], "unknown dtype 'fp16'"),
])
def test_cli_rejects_bad_arguments_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_minimal.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_errors_from_training_are_one_line(tmp_path, data_cache, capsys):
    with pytest.raises(SystemExit, match=r"error: no data files found at .*nowhere"):
        train_minimal.main(["--data", str(tmp_path / "nowhere/*.parquet"), "--out-dir", str(tmp_path / "o")])
    # a tokenizer (BPE, 512 tokens) that does not fit the model's vocabulary (256)
    with pytest.raises(SystemExit, match=r"tokenizer has 512 tokens but the model's vocab_size is 256; set --vocab-size 512"):
        train_minimal.main(["--bpe-vocab", "512", "--vocab-size", "256", "--max-data-tokens", "150000", "--val-fraction", "0.2",
                            "--data-cache", str(data_cache), "--out-dir", str(tmp_path / "o"), "--max-steps", "1"])


def test_corrupt_missing_and_newer_checkpoints_are_clear_errors(tiny_checkpoint, tmp_path):
    import shutil

    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at"):
        ckpt.load_model(tmp_path / "empty")
    bad = tmp_path / "bad"
    shutil.copytree(ckpt.find_checkpoint(tiny_checkpoint), bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ckpt.CheckpointError, match="is corrupt: model.safetensors does not match the checksum in manifest.json"):
        ckpt.load_model(bad)
    (bad / "state.pt").write_bytes(b"not a zip")
    with pytest.raises(ckpt.CheckpointError, match="corrupt: state.pt"):
        ckpt.load_state(bad)
    meta = json.loads((bad / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "format_version": ckpt.FORMAT_VERSION + 1}))
    with pytest.raises(ckpt.CheckpointError, match="meta.json does not match the checksum in manifest.json"):
        ckpt.load_model(bad)
    rechecksum(bad)  # from here meta.json is what the manifest says (another tool's checkpoint): what it says is checked
    with pytest.raises(ckpt.CheckpointError, match="newer than this code"):
        ckpt.load_model(bad)
    (bad / "meta.json").write_text("{")
    rechecksum(bad)
    with pytest.raises(ckpt.CheckpointError, match="meta.json is not valid JSON"):
        ckpt.load_model(bad)
    (bad / "model.safetensors").write_bytes(data)
    (bad / "meta.json").write_text(json.dumps({**meta, "model_config": {**meta["model_config"], "d_model": 48, "n_head": 2}}))
    rechecksum(bad)
    with pytest.raises(ckpt.CheckpointError, match="does not match its model config"):
        ckpt.load_model(bad)
    (bad / "state.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="incomplete: missing state.pt"):
        ckpt.load_model(bad)


def test_cli_public_flags_and_override_parsing():
    p = train_minimal.build_parser()
    flags = {o for a in p._actions for o in a.option_strings}
    public = {"--size", "--arch", "--n-iter", "--data", "--out-dir", "--device", "--dtype", "--compile", "--max-steps", "--seed",
              "--resume", "--micro-batch", "--tokens", "--eval-interval", "--eval-batches"}
    assert public <= flags
    args = vars(p.parse_args(["--compile", "--qk-norm", "false", "--tokens", "1.68e9", "--n-enc", "none", "--lr", "3e-4"]))
    assert args == dict(size="tiny", arch="asymloop", moe=False, compile=True, qk_norm=False, tokens=1_680_000_000, n_enc=None, lr=3e-4)
    cfg = TrainConfig.from_preset("60m")
    assert (cfg.seq_len, cfg.global_batch, cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.tokenizer) == (1024, 512, 1e-3, 0.1, 1.0, "t5")
    assert cfg.total_steps() == 3205 and TrainConfig.from_preset("60m", max_steps=7).total_steps() == 7


def test_no_argument_run_machinery_cut_down(data_cache, tmp_path, capsys):
    """`python train_minimal.py` as shipped (tiny preset: d 192, 4 blocks, AsymLoop K=3, batch 16), cut to
    12 steps at seq 64 on the test slice of the stdlib corpus (its BPE has 512 tokens, hence --vocab-size 512)."""
    out = tmp_path / "noarg"
    train_minimal.main(["--max-steps", "12", "--seq-len", "64", "--eval-interval", "12", "--eval-batches", "2",
                        "--vocab-size", "512", "--bpe-vocab", "512", "--max-data-tokens", "150000", "--val-fraction", "0.2",
                        "--data-cache", str(data_cache), "--out-dir", str(out)])
    printed = capsys.readouterr()
    text = printed.out + printed.err
    for expected in ("asymloop K=3", "effective depth 8", "MFLOPs/token", "1,024 tokens/step", "12 steps", "unigram entropy",
                     "final val loss"):
        assert expected in text, expected
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert len(rows) == 12 and rows[-1]["loss"] < rows[0]["loss"] - 0.5, (rows[0]["loss"], rows[-1]["loss"])
    assert ckpt.read_meta(out)["model_config"]["d_model"] == 192 and (out / "loss.png").exists()
