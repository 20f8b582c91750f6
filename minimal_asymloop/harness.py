"""lm-evaluation-harness adapter: a LoopedLM checkpoint as the lm-eval model `minimal_asymloop`.

    python -m minimal_asymloop.harness --model minimal_asymloop --model_args ckpt=out/tiny --tasks piqa

That is lm-eval's own CLI (every flag of `lm_eval`), run after this module has registered the
model. The plain `lm_eval` script cannot find it: lm-eval 0.4.x resolves `--model` only against
its built-in table and never imports outside code (upstream issues #1457, #1621). In Python,
`import minimal_asymloop.harness` before `lm_eval.simple_evaluate(model="minimal_asymloop", ...)`.

lm-eval is an optional extra (`pip install -e ".[eval]"`); only this module imports it.
"""

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import MODEL_REGISTRY, register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from minimal_asymloop.sources import eot_id

MODEL_NAME = "minimal_asymloop"


class AsymLoopLM(TemplateLM):
    """lm-eval's three request types over a LoopedLM and its `tokenizers.Tokenizer`.

    Build it from a checkpoint (`ckpt=DIR`, what `--model_args` passes) or from objects
    (`model=..., tokenizer=...`, for tests and notebooks). Greedy decoding only.
    """

    def __init__(self, ckpt=None, model=None, tokenizer=None, n_iter=None, batch_size=16, max_length=None,
                 max_gen_toks=256, device=None, dtype="float32", eot_token=None, max_batch_size=None):
        super().__init__()
        if (ckpt is None) == (model is None):
            raise ValueError("pass exactly one of ckpt=DIR (a trained run or checkpoint) or model=...+tokenizer=...")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if ckpt is not None:
            from minimal_asymloop.checkpoint import load_model
            model, tokenizer, _ = load_model(str(ckpt), device=device)
        if tokenizer is None:
            raise ValueError("model=... needs tokenizer=... (a tokenizers.Tokenizer)")
        if str(batch_size).startswith("auto") or int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r} is not supported; pass a positive integer, e.g. --batch_size 16")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self.n_iter = None if n_iter is None else int(n_iter)  # None -> the trained K
        if self.n_iter is not None and (self.n_iter < 1 or model.config.arch == "dense"):
            raise ValueError(f"n_iter={n_iter}: K must be >= 1, and only full_loop/asymloop loop (this is {model.config.arch})")
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.config.max_seq_len)
        if not 1 <= self.max_length <= model.config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} must be in 1..{model.config.max_seq_len} (the model's max_seq_len)")
        self.max_gen_toks = int(max_gen_toks)
        self.dtype = dtype
        # the document separator of the training data: lm-eval's prefix for an empty context, and a stop token
        self._eot = eot_id(tokenizer) if eot_token is None else tokenizer.token_to_id(eot_token)
        if self._eot is None:
            raise ValueError(f"eot_token={eot_token!r} is not in the tokenizer's vocabulary")

    @property
    def eot_token_id(self) -> int:
        return self._eot

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        # (ours) never add the tokenizer's post-processor tokens (T5 appends </s>): the
        # training data is plain text joined by end-of-text, so an encoded request is too
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # --------------------------------------------------------------------- scoring

    @torch.no_grad()
    def _last_state(self, rows: list[list[int]]) -> torch.Tensor:
        """Final decoder state (B, T, d) for right-padded rows; causal attention makes the
        padding invisible to every real position, so rows of any lengths share one batch."""
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            x[b, :len(r)] = torch.tensor(r)
        with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            return self.model.states(x.to(self._device), self.n_iter)[-1]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) for token pairs, batched.

        The context is cut from the left so that context + continuation fits max_length
        input tokens; the continuation itself must fit.
        """
        out: list = [None] * len(pairs)
        # longest first (as lm-eval's HF model does): each batch's padding is bounded by its first row
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="scoring"):
            batch, rows = [], []
            for i in order[start:start + self.batch_size]:
                ctx, cont = pairs[i]
                if not ctx:
                    raise ValueError("empty context: the first continuation token has nothing to be predicted from")
                if len(cont) > self.max_length:
                    raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
                if not cont:
                    out[i] = (0.0, True)
                    continue
                rows.append((ctx + cont)[-(self.max_length + 1):-1])  # inputs; the last token is only a target
                batch.append(i)
            if not rows:
                continue
            z = self._last_state(rows)  # (B, T, d)
            # the head only on continuation positions: (sum of continuation lengths, V), not (B, T, V)
            z_cont = torch.cat([z[b, len(r) - len(pairs[i][1]):len(r)] for b, (i, r) in enumerate(zip(batch, rows))])
            logp = F.log_softmax(self.model.logits(z_cont).float(), dim=-1)
            targets = torch.tensor([t for i in batch for t in pairs[i][1]], device=logp.device)
            tok_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
            hit = logp.argmax(-1) == targets
            for i, lp, h in zip(batch, tok_logp.split([len(pairs[i][1]) for i in batch]),
                                hit.split([len(pairs[i][1]) for i in batch])):
                out[i] = (lp.sum().item(), bool(h.all()))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """TemplateLM.loglikelihood has already tokenized: requests are ((context, continuation), ctx_ids, cont_ids)."""
        res = self.score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
        for (key, _, _), r in zip(requests, res):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each text after an end-of-text prefix, in windows of
        max_length tokens: each token is predicted once, with as much context as fits."""
        windows, owner = [], []
        for j, (text,) in enumerate(req.args for req in requests):
            for w in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(j)
        totals = [0.0] * len(requests)
        for j, (ll, _) in zip(owner, self.score(windows, disable_tqdm)):  # windows of all texts share batches
            totals[j] += ll
        for req, t in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
        return totals

    # --------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until a stop string, end-of-text or max_gen_toks.

        Batched without a KV cache: each step reruns the (left-truncated) sequences, right-padded,
        and reads each one's next-token logits at its own last position.
        """
        out = []
        for start in tqdm(range(0, len(requests), self.batch_size), disable=disable_tqdm, desc="generating"):
            batch = requests[start:start + self.batch_size]
            seqs, gen, stops, budget = [], [], [], []
            for req in batch:
                ctx, kw = req.args
                kw = dict(kw or {})
                if kw.get("do_sample") or kw.get("temperature", 0.0) > 0:
                    raise ValueError(f"minimal_asymloop generates greedily only; got gen_kwargs {kw}")
                until = kw.get("until") or []
                stops.append([until] if isinstance(until, str) else list(until))
                budget.append(int(kw.get("max_gen_toks", self.max_gen_toks)))
                seqs.append(self.tok_encode(ctx) or [self.prefix_token_id])
                gen.append([])
            live = [b for b in range(len(batch)) if budget[b] > 0]
            while live:
                rows = [(seqs[b] + gen[b])[-self.max_length:] for b in live]
                z = self._last_state(rows)
                z_last = z[torch.arange(len(rows), device=z.device), torch.tensor([len(r) - 1 for r in rows], device=z.device)]  # (B, d)
                nxt = self.model.logits(z_last).argmax(-1).tolist()
                for b, t in zip(list(live), nxt):
                    gen[b].append(t)
                    if t == self.eot_token_id or len(gen[b]) >= budget[b] or any(s in self.tok_decode(gen[b]) for s in stops[b]):
                        live.remove(b)
            for req, g, st in zip(batch, gen, stops):
                text = self.tok_decode([t for t in g if t != self.eot_token_id])
                for s in st:  # cut at the first stop string, as lm-eval expects
                    text = text.split(s)[0] if s else text
                self.cache_hook.add_partial("generate_until", req.args, text)
                out.append(text)
        return out


def register() -> None:
    """Register AsymLoopLM as `minimal_asymloop` (once, even if this module runs as __main__ too)."""
    import lm_eval.models  # noqa: F401  lm-eval's own models fill the registry first, else they go missing

    if MODEL_NAME not in MODEL_REGISTRY:
        register_model(MODEL_NAME)(AsymLoopLM)


register()

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
