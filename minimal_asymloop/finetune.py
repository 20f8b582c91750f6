"""Supervised fine-tuning on GSM8K and its test accuracy (the paper's Appendix H, Table 13).

    python -m minimal_asymloop.finetune --ckpt out/1b-asymloop-k3 --out-dir out/gsm8k-asymloop     # train 3 epochs, then test
    python -m minimal_asymloop.finetune --ckpt out/1b-full_loop-k2 --out-dir out/gsm8k-full_loop   # the Full Loop row
    python -m minimal_asymloop.finetune --ckpt out/gsm8k-asymloop --eval-only --n-iter 5           # test at depth K=5
    python -m minimal_asymloop.finetune --ckpt out/tiny --data path/to/gsm8k                       # local train.jsonl, test.jsonl

The paper's setup is the default: 6,973 GSM8K train examples for training and 500 held out for development
(a seeded split of the 7,473), context 1024, loss on the worked solution and the final answer only, AdamW,
global batch 32, peak LR 1e-4, cosine with 10% warmup, 3 epochs, one seed; then all 1,319 test questions,
greedy decoding with the KV cache, no demonstrations, up to 512 new tokens. The paper compares "the normalized final
numerical answer"; we score as lm-eval's gsm8k task does and report both its filters, strict-match and flexible-extract
(gsm8k.py). Every setting is an option; the ones the paper leaves open are (ours).
The fine-tuned model is saved as a normal checkpoint (`sample`, `evaluate` and this command read it).
"""

import argparse
import json
import math
import re
import string
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from minimal_asymloop import checkpoint as ckpt
from minimal_asymloop.config import TrainConfig, check_optimizer_values, check_seed
from minimal_asymloop.gsm8k import FILTERS, final_answer, score
from minimal_asymloop.metrics import log_metrics
from minimal_asymloop.optim import lr_at, param_groups
from minimal_asymloop.runfolder import RunFolderError, hold, os_error_line
from minimal_asymloop.sources import DataError, eot_id
from minimal_asymloop.system import DTYPES, ConfigError, autocast_context, check_device_name, resolve_device

GSM8K, GSM8K_CONFIG = "openai/gsm8k", "main"
PROMPT = "Question: {question}\nAnswer:"  # (ours) the paper uses no demonstrations and states no template
CALC = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>


class FinetuneError(ValueError):
    """Bad fine-tuning data or settings; the message says what to do."""


@dataclass
class FinetuneConfig:
    data: str = "gsm8k"  # gsm8k (openai/gsm8k, config main, via `datasets`) | a folder with train.jsonl and test.jsonl
    n_dev: int = 500  # train examples held out for development (the paper: 7,473 = 6,973 + 500)
    seq_len: int = 1024  # context; longer examples are skipped and counted (ours)
    epochs: int = 3
    global_batch: int = 32
    micro_batch: int | None = None  # None -> global_batch; smaller = gradient accumulation, same result
    lr: float = 1e-4
    warmup_frac: float = 0.1
    min_lr_ratio: float = 0.0  # (ours) cosine decays to 0
    weight_decay: float = 0.0  # (ours) the paper states none for fine-tuning
    beta1: float = 0.9  # (ours) the pretraining betas
    beta2: float = 0.95
    grad_clip: float = 1.0  # (ours) as in pretraining
    keep_calc: bool = False  # (ours) False removes the <<a*b=c>> calculator annotations from the answers
    seed: int = 0  # the split and the example order
    max_new_tokens: int = 512
    eval_batch: int = 16  # (ours) test questions whose prompts have the same token count are decoded together
    eval_limit: int | None = None  # first N test questions only (quick checks)
    n_iter: int | None = None  # test-time depth for the evaluation; None -> the trained K
    device: str = "auto"
    dtype: str = "auto"  # auto -> bfloat16 on CUDA, float32 elsewhere
    out_dir: str = "out/gsm8k"

    def __post_init__(self):
        for name in ("seq_len", "epochs", "global_batch", "max_new_tokens", "eval_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise FinetuneError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("micro_batch", "eval_limit", "n_iter"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise FinetuneError(f"{name} must be a positive integer or unset, got {v!r}")
        if self.n_dev < 0:
            raise FinetuneError(f"n_dev must be >= 0, got {self.n_dev}")
        check_optimizer_values(self, FinetuneError)
        check_seed(self.seed, FinetuneError)
        try:
            check_device_name(self.device)
        except ConfigError as e:
            raise FinetuneError(str(e)) from None
        if self.dtype not in DTYPES:
            raise FinetuneError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.global_batch % (self.micro_batch or self.global_batch):
            raise FinetuneError(f"micro_batch={self.micro_batch} must divide global_batch={self.global_batch}")


# ----------------------------------------------------------------------------- data


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FinetuneError(f"{path} (byte {e.object[e.start]:#x} at offset {e.start}) is not UTF-8 text; convert it (e.g. "
                            f"iconv -f latin1 -t utf-8)") from None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise FinetuneError(f"{path}:{i} is not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(rows[-1], dict):
                raise FinetuneError(f"{path}:{i} is {json.dumps(rows[-1])[:40]}, not a JSON object; each line must be one "
                                    f'{{"question", "answer"}} object')
    return rows


def load_gsm8k(spec: str) -> dict[str, list[dict]]:
    """{"train": [...], "test": [...]}, each a list of {"question", "answer"} rows."""
    if spec == "gsm8k":
        from minimal_asymloop.sources import hub_offline_reason

        # an unreachable Hub switches offline mode on, so a cached copy still loads
        offline = hub_offline_reason("the data")
        import datasets

        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        try:
            ds = datasets.load_dataset(GSM8K, GSM8K_CONFIG)
        except Exception as e:  # offline and not cached, or any download failure
            why = offline or f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            raise FinetuneError(f"cannot load {GSM8K} ({GSM8K_CONFIG}): {why}. Run once with the Hub reachable (the data is "
                                f"then cached), or pass --data DIR with GSM8K's train.jsonl and test.jsonl") from None
        splits = {s: [dict(question=r["question"], answer=r["answer"]) for r in ds[s]] for s in ("train", "test")}
    else:
        folder = Path(spec).expanduser()
        missing = [f for f in ("train.jsonl", "test.jsonl") if not (folder / f).is_file()]
        if missing:
            raise FinetuneError(f"--data {spec}: no {' or '.join(missing)} there; pass a folder with GSM8K's train.jsonl and "
                                f"test.jsonl (one {{\"question\", \"answer\"}} object per line), or --data gsm8k")
        splits = {s: read_jsonl(folder / f"{s}.jsonl") for s in ("train", "test")}
    for split, rows in splits.items():
        bad = next((i for i, r in enumerate(rows) if not isinstance(r.get("question"), str) or "####" not in str(r.get("answer"))), None)
        if not rows or bad is not None:
            raise FinetuneError(f"{spec} {split}: " + (f"row {bad} needs a 'question' and an 'answer' ending in '#### <number>'"
                                                       if rows else "no examples"))
    return splits


def split_train_dev(rows: list, n_dev: int, seed: int) -> tuple[list, list]:
    """Seeded split of the train set: (train, dev) with n_dev dev examples (the paper: 6,973 / 500)."""
    if n_dev >= len(rows):
        raise FinetuneError(f"n_dev={n_dev} leaves no training examples out of {len(rows)}; lower --n-dev")
    perm = np.random.default_rng(seed).permutation(len(rows))
    return [rows[i] for i in perm[n_dev:]], [rows[i] for i in perm[:n_dev]]


def solution_text(answer: str, keep_calc: bool = False) -> str:
    """The target: the worked solution and `#### <answer>`."""
    return answer if keep_calc else CALC.sub("", answer)


def unencodable_chars(tokenizer, texts) -> list[str]:
    """Characters of `texts` the tokenizer maps to an unknown token or drops (whitespace aside)."""
    unk = {tokenizer.token_to_id(t) for t in (getattr(tokenizer.model, "unk_token", None), "<unk>", "[UNK]") if t} - {None}
    bad = []
    for c in sorted(set("".join(texts)) - set(string.whitespace)):
        ids = tokenizer.encode(c, add_special_tokens=False).ids
        if not ids or unk & set(ids) or not tokenizer.decode(ids).strip():
            bad.append(c)
    return bad


def check_tokenizer(tokenizer, rows: list[dict], keep_calc: bool):
    texts = [r["question"] + solution_text(r["answer"], keep_calc) for r in rows]
    bad = unencodable_chars(tokenizer, texts)
    if bad:
        hit = sum(any(c in t for c in bad) for t in texts)
        shown = " ".join(repr(c) for c in bad[:12]) + (" ..." if len(bad) > 12 else "")
        raise FinetuneError(f"the checkpoint's tokenizer cannot encode {len(bad)} character(s) of the data ({shown}; in {hit} of "
                            f"{len(texts)} examples): they would become unknown tokens or vanish. Fine-tune a checkpoint whose "
                            f"tokenizer covers them (byte-level BPE, T5 or SmolLM)")


def encode_example(tokenizer, question: str, answer: str, eot: int, keep_calc: bool = False) -> tuple[list[int], int]:
    """(prompt + solution + end-of-text token ids, prompt length). Prompt and solution are encoded apart, so the
    boundary between what is conditioned on and what is learned is exact."""
    prompt = tokenizer.encode(PROMPT.format(question=question), add_special_tokens=False).ids
    target = tokenizer.encode(" " + solution_text(answer, keep_calc), add_special_tokens=False).ids + [eot]
    return prompt + target, len(prompt)


def batch_tensors(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs x and targets y, each (B, T) with T = longest example - 1. y is the next token at
    solution positions and -1 (ignored) on the question and the padding: the loss covers the solution only."""
    t = max(len(ids) for ids, _ in examples) - 1
    x = torch.full((len(examples), t), pad_id, dtype=torch.long)
    y = torch.full((len(examples), t), -1, dtype=torch.long)
    for b, (ids, n_prompt) in enumerate(examples):
        x[b, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[b, n_prompt - 1:len(ids) - 1] = torch.tensor(ids[n_prompt:])  # position i predicts token i+1
    return x, y


def encode_split(tokenizer, rows, eot, cfg: FinetuneConfig, name: str, say) -> list[tuple[list[int], int]]:
    out = [encode_example(tokenizer, r["question"], r["answer"], eot, cfg.keep_calc) for r in rows]
    kept = [e for e in out if len(e[0]) - 1 <= cfg.seq_len]
    if len(kept) < len(out):
        say(f"{name}: skipped {len(out) - len(kept)} of {len(out)} examples longer than seq_len={cfg.seq_len} tokens")
    if not kept:
        raise FinetuneError(f"every {name} example is longer than seq_len={cfg.seq_len} tokens; raise --seq-len")
    return kept


# ----------------------------------------------------------------------------- training


def masked_loss_sum(model, x, y) -> tuple[torch.Tensor, int]:
    """Sum of cross-entropy over solution tokens, and their count."""
    logits, _ = model(x)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum"), int((y >= 0).sum())


@torch.no_grad()
def dev_loss(model, examples, pad_id, batch: int, device, dtype) -> float:
    """Mean cross-entropy (nats/token) over the solution tokens of the dev examples."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))  # similar lengths share a batch: less padding
    for s in range(0, len(order), batch):
        x, y = batch_tensors([examples[i] for i in order[s:s + batch]], pad_id)
        with autocast_context(device, dtype):
            loss, n = masked_loss_sum(model, x.to(device), y.to(device))
        total, count = total + loss.item(), count + n
    model.train(was)
    return total / max(count, 1)


def finetune(model, tokenizer, train_ex, dev_ex, cfg: FinetuneConfig, device, dtype, quiet: bool = False) -> list[dict]:
    """AdamW over the examples for cfg.epochs epochs (the trainer's param_groups and LR schedule); returns the log rows.
    The loss of a step is the mean over all solution tokens of its global batch, for any micro_batch."""
    say = (lambda *a: None) if quiet else tqdm.write
    pad_id = eot_id(tokenizer)
    steps = math.ceil(cfg.epochs * len(train_ex) / cfg.global_batch)
    sched = TrainConfig(max_steps=steps, lr=cfg.lr, warmup_frac=cfg.warmup_frac, min_lr_ratio=cfg.min_lr_ratio)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    # (ours) the epochs' seeded orders joined into one stream, cut into global batches of exactly global_batch
    order = np.concatenate([np.random.default_rng([cfg.seed, e]).permutation(len(train_ex)) for e in range(cfg.epochs)])
    micro, per_epoch = cfg.micro_batch or cfg.global_batch, math.ceil(len(train_ex) / cfg.global_batch)
    say(f"fine-tuning: {len(train_ex)} train / {len(dev_ex)} dev examples, {cfg.epochs} epochs = {steps} steps of "
        f"{cfg.global_batch} (micro {micro}), peak LR {cfg.lr:g}, cosine with {cfg.warmup_frac:.0%} warmup")
    rows, model = [], model.train()
    bar = tqdm(range(steps), desc="fine-tuning", unit="step", disable=quiet)
    for step in bar:
        t0, lr = time.time(), lr_at(step, sched)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        batch = [train_ex[i] for i in order[step * cfg.global_batch:(step + 1) * cfg.global_batch]]
        n_tok = sum(len(ids) - n for ids, n in batch)  # solution tokens in the whole global batch
        loss_val = 0.0
        for m in range(0, len(batch), micro):
            x, y = batch_tensors(batch[m:m + micro], pad_id)
            with autocast_context(device, dtype):
                loss, _ = masked_loss_sum(model, x.to(device), y.to(device))
                aux = sum(model.moe_aux_losses().values())  # MoE checkpoints: router losses, weighted per micro-batch
            (loss / n_tok + aux * len(x) / len(batch)).backward()
            loss_val += loss.item() / n_tok
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        if not math.isfinite(loss_val) or not math.isfinite(gn):
            raise FinetuneError(f"non-finite loss {loss_val} / gradient norm {gn} at step {step + 1}; try a lower --lr or --dtype float32")
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = dict(step=step + 1, loss=loss_val, lr=lr, grad_norm=gn, step_s=time.time() - t0)
        if (step + 1) % per_epoch == 0 or step + 1 == steps:
            row["dev_loss"] = dev_loss(model, dev_ex, pad_id, micro, device, dtype) if dev_ex else None
            say(f"step {step + 1}/{steps}: train loss {loss_val:.4f}, dev loss {row['dev_loss'] or float('nan'):.4f} nats/token")
        rows.append(row)
        bar.set_postfix(loss=f"{loss_val:.3f}", refresh=False)
    return rows


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_gsm8k(model, tokenizer, rows: list[dict], cfg: FinetuneConfig, device, dtype, out_jsonl: Path | None = None,
                   progress: bool = True) -> dict:
    """Greedy decoding with the KV cache, no demonstrations, scored by lm-eval's two GSM8K filters (gsm8k.py).
    Writes one JSON line per question."""
    eot, n_iter = eot_id(tokenizer), cfg.n_iter or model.config.n_iter
    prompts = [tokenizer.encode(PROMPT.format(question=r["question"]), add_special_tokens=False).ids for r in rows]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):  # equal-length prompts decode as one batch with no padding
        by_len.setdefault(len(p), []).append(i)
    batches = [ids[s:s + cfg.eval_batch] for ids in by_len.values() for s in range(0, len(ids), cfg.eval_batch)]
    texts = [""] * len(rows)
    model.eval()
    bar = tqdm(total=len(rows), desc=f"GSM8K test, K={n_iter}", unit="q", disable=not progress)
    for b in batches:
        idx = torch.tensor([prompts[i] for i in b], device=device)
        with autocast_context(device, dtype):
            out = model.generate(idx, cfg.max_new_tokens, temperature=0.0, n_iter=n_iter, stop_id=eot)
        for i, row in zip(b, out[:, idx.size(1):].tolist()):
            texts[i] = tokenizer.decode(row[:row.index(eot)] if eot in row else row)
        bar.update(len(b))
    bar.close()
    results = [dict(index=i, question=r["question"], reference=final_answer(r["answer"]), generated=text, **score(text, r["answer"]))
               for i, (r, text) in enumerate(zip(rows, texts))]
    if out_jsonl is not None:
        out_jsonl.write_text("".join(json.dumps(x) + "\n" for x in results))
    correct = {name: sum(x[name]["correct"] for x in results) for name in FILTERS}
    return dict(exact_match={name: c / len(results) for name, c in correct.items()}, correct=correct, n=len(results),
                n_iter=n_iter, max_new_tokens=cfg.max_new_tokens)


# ----------------------------------------------------------------------------- command line


def run(ckpt_path: str, cfg: FinetuneConfig, eval_only: bool = False, quiet: bool = False) -> dict:
    """Fine-tune (unless eval_only), save the model as a checkpoint in cfg.out_dir, then evaluate on the test split.
    Fine-tuning holds cfg.out_dir for the whole run (runfolder.hold): one run per folder, never a pretraining run's."""
    with hold(cfg.out_dir, "fine-tuning", enabled=not eval_only):
        return _run(ckpt_path, cfg, eval_only, quiet)


def _run(ckpt_path: str, cfg: FinetuneConfig, eval_only: bool, quiet: bool) -> dict:
    say = (lambda *a: None) if quiet else tqdm.write
    device, dtype = resolve_device(TrainConfig(max_steps=1, device=cfg.device, dtype=cfg.dtype), 0)
    if dtype == torch.float16:  # fine-tuning has no loss scaler (train_minimal.py has one): float32 on GPUs without bf16
        if cfg.dtype == "float16":
            raise FinetuneError("fine-tuning runs without fp16 loss scaling; use --dtype float32, or bfloat16 on a GPU with it")
        dtype = torch.float32
    splits = load_gsm8k(cfg.data)  # before the model: a missing dataset fails in seconds
    model, tokenizer, meta = ckpt.load_model(ckpt_path, device=device)
    if cfg.n_iter is not None and model.config.arch == "dense":
        raise FinetuneError(f"--n-iter {cfg.n_iter}: test-time depth applies to full_loop and asymloop; this checkpoint is dense")
    check_tokenizer(tokenizer, splits["train"] + splits["test"], cfg.keep_calc)
    if cfg.seq_len > model.config.max_seq_len and not eval_only:
        raise FinetuneError(f"seq_len={cfg.seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}; pass --seq-len "
                            f"{model.config.max_seq_len} or less")
    eot = eot_id(tokenizer)
    arch = f"{model.config.arch} K={model.config.n_iter}"
    say(f"{meta['path']}: {arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {device} "
        f"{str(dtype).removeprefix('torch.')}")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(base_checkpoint=meta["path"], arch=model.config.arch, trained_n_iter=model.config.n_iter, config=asdict(cfg))
    if not eval_only:
        train_rows, dev_rows = split_train_dev(splits["train"], cfg.n_dev, cfg.seed)
        train_ex = encode_split(tokenizer, train_rows, eot, cfg, "train", say)
        dev_ex = encode_split(tokenizer, dev_rows, eot, cfg, "dev", say) if dev_rows else []
        torch.manual_seed(cfg.seed)
        (out_dir / "metrics.jsonl").write_text("")
        rows = finetune(model, tokenizer, train_ex, dev_ex, cfg, device, dtype, quiet)
        for r in rows:
            log_metrics(out_dir, r)
        step = rows[-1]["step"]
        finetune_meta = dict(config=asdict(cfg), base_checkpoint=meta["path"], n_train=len(train_ex), n_dev=len(dev_ex),
                             dev_loss=rows[-1]["dev_loss"])
        kept = {k: meta[k] for k in ("model_config", "train_config", "params", "data") if k in meta}  # the pretraining's
        path = ckpt.save_checkpoint(out_dir, model, dict(step=step), dict(kept, step=step, finetune=finetune_meta), tokenizer)
        report.update(checkpoint=str(path), dev_loss=rows[-1]["dev_loss"], steps=step)
        say(f"saved the fine-tuned model to {path}")
    test = splits["test"][:cfg.eval_limit] if cfg.eval_limit else splits["test"]
    k = cfg.n_iter or model.config.n_iter
    res = evaluate_gsm8k(model, tokenizer, test, cfg, device, dtype, out_dir / f"gsm8k_test_k{k}.jsonl", progress=not quiet)
    report["test"] = res
    (out_dir / f"gsm8k_test_k{k}.json").write_text(json.dumps(report, indent=1))
    scores = ", ".join(f"{name} {100 * res['exact_match'][name]:.2f}% ({res['correct'][name]}/{res['n']})" for name in FILTERS)
    say(f"GSM8K test exact match ({arch.split()[0]} at K={k}, greedy, 0-shot): {scores}; "
        f"per-question outputs in {out_dir / f'gsm8k_test_k{k}.jsonl'}")
    return report


def _bool(s: str) -> bool:
    if s.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
    return s.lower() in ("1", "true", "yes", "on")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a pretrained (or fine-tuned) checkpoint folder, or a run's out_dir")
    p.add_argument("--eval-only", action="store_true", help="skip training: evaluate --ckpt on the test split")
    p.add_argument("--quiet", action="store_true")
    for name, value in asdict(FinetuneConfig()).items():  # every setting is an option; None defaults take integers
        kind = {bool: _bool, int: int, float: float, str: str}.get(type(value), int)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value, help=f"(default {value!r})")
    args = vars(p.parse_args(argv))
    ckpt_path, eval_only, quiet = args.pop("ckpt"), args.pop("eval_only"), args.pop("quiet")
    try:
        return run(ckpt_path, FinetuneConfig(**args), eval_only, quiet)
    except (FinetuneError, DataError, ckpt.CheckpointError, RunFolderError) as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # --out-dir unwritable, a full disk, a file in the path
        sys.exit(f"error: {os_error_line(e, 'cannot write')}")
    except KeyboardInterrupt:  # Ctrl-C: fine-tuning saves at its end only, so nothing of this run was saved
        print(f"error: interrupted by Ctrl-C; nothing of this fine-tuning run was saved to {args['out_dir']}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
