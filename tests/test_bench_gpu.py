"""`python -m minimal_asymloop.bench gpu`: its logic runs on CPU at tiny size, so a short GPU session does not
find its bugs. Only the CUDA-only lines (device properties, peak memory, fused AdamW, compiled flex) are left."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minimal_asymloop import bench_gpu
from minimal_asymloop.model import causal_attention, joint_attention_reference

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_gpu_without_cuda_is_one_line():
    r = subprocess.run([sys.executable, "-m", "minimal_asymloop.bench", "gpu"], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bench gpu needs a CUDA GPU" in lines[0], r.stderr


@pytest.mark.slow
def test_every_section_runs_on_cpu_without_datasets(tmp_path):
    """All five sections at tiny size on CPU in the command's order (training first, AsymLoop K=3 its first row),
    compiled with aot_eager as the GPU run compiles with inductor, with `datasets` made unimportable: the stdlib
    corpus + BPE path must not need it. Checks the figures are there and sane, and the JSON written by --out."""
    out = tmp_path / "gpu.json"
    script = textwrap.dedent(f"""
        import sys
        sys.modules["datasets"] = None  # any `import datasets` now raises ImportError
        import torch
        import minimal_asymloop.bench  # the command's module, which `python -m minimal_asymloop.bench gpu` imports
        from minimal_asymloop import bench_gpu
        report = bench_gpu.gpu_report(torch.device("cpu"), "tiny", "aot_eager", {str(tmp_path / 'cache')!r}, {str(out)!r})
        assert "datasets" not in [m.split(".")[0] for m, v in sys.modules.items() if v is not None]
        sys.exit(1 if report["failed"] else 0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=900)  # 3 compiles
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["skipped"] == {} and report["scale"] == "tiny"
    assert [k for k in report if k in ("versions", "training", "sdpa_backends", "joint_attention", "generation")] == [
        "versions", "training", "sdpa_backends", "joint_attention", "generation"]  # the order they ran in
    assert report["versions"]["torch"] == torch.__version__
    calls = report["sdpa_backends"]["calls"]
    assert report["sdpa_backends"]["joint_attention_impl"] == "flash"
    assert all(c["backend"] == "flash (CPU)" for c in calls.values()), calls
    impls = report["joint_attention"]["impls"]
    assert set(impls) == {"flash", "flex", "masked"} and all(row["ok"] for row in impls.values()), impls
    assert set(impls["flash"]["max_rel_err"]) == {"out", "dq", "dk_glob", "dv_glob", "dk_loc", "dv_loc"}
    assert impls["flex"]["timed"] == "forward only"  # FlexAttention has no CPU backward
    assert report["generation"]["ok"] and report["generation"]["argmax_agreement"] > 0.9
    rows = report["training"]["rows"]
    assert list(rows) == ["asymloop K=3", "asymloop K=3 eager", "dense K=1", "full_loop K=2"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["mfu"] is None and row["peak_mem_gib"] is None  # CPU: no MFU, no CUDA memory
        assert 0 < row["last_loss"] < 10
    assert [row["compile"] for row in rows.values()] == ["aot_eager", None, "aot_eager", "aot_eager"]
    assert rows["dense K=1"]["flop_normalized_vs_dense"] == 1.0 and "flop_normalized_vs_dense" not in rows["asymloop K=3 eager"]
    # the same weights and batch, compiled or not: the same loss
    assert abs(rows["asymloop K=3"]["last_loss"] - rows["asymloop K=3 eager"]["last_loss"]) < 1e-3
    assert "[training]" in r.stdout and "tok/s" in r.stdout and "x the eager step's speed" in r.stdout


def test_a_failing_section_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    for name in ("gpu_sdpa_backends", "gpu_joint_attention", "gpu_training"):
        monkeypatch.setattr(bench_gpu, name, lambda *a, **k: {})
    monkeypatch.setattr(bench_gpu, "gpu_generation", broken)
    monkeypatch.setattr(bench_gpu, "_say_section", lambda *a: None)
    printed = []
    report = bench_gpu.gpu_report(torch.device("cpu"), "tiny", None, str(tmp_path), tmp_path / "r.json", say=printed.append)
    assert report["failed"] == ["generation"]
    assert report["generation"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "versions" in report and "training" in report
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == ["generation"]
    assert "  FAILED: RuntimeError: CUDA error: an illegal memory access was encountered" in printed


def test_sdpa_backend_names_the_kernel():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    fused = bench_gpu.sdpa_backend(causal_attention, q, k, v)
    assert fused["backend"] == "flash (CPU)"
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in fused["ops"]
    assert bench_gpu.sdpa_backend(joint_attention_reference, q, k, v, k, v)["backend"] == "math (unfused)"


def test_training_summary_states_the_targets():
    row = dict(tokens_per_s=410_000, mfu=0.41)
    said = []
    bench_gpu._say_section("training", dict(rows={"asymloop K=3": row}, targets=dict(asymloop_tokens_per_s=400_000, asymloop_mfu=0.40),
                                            seconds=1.0), said.append)
    assert "met" in said[0] and "NOT" not in said[0]
    row["mfu"] = 0.3
    said.clear()
    bench_gpu._say_section("training", dict(rows={"asymloop K=3": row}, targets=dict(asymloop_tokens_per_s=400_000, asymloop_mfu=0.40),
                                            seconds=1.0), said.append)
    assert "NOT met" in said[0]


class _FakeTokens:
    def window(self, start, n):
        return torch.randint(0, 512, (n,)).numpy()

    def __len__(self):
        return 10_000


class _FakeData:
    vocab_size, train = 512, _FakeTokens()


def _fake_rows(monkeypatch, first_step_s):
    ran = []

    def row(cfg, x, device, dtype, backend, min_time, max_steps):
        ran.append((cfg.arch, backend))
        return dict(arch=cfg.arch, n_iter=cfg.n_iter, compile=backend, step_ms=10.0, tokens_per_s=1.0, mfu=None, peak_mem_gib=None,
                    compile_s=None, first_step_s=first_step_s if backend else 0.1, flops_per_token=1.0, last_loss=5.0)

    monkeypatch.setattr(bench_gpu, "_bench_tokens", lambda *a: (_FakeData, 0.0))
    monkeypatch.setattr(bench_gpu, "gpu_train_row", row)
    return ran


def test_asymloop_runs_first_and_rows_that_would_overrun_are_skipped_with_the_reason(monkeypatch):
    """AsymLoop K=3 runs whatever the budget; a later compiled row that needs the compile time the first row took is
    skipped when that time is not left, and the report names each skipped row and why; the eager row still runs."""
    ran = _fake_rows(monkeypatch, first_step_s=100.0)
    sc = bench_gpu.GPU_SCALES["tiny"]
    r = bench_gpu.gpu_training(torch.device("cpu"), torch.bfloat16, sc, "inductor", "unused", time.perf_counter() + 50, lambda *a: None)
    assert ran == [("asymloop", "inductor"), ("asymloop", None)]
    assert list(r["rows"]) == ["asymloop K=3", "asymloop K=3 eager", "dense K=1", "full_loop K=2"]
    assert set(r["skipped"]) == {"dense K=1", "full_loop K=2"}
    assert all(why.startswith("time budget: ") and "needs about 100s" in why for why in r["skipped"].values()), r["skipped"]
    # with the time, every row runs
    ran.clear()
    r = bench_gpu.gpu_training(torch.device("cpu"), torch.bfloat16, sc, "inductor", "unused", time.perf_counter() + 500, lambda *a: None)
    assert len(ran) == 4 and r["skipped"] == {}


def test_a_machine_that_cannot_compile_skips_the_compiled_rows_and_says_why(monkeypatch):
    ran = _fake_rows(monkeypatch, first_step_s=1.0)
    why = "torch.compile cannot build GPU kernels here: no C compiler"
    r = bench_gpu.gpu_training(torch.device("cpu"), torch.bfloat16, bench_gpu.GPU_SCALES["tiny"], "inductor", "unused",
                               time.perf_counter() + 500, lambda *a: None, no_compile_why=why)
    assert ran == [("asymloop", None)]
    assert r["skipped"] == {"asymloop K=3": why, "dense K=1": why, "full_loop K=2": why}


def test_sections_past_the_budget_are_skipped_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setitem(bench_gpu.GPU_SCALES, "tiny", {**bench_gpu.GPU_SCALES["tiny"], "budget_s": 0,
                                                       "reserve_s": dict(sdpa_backends=5, joint_attention=5, generation=5)})
    monkeypatch.setattr(bench_gpu, "gpu_training", lambda *a: dict(rows={}, skipped={"dense K=1": "time budget: 0s left"}))
    monkeypatch.setattr(bench_gpu, "_say_section", lambda *a: None)
    report = bench_gpu.gpu_report(torch.device("cpu"), "tiny", None, str(tmp_path), tmp_path / "r.json", say=lambda *a: None)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["skipped"]) == {"sdpa_backends", "joint_attention", "generation", "training: dense K=1"}
    assert report["failed"] == [] and "versions" in report and "training" in report
