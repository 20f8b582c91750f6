"""GSM8K fine-tuning (the paper's Appendix H), offline on a few made-up problems in the GSM8K format."""

import json
import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from minimal_asymloop import finetune as ft
from minimal_asymloop.checkpoint import load_model, save_checkpoint
from minimal_asymloop.model import LoopedLM, ModelConfig

TRAIN = [("Tom has 3 apples and buys 2. How many now?", "3+2=<<3+2=5>>5\n#### 5"),
         ("Ann had 9 pens and lost 4. How many left?", "9-4=<<9-4=5>>5\n#### 5"),
         ("A box holds 6 eggs. How many in 2 boxes?", "6*2=<<6*2=12>>12\n#### 12"),
         ("Sam reads 4 pages a day. Pages in 3 days?", "4*3=<<4*3=12>>12\n#### 12"),
         ("Mia has $10 and spends $7. How much is left?", "10-7=<<10-7=3>>3\n#### 3"),
         ("8 birds sit and 1 flies off. How many stay?", "8-1=<<8-1=7>>7\n#### 7"),
         ("Leo has 2 cats and 2 dogs. How many pets?", "2+2=<<2+2=4>>4\n#### 4"),
         ("A pie has 8 slices; 5 are eaten. Left?", "8-5=<<8-5=3>>3\n#### 3")]
TEST = [("Kim has 4 hats and buys 1. How many now?", "4+1=<<4+1=5>>5\n#### 5"),
        ("A bag has 7 nuts; 2 are eaten. Left?", "7-2=<<7-2=5>>5\n#### 5"),
        ("Jo walks 1,000 m twice. Meters in all?", "1000*2=<<1000*2=2000>>2000\n#### 2,000")]


@pytest.fixture
def gsm8k_dir(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    for name, rows in (("train", TRAIN), ("test", TEST)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(dict(question=q, answer=a)) + "\n" for q, a in rows))
    return d


def cfg(data, out, **kw):
    base = dict(data=str(data), out_dir=str(out), n_dev=2, seq_len=64, epochs=1, global_batch=4, micro_batch=2, max_new_tokens=6,
                eval_batch=4, device="cpu", dtype="float32")
    return ft.FinetuneConfig(**{**base, **kw})


def test_loss_mask_on_a_hand_built_example():
    # example 1: prompt [5, 6], solution [7, 8, 9] (9 = end of text); example 2: prompt [1], solution [2, 3], padded with 0
    x, y = ft.batch_tensors([([5, 6, 7, 8, 9], 2), ([1, 2, 3], 1)], pad_id=0)
    assert x.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    # targets: the next token only where it is a solution token; question and padding positions are -1 (ignored)
    assert y.tolist() == [[-1, 7, 8, 9], [2, 3, -1, -1]]


def test_encode_example_learns_only_the_solution(stdlib_data):
    tok = stdlib_data.tokenizer
    ids, n = ft.encode_example(tok, "Tom has 3 apples and buys 2. How many now?", "3+2=<<3+2=5>>5\n#### 5", eot=0)
    assert tok.decode(ids[:n]) == "Question: Tom has 3 apples and buys 2. How many now?\nAnswer:"
    assert ids[-1] == 0 and tok.decode(ids[n:-1]) == " 3+2=5\n#### 5"  # calculator annotation removed (ours)
    x, y = ft.batch_tensors([(ids, n)], pad_id=0)
    assert (y[0, :n - 1] == -1).all() and y[0, n - 1:].tolist() == ids[n:]
    keep = ft.encode_example(tok, "Q?", "1+1=<<1+1=2>>2\n#### 2", eot=0, keep_calc=True)
    assert "<<1+1=2>>" in tok.decode(keep[0][keep[1]:-1])


def test_seeded_split_is_the_papers_6973_500():
    rows = list(range(7473))
    train, dev = ft.split_train_dev(rows, 500, seed=0)
    assert (len(train), len(dev)) == (6973, 500) and sorted(train + dev) == rows
    assert ft.split_train_dev(rows, 500, seed=0) == (train, dev) and ft.split_train_dev(rows, 500, seed=1)[1] != dev
    with pytest.raises(ft.FinetuneError, match="leaves no training examples"):
        ft.split_train_dev(rows[:5], 5, seed=0)


def test_fine_tune_and_evaluate_end_to_end(tiny_checkpoint, gsm8k_dir, tmp_path):
    out = tmp_path / "ft"
    report = ft.run(str(tiny_checkpoint), cfg(gsm8k_dir, out, epochs=2), quiet=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # 6 train examples x 2 epochs / batch 4
    assert all(r["loss"] > 0 for r in rows) and rows[-1]["dev_loss"] > 0 and rows[1]["dev_loss"] > 0  # dev loss each epoch
    # warmup: 10% of 3 steps rounds to 1 step; then cosine from 1e-4 down to 0 (ours) at the end
    assert [r["lr"] for r in rows] == pytest.approx([1e-4, 1e-4, 5e-5])
    # the fine-tuned model is a normal checkpoint, with different weights from the base model
    model, tok, meta = load_model(out)
    base, _, _ = load_model(tiny_checkpoint)
    assert meta["finetune"]["n_train"] == 6 and meta["step"] == 3
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    per_q = [json.loads(line) for line in (out / "gsm8k_test_k3.jsonl").read_text().splitlines()]
    assert [q["reference"] for q in per_q] == ["5", "5", "2,000"]
    for name in ("strict-match", "flexible-extract"):  # lm-eval's two GSM8K filters (scored in tests/test_gsm8k.py)
        assert report["test"]["exact_match"][name] == pytest.approx(sum(q[name]["correct"] for q in per_q) / 3)
    assert report["test"]["n"] == 3
    # evaluating the saved checkpoint again reproduces the generations; a deeper test-time K is its own run
    again = ft.run(str(out), cfg(gsm8k_dir, tmp_path / "again"), eval_only=True, quiet=True)
    assert again["test"]["exact_match"] == report["test"]["exact_match"]
    assert (tmp_path / "again/gsm8k_test_k3.jsonl").read_text() == (out / "gsm8k_test_k3.jsonl").read_text()
    deeper = ft.run(str(out), cfg(gsm8k_dir, tmp_path / "k5", n_iter=5), eval_only=True, quiet=True)
    assert deeper["test"]["n_iter"] == 5 and (tmp_path / "k5/gsm8k_test_k5.jsonl").exists()


def test_greedy_generation_matches_one_question_at_a_time(tiny_checkpoint, gsm8k_dir, tmp_path):
    """Questions batched by prompt length give exactly the batch-1 generations; stop_id only shortens them."""
    model, tok, _ = load_model(tiny_checkpoint)
    rows = [dict(question=q, answer=a) for q, a in TRAIN + TEST]
    outs = []
    for b in (1, 4):
        ft.evaluate_gsm8k(model, tok, rows, cfg(gsm8k_dir, tmp_path, eval_batch=b), "cpu", torch.float32, tmp_path / f"b{b}.jsonl",
                          progress=False)
        outs.append([json.loads(line)["generated"] for line in (tmp_path / f"b{b}.jsonl").read_text().splitlines()])
    assert outs[0] == outs[1]
    idx = torch.tensor([tok.encode("Question: Tom has", add_special_tokens=False).ids])
    full = model.generate(idx, 20, temperature=0.0)
    stop = full[0, idx.size(1) + 2].item()  # pretend the third generated token is the stop token
    short = model.generate(idx, 20, temperature=0.0, stop_id=stop)
    first = full[0, idx.size(1):].tolist().index(stop)
    assert short.tolist()[0] == full.tolist()[0][:idx.size(1) + first + 1]


def test_micro_batches_give_the_full_batch_update(tiny_checkpoint, stdlib_data):
    """The step's loss is the mean over all solution tokens of the global batch, however it is split."""
    tok = stdlib_data.tokenizer
    ex = [ft.encode_example(tok, q, a, 0) for q, a in TRAIN[:4]]
    params = []
    for micro in (1, 4):
        model, _, _ = load_model(tiny_checkpoint)
        c = ft.FinetuneConfig(epochs=1, global_batch=4, micro_batch=micro, seq_len=64, lr=1e-3, device="cpu")
        rows = ft.finetune(model, tok, ex, [], c, "cpu", torch.float32, quiet=True)
        params.append((rows[0]["loss"], torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert params[0][0] == pytest.approx(params[1][0], rel=1e-5)
    torch.testing.assert_close(params[0][1], params[1][1], atol=1e-6, rtol=1e-5)


def test_offline_hub_fails_fast_and_says_what_to_do():
    t0 = time.time()
    with pytest.raises(ft.FinetuneError, match=r"cannot load openai/gsm8k \(main\): .*offline mode is on.*--data DIR"):
        ft.load_gsm8k("gsm8k")  # conftest sets HF_HUB_OFFLINE=1; the dataset is not cached here
    assert time.time() - t0 < 30


def test_bad_data_folder(tmp_path):
    with pytest.raises(ft.FinetuneError, match="no train.jsonl or test.jsonl there"):
        ft.load_gsm8k(str(tmp_path))
    (tmp_path / "train.jsonl").write_text(json.dumps(dict(question="q", answer="no marker")) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps(dict(question="q", answer="#### 1")) + "\n")
    with pytest.raises(ft.FinetuneError, match=r"train: row 0 needs .* ending in '#### <number>'"):
        ft.load_gsm8k(str(tmp_path))


def test_tokenizer_that_cannot_encode_the_data_fails_in_one_line(gsm8k_dir, tmp_path):
    """A (non-byte-level) BPE trained on letters and digits only has no '$' or '?': say so before training."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 = + - * , . ; # < > :"] * 5,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "[UNK]"], show_progress=False))
    mcfg = ModelConfig(arch="asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=128, max_seq_len=64)
    save_checkpoint(tmp_path / "odd", LoopedLM(mcfg), {}, dict(model_config=mcfg.to_dict(), step=0), tok)
    with pytest.raises(SystemExit) as e:
        ft.main(["--ckpt", str(tmp_path / "odd"), "--data", str(gsm8k_dir), "--out-dir", str(tmp_path / "o"), "--device", "cpu"])
    msg = str(e.value)
    assert msg.startswith("error: the checkpoint's tokenizer cannot encode 2 character(s) of the data ('$' '?'; in 11 of 11")
    assert "\n" not in msg
