"""The lm-eval adapter against direct model computations, and the evaluate command's task path.

These need the optional `eval` extra; without it the whole module is skipped, saying so. All offline:
the adapter tests use a tiny random LoopedLM and a byte-level BPE trained here; the command tests use
conftest's `tiny_checkpoint`, a 30-step run on a slice of the stdlib corpus.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason='lm-eval is an optional extra: pip install -e ".[eval]"')
pytestmark = pytest.mark.extra  # CI runs these again after installing the extras: python -m pytest -m extra

from lm_eval.api.instance import Instance  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from minimal_asymloop import evaluate  # noqa: E402
from minimal_asymloop.checkpoint import load_model  # noqa: E402
from minimal_asymloop.data import Tokens  # noqa: E402
from minimal_asymloop.harness import AsymLoopLM  # noqa: E402
from minimal_asymloop.model import LoopedLM, ModelConfig  # noqa: E402

# this checkout importable; one thread, as conftest sets for this process (tiny models only lose from more)
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}


def run_eval(ckpt, tmp_path, *args):
    return evaluate.main(["--ckpt", str(ckpt), "--device", "cpu", "--out", str(tmp_path / "eval.json"), *args])


TEXT = ("The quick brown fox jumps over the lazy dog. A looped transformer reuses its decoder weights "
        "at every iteration, and the encoder runs once. Global keys come from the encoder output. ") * 20


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t.train_from_iterator([TEXT], trainer)
    return t


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="asymloop", n_layer=4, d_model=32, n_head=4, d_ff=64, vocab_size=tok.get_vocab_size(), max_seq_len=64)
    return LoopedLM(cfg).eval()


def lm(model, tok, **kw):
    return AsymLoopLM(model=model, tokenizer=tok, device="cpu", **kw)


def req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def direct(model, ids, n_cont, n_iter=None):
    """log p of the last n_cont tokens of ids, and whether each is the argmax: one plain forward pass."""
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(x, n_iter=n_iter)[0][0].float(), -1)  # (T, V)
    tgt = torch.tensor(ids[1:])[-n_cont:]
    rows = logp[-n_cont:]
    return rows.gather(-1, tgt[:, None]).sum().item(), bool((rows.argmax(-1) == tgt).all())


PAIRS = [("The quick brown fox", " jumps over"), ("A looped transformer reuses its", " decoder weights"),
         ("Global keys", " come from the encoder output."), ("the", " lazy dog"), ("", "The encoder runs once.")]


def test_loglikelihood_equals_direct_sum_of_logprobs(model, tok):
    a = lm(model, tok)
    got = a.loglikelihood([req("loglikelihood", c, x) for c, x in PAIRS])
    eot = tok.token_to_id("<|endoftext|>")
    for (c, x), (ll, greedy) in zip(PAIRS, got):
        ctx = tok.encode(c).ids if c else [eot]
        whole = tok.encode(c + x).ids
        cont = whole[len(ctx):] if c else tok.encode(x).ids
        ref_ll, ref_greedy = direct(model, ctx + cont, len(cont))
        assert len(cont) > 0 and ll < 0
        assert ll == pytest.approx(ref_ll, abs=1e-4)
        assert greedy == ref_greedy


def test_loglikelihood_uses_test_time_depth(model, tok):
    c, x = PAIRS[0]
    ids = tok.encode(c + x).ids
    n = len(ids) - len(tok.encode(c).ids)
    ll5 = lm(model, tok, n_iter=5).loglikelihood([req("loglikelihood", c, x)])[0][0]
    assert ll5 == pytest.approx(direct(model, ids, n, n_iter=5)[0], abs=1e-4)
    assert abs(ll5 - lm(model, tok).loglikelihood([req("loglikelihood", c, x)])[0][0]) > 1e-3


def test_batched_equals_unbatched(model, tok):
    reqs = [req("loglikelihood", c, x) for c, x in PAIRS * 2]
    one = lm(model, tok, batch_size=1).loglikelihood(reqs)
    many = lm(model, tok, batch_size=4).loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(one, many):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


def test_truncation_keeps_the_newest_tokens(model, tok):
    a = lm(model, tok, max_length=8)
    rng = torch.Generator().manual_seed(1)
    ctx = torch.randint(1, tok.get_vocab_size(), (30,), generator=rng).tolist()
    for n_cont in (1, 3, 8):  # 8 = max_length: the whole input is one context token + continuation
        cont = torch.randint(1, tok.get_vocab_size(), (n_cont,), generator=rng).tolist()
        ll, greedy = a.score([(ctx, cont)])[0]
        ref = direct(model, (ctx + cont)[-9:], n_cont)  # max_length inputs predict the last max_length tokens
        assert (ll, greedy) == (pytest.approx(ref[0], abs=1e-4), ref[1])
    short = a.score([(ctx[:2], cont[:2])])[0]  # nothing to cut
    assert short[0] == pytest.approx(direct(model, ctx[:2] + cont[:2], 2)[0], abs=1e-4)
    with pytest.raises(ValueError, match="exceeds max_length=8"):
        a.score([(ctx, list(range(1, 10)))])
    with pytest.raises(ValueError, match="empty context"):
        a.score([([], cont)])
    with pytest.raises(ValueError, match="max_length=100 must be in 1..64"):
        lm(model, tok, max_length=100)


def test_rolling_windows_predict_every_token_once(model, tok):
    """max_length 16 over a longer text: windows, summed, equal one pass per disjoint chunk of [eot] + ids."""
    a = lm(model, tok, max_length=16, batch_size=3)
    text = TEXT[:300]
    ids = [tok.token_to_id("<|endoftext|>")] + tok.encode(text).ids
    total = a.loglikelihood_rolling([req("loglikelihood_rolling", text)])[0]
    ref, pos = 0.0, 1  # predict ids[pos:pos+16] from up to 16 tokens before each
    while pos < len(ids):
        n = min(16, len(ids) - pos)
        lo = max(0, pos + n - 17)
        ref += direct(model, ids[lo:pos + n], n)[0]
        pos += n
    assert len(ids) > 40 and total == pytest.approx(ref, abs=1e-3)


def test_generate_until_is_greedy_and_stops(model, tok):
    a = lm(model, tok, batch_size=2)
    ctx = "The quick brown"
    ids = tok.encode(ctx).ids
    for _ in range(6):  # greedy by hand
        with torch.no_grad():
            ids.append(model(torch.tensor([ids]))[0][0, -1].argmax().item())
    expect = tok.decode(ids[len(tok.encode(ctx).ids):])
    reqs = [req("generate_until", ctx, {"until": [], "max_gen_toks": 6}),
            req("generate_until", "Global keys come", {"until": [], "max_gen_toks": 3}),
            req("generate_until", ctx, {"until": [expect[2:4]], "max_gen_toks": 6})]
    got = a.generate_until(reqs)
    assert got[0] == expect
    assert got[1] == lm(model, tok, batch_size=1).generate_until(reqs[1:2])[0]
    assert got[2] == expect.split(expect[2:4])[0]
    with pytest.raises(ValueError, match="greedily only"):
        a.generate_until([req("generate_until", ctx, {"do_sample": True, "temperature": 1.0})])


def test_rolling_loglikelihood_equals_perplexity_paths_total(tiny_checkpoint, tmp_path):
    model, tok, _ = load_model(tiny_checkpoint)
    L, n = 16, 6  # rolling windows of max_length L; the text is exactly n*L tokens
    src = Path(json.__file__).read_text()
    text = next(src[:c] for c in range(50, 2000) if len(tok.encode(src[:c]).ids) == n * L)
    ids = [tok.token_to_id("<|endoftext|>")] + tok.encode(text).ids  # the perplexity path's stream: eot, then the text
    np.asarray(ids, dtype=np.uint16).tofile(tmp_path / "val.bin")
    val = Tokens([tmp_path / "val.bin"], np.uint16)
    ppl = evaluate.held_out_loss(model, val, L, 2, None, "cpu", torch.float32)  # n windows tile the stream
    rolling = lm(model, tok, max_length=L, batch_size=4).loglikelihood_rolling([req("loglikelihood_rolling", text)])[0]
    assert ppl["tokens"] == n * L
    assert rolling == pytest.approx(-ppl["ce"] * n * L, rel=1e-5)


MC_DOCS = [("Which keyword defines a function?", ["def", "class", "import"], 0),
           ("Which keyword starts a loop over items?", ["return", "for", "pass"], 1),
           ("Which value means nothing?", ["True", "self", "None"], 2),
           ("Which keyword leaves a function with a value?", ["return", "with", "else"], 0),
           ("Which keyword brings in a module?", ["yield", "import", "raise"], 1),
           ("Which keyword defines a class?", ["lambda", "while", "class"], 2)]


def write_mc_task(folder: Path) -> Path:
    """A local multiple-choice lm-eval task (YAML + JSONL), the layout of the paper's tasks."""
    folder.mkdir()
    with open(folder / "docs.jsonl", "w") as f:
        for q, choices, label in MC_DOCS:
            f.write(json.dumps(dict(question=q, choices=choices, label=label)) + "\n")
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'docs.jsonl'}
  cache_dir: {folder / 'hf_cache'}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return folder


def direct_accuracy(ckpt) -> float:
    """The task's accuracy from the adapter's own log-likelihoods: argmax over ' ' + choice."""
    a = AsymLoopLM(ckpt=str(ckpt), device="cpu")
    hits = []
    for q, choices, label in MC_DOCS:
        lls = [ll for ll, _ in a.loglikelihood([req("loglikelihood", f"Question: {q}\nAnswer:", " " + c) for c in choices])]
        hits.append(int(np.argmax(lls)) == label)
    return sum(hits) / len(hits)


def test_lm_eval_end_to_end_on_a_local_task(tiny_checkpoint, tmp_path, capsys):
    tasks = write_mc_task(tmp_path / "tasks")
    report = run_eval(tiny_checkpoint, tmp_path, "--tasks", "tiny_mc", "--include-path", str(tasks), "--batch-size", "4")
    acc = report["tasks"]["results"]["tiny_mc"]["acc"]
    assert 0 <= acc <= 1
    assert acc == pytest.approx(direct_accuracy(tiny_checkpoint))
    assert report["tasks"]["mean"] == pytest.approx(100 * acc)
    out = capsys.readouterr().out
    assert "| Model | tiny_mc | Avg. |" in out and f"| asymloop K=3 | {100 * acc:.2f} | {100 * acc:.2f} |" in out


@pytest.mark.slow  # a fresh interpreter plus lm-eval indexing all its ~15k built-in tasks: ~20-40 s on 2 cores
def test_harness_cli_is_lm_eval_with_the_model_registered(tiny_checkpoint, tmp_path):
    tasks = write_mc_task(tmp_path / "tasks")
    cmd = [sys.executable, "-m", "minimal_asymloop.harness", "--model", "minimal_asymloop", "--model_args",
           f"ckpt={tiny_checkpoint}", "--batch_size", "4", "--device", "cpu", "--tasks", "tiny_mc", "--include_path", str(tasks)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    acc = float(re.search(r"\|\s*acc\s*\|[^|]*\|\s*([0-9.]+)\s*\|", p.stdout).group(1))
    assert acc == pytest.approx(direct_accuracy(tiny_checkpoint), abs=1e-4)


def test_model_is_registered_and_built_from_model_args(tiny_checkpoint, tok):
    from lm_eval.api.registry import get_model

    assert get_model("minimal_asymloop") is AsymLoopLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models stay resolvable
    a = AsymLoopLM.create_from_arg_string(f"ckpt={tiny_checkpoint},n_iter=2,batch_size=3,max_length=40", {"device": "cpu"})
    assert (a.n_iter, a.batch_size, a.max_length, a.eot_token_id) == (2, 3, 40, 0)
    with pytest.raises(ValueError, match="batch_size='auto' is not supported"):
        AsymLoopLM.create_from_arg_string(f"ckpt={tiny_checkpoint}", {"batch_size": "auto", "device": "cpu"})
    dense = LoopedLM(ModelConfig(arch="dense", n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=tok.get_vocab_size()))
    with pytest.raises(ValueError, match="only full_loop/asymloop loop"):
        lm(dense, tok, n_iter=2)


def test_offline_hub_fails_fast_with_a_clear_message(tiny_checkpoint, tmp_path):
    with pytest.raises(SystemExit) as e:  # conftest sets HF_HUB_OFFLINE=1; piqa's data is not cached here
        run_eval(tiny_checkpoint, tmp_path, "--tasks", "piqa")
    msg = str(e.value)
    assert re.search(r"Couldn't reach '[\w/]*piqa'", msg), msg  # the dataset's Hub name depends on the lm-eval version
    assert "offline mode is on" in msg and "run once with the Hub reachable" in msg
