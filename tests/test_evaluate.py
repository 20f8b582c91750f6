"""Evaluation: the lm-eval adapter against direct model computations, and the evaluate command.

All offline. The adapter tests use a tiny random LoopedLM and a byte-level BPE trained here.
"""

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minimal_asymloop.harness import AsymLoopLM
from minimal_asymloop.model import LoopedLM, ModelConfig

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
