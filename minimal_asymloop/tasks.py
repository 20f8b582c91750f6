"""A synthetic multi-step reasoning task where depth matters (ours): variable-binding chains.

A program is a list of assignments. Chains such as `a=7; b=a; c=b;` are interleaved at random, each
variable defined before it is used, every variable assigned once:

    f=3;a=7;g=f;b=a;c=b;h=g;...

At the right-hand side of every statement the model must output the value of its left-hand side:
7 for `a=7` (1 hop), 7 for `b=a` (2 hops: b -> a -> 7), 7 for `c=b` (3 hops). A hop is one attention
lookup into the defining statement, which has to be resolved first, so a statement at depth h needs
about h blocks in sequence: the kind of computation a looped decoder can run K times with one block.

    task = ChainTask(n_stmt=12, max_hops=4)
    idx, targets, hops = task.batch(64, generator)   # targets/hops: -1 except at right-hand sides
    task.decode(idx[0])
"""

from dataclasses import dataclass

import torch

from minimal_asymloop.config import TrainConfig
from minimal_asymloop.optim import lr_at, param_groups

VALUES = "0123456789"
VARIABLES = "abcdefghijklmnopqrstuvwxyz"
SYMBOLS = "=;"


@dataclass
class ChainTask:
    n_stmt: int = 12  # assignments per program (fixed, so every sequence has the same length)
    max_hops: int = 4  # the longest chain
    n_vars: int = 26  # variable names a, b, c, ... (each assigned once per program)
    n_values: int = 10  # values 0..n_values-1

    def __post_init__(self):
        if not 1 <= self.max_hops <= self.n_stmt:
            raise ValueError(f"max_hops={self.max_hops} must be in 1..n_stmt={self.n_stmt}")
        if not self.n_stmt <= self.n_vars <= len(VARIABLES):
            raise ValueError(f"n_vars={self.n_vars} must be in n_stmt..{len(VARIABLES)} (each statement defines a new variable)")
        if not 2 <= self.n_values <= len(VALUES):
            raise ValueError(f"n_values={self.n_values} must be in 2..{len(VALUES)}")
        self.chars = VALUES[: self.n_values] + VARIABLES[: self.n_vars] + SYMBOLS
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def seq_len(self) -> int:
        return 4 * self.n_stmt  # "x=y;" per statement

    def program(self, g: torch.Generator) -> tuple[str, list[str], list[int]]:
        """(text, value per statement, hops per statement) for one random program."""
        rand = lambda n: torch.randint(0, n, (1,), generator=g).item()
        lengths = []  # chain lengths 1..max_hops (the last one cut to fit)
        while sum(lengths) < self.n_stmt:
            lengths.append(min(1 + rand(self.max_hops), self.n_stmt - sum(lengths)))
        owner = torch.tensor([c for c, n in enumerate(lengths) for _ in range(n)])
        owner = owner[torch.randperm(len(owner), generator=g)].tolist()  # interleave; order within a chain kept
        names = [VARIABLES[i] for i in torch.randperm(self.n_vars, generator=g)[: self.n_stmt].tolist()]
        tail, value, depth = {}, {}, {}  # per chain: its last variable, its value, its current depth
        text, values, hops = [], [], []
        for c, lhs in zip(owner, names):
            if c not in tail:  # a new chain starts with a literal
                value[c], depth[c] = VALUES[rand(self.n_values)], 1
                text.append(f"{lhs}={value[c]};")
            else:
                depth[c] += 1
                text.append(f"{lhs}={tail[c]};")
            tail[c] = lhs
            values.append(value[c])
            hops.append(depth[c])
        return "".join(text), values, hops

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in (ids.tolist() if torch.is_tensor(ids) else ids))

    def batch(self, batch_size: int, g: torch.Generator):
        """(idx, targets, hops), each (B, seq_len). At each right-hand side (position 4s+2) the target is the
        statement's value and hops its depth; everywhere else both are -1."""
        idx = torch.empty(batch_size, self.seq_len, dtype=torch.long)
        targets = torch.full((batch_size, self.seq_len), -1, dtype=torch.long)
        hops = torch.full((batch_size, self.seq_len), -1, dtype=torch.long)
        for b in range(batch_size):
            text, values, hs = self.program(g)
            idx[b] = torch.tensor(self.encode(text))
            targets[b, 2::4] = torch.tensor([self.stoi[v] for v in values])
            hops[b, 2::4] = torch.tensor(hs)
        return idx, targets, hops


def solve(text: str) -> list[str]:
    """Reference solver: the value of every statement's left-hand side, in order."""
    env, out = {}, []
    for stmt in filter(None, text.split(";")):
        lhs, rhs = stmt.split("=")
        env[lhs] = rhs if rhs in VALUES else env[rhs]
        out.append(env[lhs])
    return out


@torch.no_grad()
def accuracy_by_hops(model, task: ChainTask, n: int = 256, n_iter: int | None = None, seed: int = 1234) -> dict[int, float]:
    """{hops: accuracy} of the model's argmax at right-hand sides, on n fresh programs (fixed seed)."""
    idx, targets, hops = task.batch(n, torch.Generator().manual_seed(seed))
    was_training = model.training
    model.eval()
    logits, _ = model(idx.to(next(model.parameters()).device), n_iter=n_iter)  # the batch on the model's device
    model.train(was_training)
    correct = logits.argmax(-1).cpu() == targets
    return {h: correct[hops == h].float().mean().item() for h in range(1, task.max_hops + 1) if (hops == h).any()}


def train_on_task(model, task: ChainTask, steps: int = 600, batch_size: int = 32, lr: float = 3e-3,
                  seed: int = 0, log_every: int = 0, check_every: int = 0, check=None, depth=None,
                  backprop_depth: int | None = None) -> list[float]:
    """(ours) Train on fresh task batches with the LM trainer's optimizer groups and LR schedule; returns the loss per step.

    The task is not a text corpus, so batches come from `task.batch`, not the trainer's data pipeline.
    check(step, model) -> bool, called after every `check_every` steps: True stops training there (early stopping
    once a model has converged); the returned list then has one loss per step actually run.
    depth: a depth.DepthSampler drawing K per step (None: the model's n_iter); backprop_depth: truncated backprop.
    """
    cfg = TrainConfig(max_steps=steps, lr=lr, seq_len=task.seq_len, global_batch=batch_size)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=lr, betas=(cfg.beta1, cfg.beta2))
    losses = []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group["lr_mult"]
        idx, targets, _ = task.batch(batch_size, g)
        k = depth.draw() if depth is not None else None
        # CE at right-hand sides only (targets -1 elsewhere); the head runs once
        _, loss = model(idx, targets, return_logits=False, n_iter=k, backprop_depth=backprop_depth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"step {step:5d} loss {loss.item():.3f}")
        if check_every and (step + 1) % check_every == 0 and check(step + 1, model):
            break
    return losses
