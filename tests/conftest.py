"""Shared test setup: offline Hub, headless matplotlib, and one small prepared dataset + checkpoint per session."""

import os

# before any import of huggingface_hub/datasets/matplotlib: tests never touch the network or a display
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["MPLBACKEND"] = "Agg"

import pytest  # noqa: E402
import torch  # noqa: E402

# The test models are tiny: extra threads only add contention on a shared 2-core CI box (notebook kernels are not affected).
torch.set_num_threads(1)

# A small slice of the stdlib corpus and a model to match: preparing takes seconds, a step milliseconds.
DATA = dict(data="stdlib", bpe_vocab=512, max_data_tokens=150_000, val_fraction=0.2)
MODEL = dict(n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=512, max_seq_len=64)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """A data_cache dir holding the test slice of the stdlib corpus, prepared once per session."""
    from minimal_asymloop.data import prepare

    cache = tmp_path_factory.mktemp("data_cache")
    prepare(DATA["data"], "bpe", DATA["bpe_vocab"], str(cache), max_tokens=DATA["max_data_tokens"],
            val_fraction=DATA["val_fraction"], quiet=True)
    return cache


@pytest.fixture(scope="session")
def stdlib_data(data_cache):
    """The prepared test slice (train/val token arrays, tokenizer, unigram_entropy)."""
    from minimal_asymloop.data import prepare

    return prepare(DATA["data"], "bpe", DATA["bpe_vocab"], str(data_cache), max_tokens=DATA["max_data_tokens"],
                   val_fraction=DATA["val_fraction"], build=False)


@pytest.fixture
def tiny_configs(data_cache, tmp_path):
    """Factory: (ModelConfig, TrainConfig) for a seconds-long CPU fp32 run on the test slice, in a fresh out_dir."""
    from minimal_asymloop.model import ModelConfig
    from minimal_asymloop.trainer import TrainConfig

    def make(arch="asymloop", model=None, **train):
        mcfg = ModelConfig(arch=arch, **{**MODEL, **(model or {})})
        base = dict(DATA, data_cache=str(data_cache), out_dir=str(tmp_path / f"out-{arch}"), seq_len=32, global_batch=8,
                    max_steps=20, lr=3e-3, eval_interval=10, eval_batches=2, device="cpu", dtype="float32", quiet=True, seed=0)
        return mcfg, TrainConfig(**{**base, **train})

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(data_cache, tmp_path_factory):
    """out_dir of a finished 30-step asymloop run (checkpoint at `latest` and `best`), for sample/eval/reliability tests.
    Load it with `minimal_asymloop.checkpoint.load_model(tiny_checkpoint)`."""
    from minimal_asymloop.model import ModelConfig
    from minimal_asymloop.trainer import TrainConfig, train

    out = tmp_path_factory.mktemp("tiny_run")
    mcfg = ModelConfig(arch="asymloop", **MODEL)
    tcfg = TrainConfig(**DATA, data_cache=str(data_cache), out_dir=str(out), seq_len=32, global_batch=8, max_steps=30, lr=3e-3,
                       eval_interval=15, eval_batches=2, device="cpu", dtype="float32", quiet=True, seed=0)
    train(mcfg, tcfg)
    return out


def run_group(cmd, timeout: float = 300, **kwargs):
    """subprocess.run for torchrun: on a timeout its process group is killed and the test fails at once, without
    waiting for output pipes that a rank in a session of its own may still hold. Returns the CompletedProcess."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pytest_collection_modifyitems(config, items):
    """Tests marked fault_trials (minutes of random kill -9 trials) run only when -m names them: the default run and
    -m slow leave them out."""
    if "fault_trials" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long fault trials: run them with -m fault_trials")
    for item in items:
        if "fault_trials" in item.keywords:
            item.add_marker(skip)
