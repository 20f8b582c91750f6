import pytest
import torch

from minimal_asymloop.model import LoopedLM, ModelConfig
from minimal_asymloop.tasks import ChainTask, accuracy_by_hops, solve, train_on_task


def test_programs_are_solved_by_the_reference_and_hops_are_chain_depths():
    task = ChainTask(n_stmt=12, max_hops=4)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        text, values, hops = task.program(g)
        assert len(text) == task.seq_len and solve(text) == values
        env_depth = {}
        for stmt, h in zip(text.split(";")[:-1], hops):
            lhs, rhs = stmt.split("=")
            assert lhs not in env_depth  # every variable is assigned once
            env_depth[lhs] = 1 if rhs.isdigit() else env_depth[rhs] + 1  # defined before use
            assert env_depth[lhs] == h and 1 <= h <= task.max_hops


def test_batch_layout_and_determinism():
    task = ChainTask(n_stmt=6, max_hops=3, n_vars=8, n_values=5)
    idx, targets, hops = task.batch(16, torch.Generator().manual_seed(1))
    idx2, targets2, hops2 = task.batch(16, torch.Generator().manual_seed(1))
    assert torch.equal(idx, idx2) and torch.equal(targets, targets2) and torch.equal(hops, hops2)
    assert idx.shape == targets.shape == hops.shape == (16, task.seq_len)
    assert idx.max() < task.vocab_size
    labelled = targets >= 0
    assert labelled.sum() == 16 * task.n_stmt and labelled[:, 2::4].all()  # one label per right-hand side
    assert ((hops >= 0) == labelled).all()
    for b in range(16):
        assert [task.chars[t] for t in targets[b, 2::4]] == solve(task.decode(idx[b]))
    assert set(hops[labelled].tolist()) <= {1, 2, 3} and (hops == 3).any()  # all depths occur


@pytest.mark.parametrize("kw, msg", [(dict(max_hops=13), "max_hops"), (dict(n_vars=5), "n_vars"), (dict(n_values=11), "n_values")])
def test_bad_config_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ChainTask(**kw)


def test_a_tiny_model_learns_one_hop_statements():
    """One-hop statements (`a=7`) only need a copy of the right-hand side: learnable in a few steps."""
    task = ChainTask(n_stmt=4, max_hops=2, n_vars=6, n_values=4)
    torch.manual_seed(0)
    cfg = ModelConfig(arch="asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=task.vocab_size, max_seq_len=task.seq_len)
    model = LoopedLM(cfg)
    before = accuracy_by_hops(model, task, n=64)
    losses = train_on_task(model, task, steps=60, batch_size=16, lr=1e-2)
    after = accuracy_by_hops(model, task, n=64)
    assert losses[-1] < losses[0] - 0.3
    assert after[1] > 0.9 > before[1] + 0.3


def test_training_stops_early_when_the_check_says_so():
    task = ChainTask(n_stmt=4, max_hops=2, n_vars=6, n_values=4)
    model = LoopedLM(ModelConfig(arch="dense", n_layer=1, d_model=32, n_head=2, d_ff=64, vocab_size=task.vocab_size,
                                 max_seq_len=task.seq_len))
    calls = []
    losses = train_on_task(model, task, steps=50, batch_size=8, check_every=10, check=lambda step, m: calls.append(step) or step >= 20)
    assert calls == [10, 20] and len(losses) == 20 and model.training
