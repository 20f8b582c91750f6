"""The paper's other setups: Appendix G's data and tokenizer, Table 4a/4b's ablations, Appendix E's widened Full Loop."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minimal_asymloop import data as D
from minimal_asymloop import sources as S
from minimal_asymloop.alrs import DecoderLRBoost
from minimal_asymloop.flops import count_params, flops_per_token, matched_dec_d_ff
from minimal_asymloop.model import WIDE_FULL_LOOP_D_FF, LoopedLM, ModelConfig
from minimal_asymloop.trainer import ConfigError, TrainConfig, lr_at, make_alrs, param_groups, train

# ----------------------------------------------------------------------------- Appendix G: SmolLM corpus and tokenizer

DOCS = [dict(text=f"Photosynthesis lesson {i}: plants turn light, water and carbon dioxide into sugar.", id=f"<urn:uuid:{i:04d}>",
             metadata=dict(dump="CC-MAIN-2024-10", url=f"https://example.org/{i}", score=3.1, int_score=3, token_count=17))
        for i in range(60)]  # the schema of smollm-corpus/fineweb-edu-dedup rows: text, id, metadata


@pytest.fixture
def smollm_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding a stand-in for SmolLM-135M's tokenizer.json (a small byte-level BPE with the
    same first special tokens), so the loader runs offline."""
    import huggingface_hub.constants

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([d["text"] for d in DOCS], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM-135M"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    tok.save(str(repo / "snapshots" / "0123abcd" / "tokenizer.json"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tok


def test_smollm_tokenizer_loads_from_the_cache(smollm_cache):
    tok = S.load_smollm_tokenizer()
    assert tok.to_str() == smollm_cache.to_str() and S.eot_id(tok) == 0


def test_smollm_tokenizer_offline_and_not_cached_fails_fast(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    t0 = time.time()
    with pytest.raises(S.DataError, match=r"the SmolLM tokenizer \(HuggingFaceTB/SmolLM-135M\) needs the Hugging Face Hub, "
                                          r"but offline mode is on.*--tokenizer bpe"):
        D.prepare("stdlib", "smollm", cache_dir=str(tmp_path / "c"), max_tokens=1000, quiet=True)
    assert time.time() - t0 < 30


def test_fineweb_edu_dedup_offline_fails_fast(tmp_path):
    with pytest.raises(S.DataError, match=r"--data fineweb-edu-dedup needs the Hugging Face Hub, but offline mode is on"):
        D.prepare("fineweb-edu-dedup", "bpe", cache_dir=str(tmp_path), quiet=True)
    assert S.source_identity("fineweb-edu-dedup", None) == dict(kind="smollm-corpus", repo="HuggingFaceTB/smollm-corpus",
                                                                config="fineweb-edu-dedup", max_tokens=None)


def test_a_local_copy_of_the_smollm_corpus_prepares_with_the_smollm_tokenizer(smollm_cache, tmp_path):
    path = tmp_path / "fineweb-edu-dedup.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    prep = D.prepare(str(path), "smollm", cache_dir=str(tmp_path / "cache"), val_fraction=0.2, quiet=True)
    assert prep.meta["tokenizer"] == dict(name="smollm", repo="HuggingFaceTB/SmolLM-135M")
    assert prep.vocab_size == smollm_cache.get_vocab_size()
    val_ids = [d["id"] for d in DOCS if S.is_val(d["id"], 0.2)]  # held out by a hash of each row's id
    assert prep.meta["n_val_docs"] == len(val_ids) > 0 and prep.meta["n_train_docs"] == len(DOCS) - len(val_ids)
    first = next(d for d in DOCS if not S.is_val(d["id"], 0.2))
    n = len(smollm_cache.encode(first["text"], add_special_tokens=False).ids)
    assert smollm_cache.decode(prep.train.window(0, n).tolist()) == first["text"]


# ----------------------------------------------------------------------------- Table 4a and Appendix E


def test_parameter_matched_without_global_kv_at_60m():
    asym = ModelConfig.from_preset("60m")
    width = matched_dec_d_ff(asym)
    assert width == 2048 + 512  # 2·d² per decoder layer -> 3·d·Δ wider FFN weights: Δ = 2d/3
    matched = ModelConfig.from_preset("60m", context="none", dec_d_ff=width)
    assert abs(count_params(matched) / count_params(asym) - 1) < 0.005
    plain = ModelConfig.from_preset("60m", context="none")
    assert count_params(asym) - count_params(plain) > 0.03 * count_params(asym)  # unmatched: ~3.7% fewer
    model = LoopedLM(ModelConfig(arch="asymloop", n_layer=4, d_model=32, n_head=4, d_ff=48, vocab_size=64, context="none", dec_d_ff=72))
    assert [b.mlp.up.out_features for b in (*model.encoder, *model.decoder)] == [48, 48, 72, 72]  # only the decoder widens
    f, f0 = flops_per_token(matched), flops_per_token(plain)
    assert f["total"] - f0["total"] == 6 * 768 * 512 * 3 * 3  # 6·d·Δ per decoder layer per iteration
    with pytest.raises(ValueError, match="dec_d_ff applies only to arch='asymloop'"):
        ModelConfig.from_preset("60m", "full_loop", dec_d_ff=2560)


@pytest.mark.parametrize("size", ["60m", "135m"])
def test_widened_full_loop_matches_asymloop_training_flops(size):
    asym, wide = ModelConfig.from_preset(size), ModelConfig.from_preset(size, "full_loop", d_ff=WIDE_FULL_LOOP_D_FF)
    assert abs(flops_per_token(wide)["total"] / flops_per_token(asym)["total"] - 1) < 0.01


def test_model_table_prints_the_matched_baselines():
    out = subprocess.run([sys.executable, "-m", "minimal_asymloop.flops"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[1]).stdout
    assert "| 60m | full_loop K=2, FFN 2656 (App. E) | 100.23M | +5.10% | 0.291 | -0.6% |" in out
    assert "| 60m | asymloop K=3 without Global KV, decoder FFN 2560 (Table 4a) | 95.37M |" in out


# ----------------------------------------------------------------------------- Table 4b: a fixed decoder LR boost


def test_decoder_boost_sets_every_decoder_matrix_and_nothing_else():
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(arch="asymloop", n_layer=4, d_model=64, n_head=4, d_ff=128, vocab_size=128))
    cfg = TrainConfig(max_steps=100, lr=1e-3, dec_lr_mult=2.5)
    hook = make_alrs(cfg, "asymloop")
    assert isinstance(hook, DecoderLRBoost)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay, per_matrix=hook.per_matrix))
    assert hook.on_step(0, model, opt) == dict(dec_lr_mult=2.5, dec_lr_matrices=2 * 9)  # 2 layers x (q k v o k_glob v_glob gate up down)
    for step in (0, 50):
        assert hook.on_step(step, model, opt) is None or step == 0
        for g in opt.param_groups:  # as the trainer sets them
            g["lr"] = lr_at(step, cfg) * g["lr_mult"]
        for g in opt.param_groups:
            boosted = g["name"].startswith("decoder.")
            assert g["lr"] == pytest.approx(lr_at(step, cfg) * (2.5 if boosted else 1.0)), g["name"]
    names = {g["name"] for g in opt.param_groups}
    assert {"decoder.0.attn.wk_glob.weight", "encoder.0.mlp.up.weight", "embed.weight", "vectors"} <= names


def test_decoder_boost_settings_fail_clearly():
    with pytest.raises(ConfigError, match="only arch='asymloop'"):
        make_alrs(TrainConfig(max_steps=10, dec_lr_mult=2.0), "full_loop")
    with pytest.raises(ConfigError, match="replaces ALRS"):
        TrainConfig(max_steps=10, dec_lr_mult=2.0, alrs=True)
    with pytest.raises(ConfigError, match="must be a positive number"):
        TrainConfig(max_steps=10, dec_lr_mult=0.0)


def test_decoder_boost_in_a_training_run(tiny_configs):
    mcfg, tcfg = tiny_configs(max_steps=2, eval_interval=2, dec_lr_mult=1.5)
    res = train(mcfg, tcfg)
    assert res["history"][0]["dec_lr_mult"] == 1.5 and "alrs_step" not in res["history"][0]


def test_ablation_flags_on_the_command_line():
    import train_minimal

    argv = ["--size", "60m", "--context", "none", "--dec-d-ff", "2560", "--dec-lr-mult", "1.5"]
    args = vars(train_minimal.build_parser().parse_args(argv))
    assert (args["dec_d_ff"], args["dec_lr_mult"], args["context"]) == (2560, 1.5, "none")
