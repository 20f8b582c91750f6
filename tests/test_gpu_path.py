"""What a GPU run needs from the trainer, checked on CPU: no host syncs between logs, batches copied from pinned
memory once per step, DDP and NCCL set up for speed, and the compile preflight."""

import types
import warnings

import numpy as np
import pytest
import torch

from minimal_asymloop import batches as B
from minimal_asymloop import system
from minimal_asymloop import trainer as T
from minimal_asymloop.model import LoopedLM, ModelConfig

# ----------------------------------------------------------------------------- the step loop


class _Syncs:
    """Counts the calls that make the host wait for the device: reading a tensor's value, or synchronizing."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch.cuda, "synchronize", self._counting("cuda.synchronize", lambda *a, **k: None))

    def _counting(self, name, fn):
        def wrapped(*a, **k):
            self.calls.append(name)
            return fn(*a, **k)
        return wrapped


def test_steps_between_logs_make_no_host_sync(tiny_configs, monkeypatch):
    """Steps that neither log nor checkpoint read nothing back from the device (on CUDA nothing would wait for the GPU);
    the logging step reads all the queued steps' stats in one call, and every step still gets its row."""
    mcfg, tcfg = tiny_configs(max_steps=12, eval_interval=100, log_interval=5, alrs=False)
    run = T.set_up(mcfg, tcfg, None)
    flag = {}
    assert not T.optimizer_step(run, 0, flag)  # the first step logs at once (its time includes any compile)
    syncs = _Syncs(monkeypatch)
    for step in range(1, 4):  # steps 2..4: no log, no checkpoint
        T.optimizer_step(run, step, flag)
    assert syncs.calls == [], syncs.calls
    assert len(run.pending) == 3
    T.optimizer_step(run, 4, flag)  # step 5 logs steps 2..5
    assert syncs.calls == ["tolist"] and run.pending == []
    monkeypatch.undo()
    rows = T.read_metrics(tcfg.out_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(np.isfinite(r["loss"]) for r in rows)
    run.bar.close()


def test_a_non_finite_step_is_skipped_on_the_device(tiny_configs, monkeypatch):
    """The fused AdamW's found_inf drops a NaN step's whole update (weights, moments, step count) without the host
    looking at the loss; the step is then stopped on or counted at the next log (tests/test_reliability.py)."""
    monkeypatch.setenv(T.NAN_ENV, "2")
    mcfg, tcfg = tiny_configs(max_steps=12, eval_interval=100, log_interval=5, alrs=False, skip_nonfinite=True)
    run = T.set_up(mcfg, tcfg, None)
    T.optimizer_step(run, 0, {})
    before = {n: p.detach().clone() for n, p in run.raw.named_parameters()}
    T.optimizer_step(run, 1, {})  # NaN loss and gradients
    assert all(torch.equal(p, before[n]) for n, p in run.raw.named_parameters())
    assert int(next(iter(run.optimizer.state.values()))["step"]) == 1
    T.optimizer_step(run, 2, {})
    assert not all(torch.equal(p, before[n]) for n, p in run.raw.named_parameters())
    run.bar.close()


# ----------------------------------------------------------------------------- batches


def _loop_window_ids(sampler, step):
    """The per-sequence reference: window j of the step's global batch, epoch by epoch."""
    ids = []
    for j in range(sampler.global_batch):
        epoch, pos = divmod(step * sampler.global_batch + j, sampler.n_windows)
        ids.append(np.random.default_rng([sampler.seed, epoch]).permutation(sampler.n_windows)[pos])
    return np.array(ids)


def test_window_ids_are_computed_once_per_step_and_equal_the_per_sequence_rule(stdlib_data):
    sampler = B.BatchSampler(stdlib_data.train, 32, 48, seed=3)
    epoch_len = sampler.n_windows // 48 + 1  # this step's batch straddles the first epoch boundary
    for step in (0, 1, epoch_len - 1, epoch_len, 3 * epoch_len):
        np.testing.assert_array_equal(sampler.window_ids(step), _loop_window_ids(sampler, step))
    ids = sampler.window_ids(5)
    assert sampler.window_ids(5) is ids  # every micro-batch of step 5 reads the same array
    x, y = sampler.batch(5, slice(8, 16))
    w = np.stack([stdlib_data.train.window(int(i) * 32, 33) for i in ids[8:16]])
    np.testing.assert_array_equal(x, w[:, :-1])
    np.testing.assert_array_equal(y, w[:, 1:])
    xt, yt = sampler.batch_on(5, slice(8, 16), "cpu")
    assert torch.equal(xt, torch.from_numpy(x)) and torch.equal(yt, torch.from_numpy(y))


def test_cuda_batches_are_copied_from_pinned_memory_without_blocking(monkeypatch):
    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    def to(self, *args, **kwargs):
        calls.append(("to", str(args[0]), kwargs.get("non_blocking")))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    B.to_device(np.zeros((2, 3), dtype=np.int64), torch.device("cuda", 0))
    assert calls == ["pin", ("to", "cuda:0", True)]
    calls.clear()
    B.to_device(np.zeros((2, 3), dtype=np.int64), "cpu")  # pinning needs CUDA; on CPU the copy is a no-op anyway
    assert calls == [("to", "cpu", True)]


# ----------------------------------------------------------------------------- DDP and NCCL


def _run(device, world=1, **cfg):
    model = LoopedLM(ModelConfig(arch="asymloop", n_layer=2, d_model=32, n_head=2, d_ff=64, vocab_size=64, max_seq_len=16))
    cfg = types.SimpleNamespace(**{"compile": None, "compile_backend": "inductor", **cfg})
    said = []
    return types.SimpleNamespace(raw=model, cfg=cfg, device=torch.device(device), world=world, say=said.append, said=said)


def test_ddp_is_built_without_buffer_broadcasts_and_with_bucket_view_gradients(monkeypatch):
    built = {}
    monkeypatch.setattr(T, "DDP", lambda model, **kw: built.update(kw) or model)
    T.compile_and_wrap(_run("cpu", world=2))
    assert built == dict(device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True)


def test_nccl_process_group_gets_its_device(monkeypatch):
    got = {}
    monkeypatch.setattr(T.dist, "init_process_group", lambda backend, **kw: got.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: got.update(set_device=d))
    T.init_process_group(torch.device("cuda", 1), 60)
    assert got["backend"] == "nccl" and got["device_id"] == torch.device("cuda", 1) and got["set_device"] == torch.device("cuda", 1)
    got.clear()
    T.init_process_group(torch.device("cpu"), 60)
    assert got["backend"] == "gloo" and got["device_id"] is None and "set_device" not in got


# ----------------------------------------------------------------------------- compile preflight


def _bare_machine(monkeypatch, tmp_path):
    """No $CC, no gcc or clang on PATH, and an include directory without Python.h."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(system.shutil, "which", lambda name: None)
    monkeypatch.setattr(system, "python_include_dir", lambda: tmp_path)


def test_preflight_names_what_is_missing_and_the_packages(monkeypatch, tmp_path):
    assert system.compile_preflight() is None  # this machine has gcc and Python.h (the CPU tests compile nothing)
    _bare_machine(monkeypatch, tmp_path)
    why = system.compile_preflight()
    assert "\n" not in why and "no C compiler (no gcc or clang on PATH)" in why and f"no Python.h in {tmp_path}" in why
    assert "apt-get install build-essential python3-dev" in why and "--compile false" in why
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setenv("CC", "/opt/missing-cc")
    why = system.compile_preflight()
    assert "$CC=/opt/missing-cc is not on PATH" in why and "Python headers" not in why
    monkeypatch.setattr(system.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert system.compile_preflight() is None


def test_cuda_compile_without_a_toolchain_stops_when_asked_and_falls_back_to_eager_on_auto(monkeypatch, tmp_path):
    _bare_machine(monkeypatch, tmp_path)
    with pytest.raises(system.ConfigError, match=r"^torch.compile cannot build GPU kernels here: .*apt-get install build-essential"):
        T.compile_and_wrap(_run("cuda", compile=True))
    run = _run("cuda", compile=None)  # auto: on for CUDA
    with pytest.warns(RuntimeWarning, match="training EAGER"):
        model = T.compile_and_wrap(run)
    assert model is run.raw and not run.compiled and run.said and run.said[0].startswith("WARNING: training EAGER")
    # the checks concern Triton: CPU and other backends are not stopped
    assert T.compile_and_wrap(_run("cpu", compile=True, compile_backend="aot_eager")) is not None
    run = _run("cuda", compile=True, compile_backend="aot_eager")
    assert T.compile_and_wrap(run) is not run.raw and run.compiled
    # with the toolchain present, CUDA compiles (torch.compile is lazy: nothing runs on a GPU here)
    monkeypatch.setattr(T, "compile_preflight", lambda: None)
    run = _run("cuda", compile=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "training EAGER" warning
        assert T.compile_and_wrap(run) is not run.raw and run.compiled
