"""MoE and the OLMo-style backbone through the trainer and the command line (tiny CPU runs, seconds)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import train_minimal
from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.trainer import TRAIN_PRESETS, TrainConfig, compute_loss, train


def falls(rows, by=0.5):
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    return last < first - by, (first, last)


def test_tiny_moe_run_reduces_loss_and_logs_aux_and_load(tiny_configs):
    mcfg, tcfg = tiny_configs("asymloop", model=dict(moe_experts=4), max_steps=30, eval_interval=15)
    res = train(mcfg, tcfg)
    rows = [r for r in res["history"] if "loss" in r]
    ok, detail = falls(rows)
    assert ok, detail
    layers = ("encoder.0", "decoder.0")  # n_layer 2: E = D = 1
    for r in rows:
        assert 0.01 * (1 - 1e-4) <= r["moe_balance_loss"] <= 0.01 * 4 / 2  # w·[1, E/k]
        assert 0 < r["moe_z_loss"] < 0.1
        assert all(0 < r[f"moe_load_entropy/{n}"] <= math.log(4) + 1e-6 for n in layers)
    assert all("moe_balance_loss" not in r for r in res["history"] if "val_loss" in r)


def test_validation_cross_entropy_excludes_aux_losses(tiny_configs, stdlib_data):
    mcfg, tcfg = tiny_configs("full_loop", model=dict(moe_experts=4), max_steps=2, eval_interval=2)
    train(mcfg, tcfg)
    model, _, _ = ckpt.load_model(tcfg.out_dir)
    w = torch.from_numpy(stdlib_data.val.window(0, 4 * 33).astype("int64")).view(4, 33)
    x, y = w[:, :-1], w[:, 1:]
    model.eval()
    with torch.no_grad():
        loss, ce, aux = compute_loss(model, x, y)
        expected = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
    assert aux == {} and torch.equal(loss, ce)
    torch.testing.assert_close(ce, expected)
    model.train()
    with torch.no_grad():
        loss, ce, aux = compute_loss(model, x, y)
    assert set(aux) == {"moe_balance_loss", "moe_z_loss"}
    torch.testing.assert_close(ce, expected, atol=1e-5, rtol=1e-5)  # same CE, aux on top
    torch.testing.assert_close(loss, expected + aux["moe_balance_loss"] + aux["moe_z_loss"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["full_loop", "asymloop"])
def test_scaled_down_olmo8_run_reduces_loss(tiny_configs, arch):
    # the (ours) OLMo-2 option (norm after each sublayer + QKNorm) at test size: 4 blocks (E = D = 2 for asymloop)
    model = dict(backbone="olmo2", n_layer=4)
    mcfg, tcfg = tiny_configs(arch, model=model, max_steps=30, eval_interval=30)
    assert mcfg.qk_norm and mcfg.effective_depth == 8
    res = train(mcfg, tcfg)
    ok, detail = falls([r for r in res["history"] if "loss" in r])
    assert ok, detail
    assert res["val_loss"] < res["unigram_entropy"] + 0.5


def test_cli_moe_flag_and_olmo8_size(tmp_path, data_cache):
    common = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--d-ff", "64", "--vocab-size", "512", "--max-seq-len", "64",
              "--bpe-vocab", "512", "--max-data-tokens", "150000", "--val-fraction", "0.2", "--data-cache", str(data_cache),
              "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4", "--max-steps", "2", "--eval-interval", "2",
              "--eval-batches", "1", "--device", "cpu", "--quiet"]
    train_minimal.main(["--moe", *common, "--out-dir", str(tmp_path / "a")])
    meta = json.loads((tmp_path / "a/latest/meta.json").read_text())["model_config"]
    assert (meta["moe_experts"], meta["moe_top_k"], meta["moe_d_ff"]) == (8, 2, 32)  # paper settings, width d_ff/2
    train_minimal.main(["--moe", "--moe-experts", "4", "--moe-top-k", "1", *common, "--out-dir", str(tmp_path / "b")])
    meta = json.loads((tmp_path / "b/latest/meta.json").read_text())["model_config"]
    assert (meta["moe_experts"], meta["moe_top_k"], meta["moe_d_ff"]) == (4, 1, 64)  # explicit options win
    # --size olmo8 picks both the model and its training preset
    assert ("olmo8" in TRAIN_PRESETS) and TrainConfig.from_preset("olmo8").seq_len == 1024
    train_minimal.main(["--size", "olmo8", "--arch", "full_loop", *common, "--data", "stdlib", "--tokenizer", "bpe",
                        "--out-dir", str(tmp_path / "c")])
    meta = json.loads((tmp_path / "c/latest/meta.json").read_text())["model_config"]
    assert (meta["backbone"], meta["qk_norm"], meta["n_iter"], meta["moe_experts"]) == ("llama", False, 2, 0)  # Appendix G: pre-norm
