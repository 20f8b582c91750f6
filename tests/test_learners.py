"""Learners' hardware and the command line: the device and dtype choice (CUDA, MPS and bf16 availability faked), fp16
autocast with loss scaling on CPU (overflow skips counted, the scaler checkpointed, exact resume), MPS's missing ops as
one line, and a --help that says what every option does."""

import logging
from dataclasses import dataclass, fields

import pytest
import torch
from test_bad_input import _train_argv

import train_minimal
from minimal_asymloop import bench, checkpoint, kernels, system, trainer
from minimal_asymloop.config import TRAIN_PRESETS, TrainConfig, field_docs
from minimal_asymloop.model import PRESETS, ModelConfig
from minimal_asymloop.trainer import NAN_ENV, read_metrics, train

# ----------------------------------------------------------------------------- which device, which dtype


def _fake_machine(monkeypatch, cuda=False, bf16=False, mps=False, name="Tesla T4"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16 or (cuda and including_emulation))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize("cuda, bf16, mps, device, dtype", [
    (True, True, True, "cuda:0", torch.bfloat16),  # an A100/H100: CUDA first, bf16
    (True, False, False, "cuda:0", torch.float16),  # a T4 or V100 (bf16 only emulated): fp16 with loss scaling
    (False, False, True, "mps", torch.float32),  # a Mac: MPS, float32 (ours)
    (False, False, False, "cpu", torch.float32),
])
def test_auto_picks_cuda_then_mps_then_cpu_and_a_dtype_the_hardware_runs_fast(cuda, bf16, mps, device, dtype, monkeypatch):
    _fake_machine(monkeypatch, cuda=cuda, bf16=bf16, mps=mps)
    assert system.resolve_device(TrainConfig(max_steps=1), local_rank=0) == (torch.device(device), dtype)
    scaler = system.grad_scaler(torch.device(device), dtype)
    assert scaler.is_enabled() == (dtype == torch.float16)


@pytest.mark.parametrize("machine, device, dtype, expected", [
    (dict(cuda=True), "cuda", "bfloat16", "has no bfloat16 arithmetic (it needs compute capability >= 8.0); use --dtype float16"),
    (dict(), "mps", "auto", "--device mps asked for, but MPS is not available (this PyTorch build has no MPS); use --device auto"),
    (dict(), "cuda", "auto", "--device cuda asked for, but CUDA is not available; use --device auto (here: cpu)"),
])
def test_hardware_that_cannot_run_the_setting_is_one_line(machine, device, dtype, expected, data_cache, tmp_path, monkeypatch, capsys):
    _fake_machine(monkeypatch, **machine)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    argv = _train_argv(data_cache, tmp_path / "o") + ["--device", device, "--dtype", dtype]
    with pytest.raises(SystemExit) as e:
        train_minimal.main(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code and expected in e.value.code, e.value.code
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("option, value, choices", [
    ("--arch", "loop", "dense, full_loop, asymloop"), ("--context", "global", "global_kv, additive, none"),
    ("--device", "gpu", "auto, cuda, mps, cpu (or cuda:N"), ("--dtype", "fp16", "auto, float32, bfloat16, float16"),
])
def test_an_unknown_choice_is_one_line_naming_the_choices(option, value, choices, data_cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_minimal.main(_train_argv(data_cache, tmp_path / "o", option, value))
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"unknown {option[2:]} '{value}'; choose one of {choices}" in line, line


def test_every_choice_the_help_lists_is_the_one_the_config_checks():
    """The choices shown in --help are the tuples the dataclasses validate against: a bad value's error names each one."""
    for name, choices in train_minimal.CHOICES.items():
        cls = ModelConfig if name in {f.name for f in fields(ModelConfig)} else TrainConfig
        kw = {} if cls is ModelConfig else dict(max_steps=1)
        with pytest.raises(ValueError) as e:
            cls(**kw, **{name: "bogus"})
        assert all(c in str(e.value) for c in choices), (name, str(e.value))


def test_joint_attention_on_mps_takes_the_exact_masked_path_and_says_why(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_reported", set())
    with caplog.at_level(logging.INFO, logger="minimal_asymloop.kernels"):
        assert kernels.joint_attention_impl("mps", None, torch.float32, 32) == "masked"
    assert "joint attention on mps torch.float32: masked SDPA over 2N keys, because no flash kernel on mps" in caplog.text


def test_the_mps_rng_is_saved_and_restored(monkeypatch):
    state = torch.ByteTensor([1, 2, 3])
    restored = []
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: state)
    monkeypatch.setattr(torch.mps, "set_rng_state", restored.append)
    rng = trainer.rng_state(torch.device("mps"))
    assert rng["mps"] is state and rng["cuda"] is None
    trainer.restore_rng(rng, torch.device("mps"))
    assert restored == [state]
    trainer.restore_rng(rng, torch.device("cpu"))  # a CPU resume of a Mac checkpoint has no MPS generator to set
    assert restored == [state]


MPS_MISSING_OP = NotImplementedError(
    "The operator 'aten::_fused_rms_norm' is not currently implemented for the MPS device. If you want this op to be added in "
    "priority during the prototype phase of this feature, please comment on https://github.com/pytorch/pytorch/issues/77764. "
    "As a temporary fix, you can set the environment variable `PYTORCH_ENABLE_MPS_FALLBACK=1` to use the CPU as a fallback for "
    "this op. WARNING: this will be slower than running natively on MPS.")
MPS_NO_FLOAT64 = TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64. "
                           "Please use float32 instead.")


@pytest.mark.parametrize("error, expected", [
    (MPS_MISSING_OP, "has no MPS kernel for aten::_fused_rms_norm; rerun with PYTORCH_ENABLE_MPS_FALLBACK=1"),
    (MPS_NO_FLOAT64, "the MPS backend cannot run a dtype this run uses (Cannot convert a MPS Tensor to float64"),
])
def test_an_op_or_dtype_mps_lacks_is_one_line_naming_the_fix(error, expected, data_cache, tmp_path, monkeypatch, capsys):
    def fails(*a, **k):
        raise error

    monkeypatch.setattr(trainer, "compute_loss", fails)  # what PyTorch raises on a Mac, raised here at the first step
    with pytest.raises(SystemExit) as e:
        train_minimal.main(_train_argv(data_cache, tmp_path / "o"))
    assert isinstance(e.value.code, str) and "\n" not in e.value.code and expected in e.value.code, e.value.code
    assert "Traceback" not in capsys.readouterr().err
    assert system.mps_error(RuntimeError("shape mismatch")) is None  # any other error keeps its traceback


def test_bench_train_takes_mps_and_says_in_one_line_when_it_is_missing(monkeypatch, capsys):
    _fake_machine(monkeypatch)
    with pytest.raises(SystemExit, match=r"^error: --device mps asked for, but MPS is not available"):
        bench.main(["train", "--device", "mps"])


# ----------------------------------------------------------------------------- fp16 with loss scaling, on CPU


def _small_scale(monkeypatch):
    """A loss scale that overflows this tiny model's fp16 gradients at first and, growing every 2 good steps, again later."""
    monkeypatch.setattr(trainer, "grad_scaler", lambda device, dtype: torch.amp.GradScaler(
        device.type, init_scale=4e6, growth_interval=2, enabled=dtype == torch.float16))


ROW = ("step", "loss", "grad_norm", "lr", "loss_scale", "overflow_skipped", "val_loss")


@pytest.mark.slow  # three short fp16 runs on CPU: ~30 s
def test_fp16_skips_overflowed_steps_counts_them_and_resumes_exactly(tiny_configs, monkeypatch, capsys):
    _small_scale(monkeypatch)
    mcfg, straight = tiny_configs(max_steps=6, eval_interval=4, dtype="float16", quiet=False)
    result = train(mcfg, straight)
    rows = [r for r in read_metrics(straight.out_dir) if "loss" in r]
    said = capsys.readouterr().out
    counts = [0] + [r["overflow_skipped"] for r in rows]
    overflows = [r["step"] for r, before in zip(rows, counts) if r["overflow_skipped"] > before]
    assert overflows and overflows[0] == 1 and max(overflows) > 4, overflows  # skips before and after the resume point
    assert all(f"step {s}: fp16 gradients overflowed at loss scale" in said for s in overflows)
    assert result["overflow_skipped"] == rows[-1]["overflow_skipped"] == len(overflows) and result["nonfinite_skipped"] == 0
    assert f"fp16 loss scaling: {len(overflows)} of 6 steps skipped for gradient overflow" in said
    assert len({r["loss_scale"] for r in rows}) > 1  # the scale moved down and up
    assert all(r["grad_norm"] < 100 for r in rows if r["step"] not in overflows)  # clipped after unscaling, not at 1e6 x

    _, split = tiny_configs(max_steps=6, eval_interval=4, dtype="float16", out_dir=straight.out_dir + "-split", stop_step=4)
    train(mcfg, split)
    assert checkpoint.load_state(split.out_dir)["grad_scaler"]["scale"] == rows[4]["loss_scale"]  # the scale step 5 runs at
    resumed = train(mcfg, TrainConfig(**{**vars(split), "stop_step": None, "resume": True}))
    curve = lambda out: [{k: r.get(k) for k in ROW} for r in read_metrics(out)]
    assert curve(split.out_dir) == curve(straight.out_dir)
    assert resumed["overflow_skipped"] == result["overflow_skipped"]
    a, b = checkpoint.load_model(straight.out_dir)[0], checkpoint.load_model(split.out_dir)[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_fp16_a_nan_loss_is_a_non_finite_skip_not_an_overflow(tiny_configs, monkeypatch):
    """--skip-nonfinite counts a NaN loss once, as non-finite; the overflow count is only for finite losses."""
    _small_scale(monkeypatch)
    monkeypatch.setenv(NAN_ENV, "4")
    mcfg, tcfg = tiny_configs(max_steps=5, eval_interval=5, dtype="float16", skip_nonfinite=True)
    result = train(mcfg, tcfg)
    rows = {r["step"]: r for r in read_metrics(tcfg.out_dir) if "loss" in r}
    assert rows[4].get("nonfinite_skipped") == 1 and rows[4]["overflow_skipped"] == rows[3]["overflow_skipped"]
    assert result["nonfinite_skipped"] == 1 and result["overflow_skipped"] == rows[5]["overflow_skipped"]


# ----------------------------------------------------------------------------- --help


def test_every_config_field_has_a_description_and_says_what_none_means():
    for cls in (ModelConfig, TrainConfig):
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in fields(cls)}
        for f in fields(cls):
            assert len(docs[f.name]) > 10, (cls.__name__, f.name, docs[f.name])
            if f.default is None:  # the help prints what None means as the default
                assert "; None -> " in docs[f.name], (cls.__name__, f.name, docs[f.name])


def test_field_docs_reads_the_comment_at_the_end_of_the_fields_line():
    @dataclass
    class Example:
        # a section header, not a description
        width: int = 8  # the width
        depth: int = (
            2)  # a field spread over two lines
        bare: int = 0

    assert field_docs(Example) == {"width": "the width", "depth": "a field spread over two lines", "bare": ""}


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help_of(parser) -> dict[str, str]:
    """{--option: its help text, whitespace collapsed}."""
    return {a.option_strings[0]: " ".join(a.help.split()) for a in parser._actions if a.option_strings}


def test_every_option_says_what_it_does_its_choices_and_its_default():
    parser = train_minimal.build_parser("tiny")
    helps = _help_of(parser)
    for cls in (ModelConfig, TrainConfig):
        docs = field_docs(cls)
        for f in fields(cls):
            text = helps[_option(f.name)]
            assert text.startswith(docs[f.name].partition("; None -> ")[0].replace("%", "%%")), (f.name, text)
            assert "(default: " in text and "None" not in text.split("(default: ")[1], (f.name, text)
    metavars = {a.option_strings[0]: a.metavar for a in parser._actions if a.option_strings}
    for name, choices in train_minimal.CHOICES.items():
        assert metavars[_option(name)] == "{" + ",".join(choices) + "}", name
    assert helps["--compile"].endswith("(default: auto: on for CUDA, off elsewhere (ours))"), helps["--compile"]
    out = " ".join(parser.format_help().split())
    assert "--compile [BOOL] torch.compile the training step" in out and "5%" in out  # argparse rendered it, % and all


@pytest.mark.parametrize("size", ["tiny", "60m", "olmo8"])
def test_help_with_a_size_shows_the_values_that_preset_sets(size, capsys):
    with pytest.raises(SystemExit) as e:
        train_minimal.main(["--help", "--size", size])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split()).split(" options: ")[1]  # the option list, after the usage and the examples
    order = [o for o in _help_of(train_minimal.build_parser())]
    where = {o: out.index(f" {o} ") for o in order if o != "-h"}
    ends = dict(zip(order[1:], [*list(where.values())[1:], len(out)]))
    for name, value in {**PRESETS[size], **TRAIN_PRESETS[size]}.items():
        entry = out[where[_option(name)]:ends[_option(name)]]
        assert entry.endswith(f"; --size {size} sets {train_minimal._show(value)})"), (name, entry)
    other = next(s for s in PRESETS if s != size)
    assert f"--size {other} sets" not in out


def test_auto_on_the_command_line_means_the_automatic_value():
    p = train_minimal.build_parser()
    assert vars(p.parse_args(["--compile", "auto", "--micro-batch", "auto"])) == dict(size="tiny", arch="asymloop", moe=False, compile=None,
                                                                                    micro_batch=None)
    assert vars(p.parse_args(["--context", "none"]))["context"] == "none"  # a str field keeps "none": the ablation

