"""transformers: an export loads with AutoModelForCausalLM and AutoTokenizer, and computes what our code computes.

Needs the optional `hf` extra (transformers); without it the module is skipped, saying so. Offline, on checkpoints
made here: random tiny models of every architecture (logits), and conftest's `tiny_checkpoint`, a 30-step run
(generation, pipelines, lm-eval). One test loads the export in a fresh process where `minimal_asymloop` cannot be
imported, as a user without our package would.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason='transformers is an optional extra: pip install -e ".[hf]"')
pytestmark = pytest.mark.extra  # CI runs these after installing the extras: python -m pytest -m extra

import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402
from transformers.dynamic_module_utils import get_class_from_dynamic_module  # noqa: E402

from minimal_asymloop import hf, hf_files, hub  # noqa: E402
from minimal_asymloop.checkpoint import load_model, save_checkpoint  # noqa: E402
from minimal_asymloop.generate import generate, generate_adaptive  # noqa: E402
from minimal_asymloop.model import LoopedLM, ModelConfig  # noqa: E402
from minimal_asymloop.sources import eot_id, train_bpe  # noqa: E402

TEXT = ["def main(x):\n    return x + 1\n", "import os\nprint('hello world')\n", "class A:\n    pass\n",
        "Looped transformers reuse their decoder weights at every iteration.\n"] * 30
SMALL = dict(n_layer=2, d_model=32, n_head=2, d_ff=64, max_seq_len=64)
ARCHS = {  # every architecture and ablation the config can express, tiny
    "dense": dict(arch="dense"),
    "full_loop": dict(arch="full_loop"),
    "full_loop_olmo2": dict(arch="full_loop", backbone="olmo2"),
    "asymloop": dict(arch="asymloop"),
    "asymloop_additive": dict(arch="asymloop", context="additive"),
    "asymloop_no_context": dict(arch="asymloop", context="none"),
    "asymloop_no_local_kv": dict(arch="asymloop", local_kv=False),
    "asymloop_wide_decoder_no_qknorm": dict(arch="asymloop", dec_d_ff=96, qk_norm=False),
    "asymloop_moe": dict(arch="asymloop", moe_experts=4, moe_top_k=2),
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXT, 300)


def random_checkpoint(folder: Path, tok: Tokenizer, seed: int = 0, **model) -> LoopedLM:
    torch.manual_seed(seed)
    m = LoopedLM(ModelConfig(**{**SMALL, "vocab_size": tok.get_vocab_size(), **model})).eval()
    with torch.no_grad():  # larger weights than the init's: sharper predictions, so greedy decoding meets no near-ties
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(8)
    save_checkpoint(folder, m, {}, {"model_config": m.config.to_dict(), "train_config": {}, "step": 0, "data": {}}, tok)
    return m


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    """(export folder, our LoopedLM, our tokenizer) of the 30-step run."""
    folder = hub.export(tiny_checkpoint, tmp_path_factory.mktemp("hf") / "export")
    model, tok, _ = load_model(tiny_checkpoint)
    return folder, model, tok


def remote(folder, **kw):
    """The export's own code (its modeling_asymloop.py), loaded as trust_remote_code=True loads it. (In this process
    AutoModelForCausalLM would pick our registered class: transformers 5 prefers it to a folder's code.)"""
    cls = get_class_from_dynamic_module("modeling_asymloop.AsymLoopForCausalLM", str(folder))
    cls.register_for_auto_class("AutoModelForCausalLM")  # as the Auto path does: save_pretrained then copies the code
    return cls.from_pretrained(folder, **kw).eval()


def test_config_carries_every_model_config_field_and_checks_them():
    for spec in ARCHS.values():
        cfg = ModelConfig(**SMALL, vocab_size=50, **spec)
        hcfg = hf.AsymLoopConfig(**cfg.to_dict())
        assert hcfg.to_model_config() == cfg and hcfg.model_type == "asymloop"
        assert AutoConfig.for_model("asymloop", **cfg.to_dict()).to_model_config() == cfg
    assert (hcfg.hidden_size, hcfg.num_hidden_layers, hcfg.max_position_embeddings) == (32, 2, 64)
    with pytest.raises(ValueError, match="unknown arch 'loop'; choose one of dense, full_loop, asymloop"):
        hf.AsymLoopConfig(arch="loop")
    with pytest.raises(ValueError, match="differ from its model_config"):
        hf.AsymLoopConfig(**cfg.to_dict(), model_config={**cfg.to_dict(), "n_iter": 5})


@pytest.mark.parametrize("name", ARCHS)
def test_logits_and_loss_equal_looped_lm_for_every_architecture(name, bpe, tmp_path):
    ours = random_checkpoint(tmp_path / "ckpt", bpe, **ARCHS[name])
    folder = hub.export(tmp_path / "ckpt", tmp_path / "export")
    x = torch.randint(0, bpe.get_vocab_size(), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_loss = ours(x[:, :-1], targets=x[:, 1:])
        packaged = AutoModelForCausalLM.from_pretrained(folder).eval()  # no trust_remote_code: our registered class
        assert type(packaged) is hf.AsymLoopForCausalLM and type(remote(folder)).__module__.startswith("transformers_modules.")
        for model in (remote(folder), packaged):  # the export's code and ours
            # Logits on the same 23 positions as ours: a different length changes the matmuls' blocking, which moved
            # them by 2.4e-6 on an AVX2 CPU. The loss takes the unshifted labels, as transformers' users pass them.
            diff = (model(x[:, :-1]).logits - ref).abs().max().item()
            print(f"{name}: max |logit difference| {diff:.3g}")
            assert diff <= 1e-6 and model(x, labels=x).loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)


def test_generate_equals_our_sampler_with_and_without_cache_at_any_depth(exported):
    folder, ours, tok = exported
    model = remote(folder)
    idx = torch.tensor([tok.encode("def main(", add_special_tokens=False).ids])
    eot = eot_id(tok)

    def same(kw, **ref):
        got = model.generate(idx, max_new_tokens=24, do_sample=False, **kw)
        want = generate(ours, idx, 24, temperature=0, stop_id=eot, **ref)
        assert got.tolist() == want.tolist(), kw
        return got

    same({})
    same({"use_cache": False}, use_cache=False)
    deeper = same({"n_iter": 6}, n_iter=6)
    with torch.no_grad():  # the depth reached the model
        assert not torch.allclose(model(idx, n_iter=6).logits, model(idx).logits)
    same({"n_iter": 6, "use_cache": False}, n_iter=6, use_cache=False)
    for tau in (1e-3, 1e-1):  # the adaptive exit, with the KV reuse of exited tokens
        got = model.generate(idx, max_new_tokens=24, do_sample=False, exit_threshold=tau, max_iter=6)
        want, iters = generate_adaptive(ours, idx, 24, 0, None, True, eot, tau, 6)
        assert got.tolist() == want.tolist()
        print(f"adaptive tau={tau}: mean iterations {iters.float().mean():.2f} of 6")
    assert model.generate(idx, max_new_tokens=24, do_sample=False, use_cache=False, exit_threshold=0.1,
                          max_iter=6).tolist() == generate_adaptive(ours, idx, 24, 0, None, False, eot, 0.1, 6)[0].tolist()
    by_config = remote(folder, n_iter=6)  # test-time depth through the config, at load and after it
    assert by_config.generate(idx, max_new_tokens=24, do_sample=False).tolist() == deeper.tolist()
    model.config.n_iter = 6
    with torch.no_grad():
        assert torch.equal(model(idx).logits, by_config(idx).logits)
    model.config.n_iter = 3

    torch.manual_seed(3)
    sampled = model.generate(idx, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50)
    torch.manual_seed(3)
    assert sampled.tolist() == generate(ours, idx, 24, temperature=0.8, top_k=50, stop_id=eot).tolist()


def test_pipeline_and_tokenizer_match_ours(exported):
    folder, ours, tok = exported
    hf_tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert hf_tok.is_fast and hf_tok.eos_token_id == eot_id(tok) == 0
    text = "def main(x):\n    return x + 1\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    pipe = pipeline("text-generation", model=remote(folder), tokenizer=hf_tok)
    out = pipe("def main(", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    idx = torch.tensor([tok.encode("def main(", add_special_tokens=False).ids])
    want = generate(ours, idx, 12, temperature=0, stop_id=0)[0].tolist()
    assert out == tok.decode(want)


def t5_like() -> Tokenizer:
    """A Unigram tokenizer of T5's form: <pad> </s> <unk> first, Metaspace, and a post-processor appending </s>."""
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    t.train_from_iterator(TEXT, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"],
                                                        unk_token="<unk>", show_progress=False))
    t.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return t


def smollm_like() -> Tokenizer:
    """A byte-level BPE of SmolLM's form: <|endoftext|> = 0, chat tokens after it, a ByteLevel post-processor."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return t


@pytest.mark.parametrize("make", [t5_like, smollm_like, lambda: train_bpe(TEXT, 300)], ids=["t5", "smollm", "bpe"])
def test_tokenizer_loads_as_a_fast_tokenizer_that_encodes_like_ours(make, tmp_path):
    tok = make()
    ours = random_checkpoint(tmp_path / "ckpt", tok)
    folder = hub.export(tmp_path / "ckpt", tmp_path / "export")
    hf_tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    eot = eot_id(tok)
    assert hf_tok.is_fast and hf_tok.eos_token_id == eot and hf_tok.pad_token_id == eot
    for text in ("def main(x):\n    return x + 1", "Looped transformers reuse", "héllo wörld ✓"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert hf_tok(text)["input_ids"] == ids  # no </s> appended, as our sampler and adapter encode
        assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids == ids  # nor by tokenizer.json alone
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)  # tokenizers skips them by default
    idx = torch.tensor([tok.encode("def main(", add_special_tokens=False).ids])
    got = remote(folder).generate(**hf_tok("def main(", return_tensors="pt"), max_new_tokens=8, do_sample=False)
    assert got.tolist() == generate(ours, idx, 8, temperature=0, stop_id=eot).tolist()


def test_remote_code_is_generated_from_our_source(exported):
    folder, _, _ = exported
    files = hf_files.remote_code()
    for name, src in files.items():
        assert (folder / name).read_text() == src  # what an export carries is what the source generates now
    modeling = files[hf_files.MODELING_FILE]
    for module, names in {"model": ("LoopedLM", "Attention", "joint_attention", "MoE"), "kernels": ("causal_flash_forward",),
                          "generate": ("KVCache", "adaptive_states"), "hf": ("AsymLoopForCausalLM", "LoopedCache")}.items():
        m = hf_files.Module(module)
        for n in names:
            assert all(m.source(i) in modeling for i in m.defs[n]), f"{module}.{n} is not verbatim in the bundle"
    nodes = [n for src in files.values() for n in ast.walk(ast.parse(src))]
    imported = {n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.startswith("minimal_asymloop") for m in imported) and "configuration_asymloop" in imported
    outside = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - {"", "configuration_asymloop"}
    assert outside == {"torch", "transformers", "packaging"}  # what a venv with torch + transformers has
    assert "ModelConfig" not in modeling.split("from .configuration_asymloop import", 1)[0]  # one ModelConfig: the config file's


def test_bundle_refuses_what_it_cannot_copy(monkeypatch, tmp_path):
    (tmp_path / "hf.py").write_text("from minimal_asymloop.a import f\nfrom minimal_asymloop.b import g\n\n\n"
                                    "class AsymLoopConfig:\n    x = f() + g()\n")
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "b.py").write_text("def f():\n    return 2\n\n\ndef g():\n    return f()\n")
    monkeypatch.setattr(hf_files, "SOURCE", tmp_path)
    with pytest.raises(hf_files.BundleError, match="b.py and minimal_asymloop/a.py both define 'f'"):
        hf_files.bundle(["AsymLoopConfig"])
    (tmp_path / "b.py").write_text("def g():\n    from minimal_asymloop.a import f\n    return f()\n")
    with pytest.raises(hf_files.BundleError, match="b.py:2 imports minimal_asymloop inside a function"):
        hf_files.bundle(["AsymLoopConfig"])


SCRIPT = textwrap.dedent("""
    import json, sys

    class NoMinimalAsymloop:  # this process is a user without our package
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "minimal_asymloop":
                raise ImportError("minimal_asymloop is blocked in this test")

    sys.meta_path.insert(0, NoMinimalAsymloop())
    try:
        import minimal_asymloop  # noqa: F401
        raise SystemExit("minimal_asymloop was importable")
    except ImportError:
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(repo)
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
    print(tok.decode(model.generate(**tok("Looped transformers", return_tensors="pt"), max_new_tokens=20)[0]))
    ids = tok("def main(", return_tensors="pt")["input_ids"]
    out = {"module": type(model).__module__, "tokens": {
        "cache": model.generate(ids, max_new_tokens=20, do_sample=False)[0].tolist(),
        "no_cache": model.generate(ids, max_new_tokens=20, do_sample=False, use_cache=False)[0].tolist(),
        "k6": model.generate(ids, max_new_tokens=20, do_sample=False, n_iter=6)[0].tolist(),
        "adaptive": model.generate(ids, max_new_tokens=20, do_sample=False, exit_threshold=0.01, max_iter=6)[0].tolist()}}
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:  # lm-eval's hf model needs lm-eval and accelerate
        out["lm_eval"] = str(e)
    else:
        lm = HFLM(pretrained=repo, trust_remote_code=True, device="cpu", batch_size=3, dtype="float32")
        pairs = json.loads(sys.argv[2])
        out["ll"] = lm.loglikelihood([Instance("loglikelihood", {}, tuple(p), 0) for p in pairs], disable_tqdm=True)
        out["rolling"] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (sys.argv[3],), 0)], disable_tqdm=True)
        deep = HFLM(pretrained=repo, trust_remote_code=True, device="cpu", batch_size=3, dtype="float32", n_iter=6)
        out["ll_k6"] = deep.loglikelihood([Instance("loglikelihood", {}, tuple(p), 0) for p in pairs], disable_tqdm=True)
    print("RESULT " + json.dumps(out))
""")
PAIRS = [("def main(", "x):"), ("import", " os"), ("print('hello", " world')"), ("class A:\n", "    pass"),
         ("Question: Which keyword defines a function?\nAnswer:", " def")]
ROLLING = "def main(x):\n    return x + 1\n" * 12  # longer than max_seq_len=64 tokens: several windows


def adapter_scores(folder, pairs, text, n_iter=None):
    """Our lm-eval adapter's log-likelihoods (harness.py) of the same requests, from the same folder."""
    from lm_eval.api.instance import Instance

    from minimal_asymloop.harness import AsymLoopLM

    a = AsymLoopLM(ckpt=str(folder), device="cpu", batch_size=3, n_iter=n_iter)
    ll = a.loglikelihood([Instance("loglikelihood", {}, tuple(p), 0) for p in pairs], disable_tqdm=True)
    return ll, a.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]


def test_export_loads_generates_and_scores_in_a_process_without_our_package(exported, tmp_path):
    folder, ours, tok = exported
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # the blocker, not the path, keeps our package out
    p = subprocess.run([sys.executable, str(script), str(folder), json.dumps(PAIRS), ROLLING], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["module"].startswith("transformers_modules.")  # the folder's code, not ours
    idx = torch.tensor([tok.encode("def main(", add_special_tokens=False).ids])
    want = {"cache": generate(ours, idx, 20, temperature=0, stop_id=0), "no_cache": generate(ours, idx, 20, 0, use_cache=False, stop_id=0),
            "k6": generate(ours, idx, 20, temperature=0, n_iter=6, stop_id=0),
            "adaptive": generate_adaptive(ours, idx, 20, 0, None, True, 0, 0.01, 6)[0]}
    for k, v in want.items():
        assert out["tokens"][k] == v[0].tolist(), k
    if "lm_eval" in out:
        pytest.skip(f"lm-eval's hf model is not importable here ({out['lm_eval']}): generation checked, scoring not")
    ll, rolling = adapter_scores(folder, PAIRS, ROLLING)
    ll_k6, _ = adapter_scores(folder, PAIRS, ROLLING, n_iter=6)  # test-time depth through lm-eval's --model_args
    assert ll_k6 != ll
    diffs = [abs(a[0] - b[0]) for a, b in zip(out["ll"] + out["ll_k6"], ll + ll_k6)] + [abs(out["rolling"][0] - rolling)]
    print(f"lm-eval hf vs our adapter: max |log-likelihood difference| {max(diffs):.3g} over {len(diffs)} requests")
    assert max(diffs) < 1e-4 and [a[1] for a in out["ll"]] == [b[1] for b in ll]


def test_checksums_safetensors_only_and_one_line_errors(exported, tiny_checkpoint, tmp_path):
    folder, _, _ = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-3] ^= 1  # one bit of the last tensor
    (bad / "model.safetensors").write_bytes(bytes(weights))
    for load in (remote, hf.AsymLoopForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="model.safetensors does not match the sha256 in config.json"):
            load(bad)
    with pytest.raises(ValueError, match="loads model.safetensors only .no pickles."):
        hf.AsymLoopForCausalLM.from_pretrained(folder, use_safetensors=False)
    with pytest.raises(ValueError, match="is a minimal-asymloop training checkpoint; export it first: python -m minimal_asymloop.hub"):
        hf.AsymLoopForCausalLM.from_pretrained(tiny_checkpoint)
    (bad / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer \(tokenizer_config.json missing\)"):
        remote(bad)
    from safetensors.torch import load_file, save_file

    (bad / "tokenizer_config.json").write_text("{}")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("head.weight")}, bad / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    sha = hf.file_sha256(bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({**config, "files_sha256": {"model.safetensors": sha}}))
    with pytest.raises(ValueError, match=r"model.safetensors does not match config.json \({'missing_keys': \['model.head.weight'\]}\)"):
        remote(bad)  # a missing weight is an error, not transformers' warning and a random head
    for text, msg in (({"model_type": "llama"}, "a 'llama' model, not asymloop"),
                      ({k: v for k, v in config.items() if k not in ("model_type", "auto_map")},
                       "an export from before transformers support; re-export it")):
        (bad / "config.json").write_text(json.dumps(text))
        (bad / "tokenizer_config.json").write_text("{}")
        with pytest.raises(ValueError, match=msg):
            hf.AsymLoopForCausalLM.from_pretrained(bad)
    model = remote(folder)
    with pytest.raises(ValueError, match="left padding .* is not supported"):
        model.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=2)


def test_a_transformers_version_outside_the_range_is_one_line(exported, monkeypatch):
    with pytest.raises(ImportError, match=r"needs transformers>=5.24,<6, this is 4.57.1; pip install 'transformers>=5.24,<6'"):
        hf.check_transformers_version("4.57.1")
    hf.check_transformers_version(transformers.__version__)
    folder, _, _ = exported
    # the bundled config checks too, when imported (sys.modules' transformers: the lazy module may have replaced itself)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")
    module = types.ModuleType("configuration_asymloop_check")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(ImportError, match="this is 6.0.0"):
        exec(compile((folder / hf_files.CONFIG_FILE).read_text(), hf_files.CONFIG_FILE, "exec"), module.__dict__)


@pytest.mark.slow  # lm-eval indexes its ~15k built-in tasks first: ~20-40 s on 2 cores
def test_lm_eval_hf_model_scores_a_local_task_as_our_adapter_does(exported, tmp_path):
    pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install -e ".[eval]"')
    pytest.importorskip("accelerate", reason='lm-eval\'s hf model imports accelerate: pip install -e ".[hf]"')
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from test_harness import direct_accuracy, write_mc_task

    folder, _, _ = exported
    tasks = write_mc_task(tmp_path / "tasks")
    out = simple_evaluate(model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32", tasks=["tiny_mc"],
                          task_manager=TaskManager(include_path=str(tasks)), device="cpu", batch_size=4)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(direct_accuracy(folder))


def test_save_pretrained_round_trip_keeps_the_checksums(exported, tmp_path):
    folder, _, _ = exported
    model = remote(folder)
    model.save_pretrained(tmp_path / "saved")
    AutoTokenizer.from_pretrained(folder, trust_remote_code=False).save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert list(config["files_sha256"]) == ["model.safetensors"]
    for name in (hf_files.CONFIG_FILE, hf_files.MODELING_FILE):  # the code travels on, unchanged
        assert (tmp_path / "saved" / name).read_text() == (folder / name).read_text()
    x = torch.arange(1, 20)[None]
    with torch.no_grad():
        assert torch.equal(remote(tmp_path / "saved")(x).logits, model(x).logits)
