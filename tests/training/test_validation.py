"""Every setting is checked when it is given (TrainConfig, add_lora, pack, load_model, the demo and the CLI):
the error names the value and the fix; legal but doubtful values warn. Issue 26's cases, one by one."""

from __future__ import annotations

import math

import pytest
import torch

import fastft
from fastft.checks import SettingError
from fastft.cli import build_parser, main
from fastft.data.errors import MalformedRowError
from fastft.data.skills import generate
from fastft.models.loading import ModelLoadError
from fastft.models.lora import LoraTargetError
from fastft.training.demo_config import DemoConfig
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(40, seed=5))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(max_grad_norm=-1), r"max_grad_norm must be above 0, got -1.*reverse or zero every update"),
        (dict(max_grad_norm=0), r"max_grad_norm must be above 0, got 0"),
        (dict(epochs=0), r"epochs must be above 0, got 0"),
        (dict(epochs=-1), r"epochs must be above 0, got -1"),
        (dict(save_every=-1, output_dir="x"), r"save_every must be at least 1, got -1.*save_every=None"),
        (dict(eval_every=0), r"eval_every must be at least 1"),
        (dict(warmup=-1), r"warmup must be at least 0, got -1"),
        (dict(warmup=-0.1), r"warmup must be in \[0, 1\), got -0.1"),
        (dict(warmup=1.5), r"warmup must be in \[0, 1\), got 1.5"),
        (dict(learning_rate=math.inf), r"learning_rate must be a finite number, got inf"),
        (dict(learning_rate=0), r"learning_rate must be above 0"),
        (dict(max_steps=1.5), r"max_steps must be a whole number \(an int\), got 1.5 \(float\)"),
        (dict(max_steps=0), r"max_steps must be at least 1"),
        (dict(micro_batch_bins=0), r"micro_batch_bins must be at least 1"),
        (dict(grad_accum_steps=2.0), r"grad_accum_steps must be a whole number"),
        (dict(seed=1.5), r"seed must be a whole number"),
        (dict(adam_betas=(0.9, 1.0)), r"adam_betas must be in \[0, 1\)"),
        (dict(weight_decay=-0.1), r"weight_decay must be at least 0"),
        (dict(min_learning_rate_ratio=2), r"min_learning_rate_ratio must be in \[0, 1\]"),
        (dict(reset_optimizer="yes"), r"reset_optimizer must be True or False"),
        (dict(profile="off"), r"profile must be True or False, got 'off'"),
        (dict(save_every=5), r"need output_dir"),
        (
            dict(attention="varlne"),
            r"attention='varlne' is not a packed-attention backend. Did you mean 'varlen'",
        ),
        (dict(static_shapes="yes"), r"static_shapes must be None"),
    ],
)
def test_train_config_refuses_values_that_break_training(settings, message):
    with pytest.raises(SettingError, match=message):
        TrainConfig(**settings)


def test_doubtful_train_settings_warn():
    with pytest.warns(UserWarning, match=r"warmup=10 steps is not shorter than the run \(5 steps\)"):
        TrainConfig(max_steps=5, warmup=10)
    with pytest.warns(UserWarning, match="far above what fine-tuning takes"):
        TrainConfig(learning_rate=5.0)


@pytest.fixture(scope="module")
def base():
    return fastft.load_model("tiny-llama", max_seq_length=128)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (dict(r=1.5), SettingError, r"LoRA rank r must be a whole number \(an int\), got 1.5"),
        (dict(r=0), SettingError, r"LoRA rank r must be at least 1"),
        (dict(alpha=0), SettingError, r"alpha must be above 0, got 0.*alpha / r"),
        (dict(alpha=-16), SettingError, r"alpha must be above 0, got -16"),
        (dict(dropout=-0.1), SettingError, r"dropout must be in \[0, 1\), got -0.1"),
        (dict(dropout=1.0), SettingError, r"dropout must be in \[0, 1\), got 1"),
        (
            dict(target_modules=[]),
            LoraTargetError,
            r"target_modules=\[\]: give 'all-linear' or a non-empty list",
        ),
        (dict(target_modules=[3]), LoraTargetError, r"target_modules=\[3\]"),
        (dict(seed=0.5), SettingError, r"seed must be a whole number"),
    ],
)
def test_add_lora_refuses_bad_arguments_before_touching_the_model(base, settings, error, message):
    model, _ = base
    with pytest.raises(error, match=message):
        fastft.add_lora(model, **settings)
    assert not any("lora_" in name for name, _ in model.named_parameters())


def test_a_rank_above_half_the_layer_width_warns():
    model, _ = fastft.load_model("tiny-llama", max_seq_length=128)
    with pytest.warns(
        UserWarning, match=r"r=48 is above half the width of the narrowest targeted layer \(64\)"
    ):
        fastft.add_lora(model, r=48)


def test_add_lora_on_a_base_that_already_carries_adapters_raises_and_keeps_them():
    base, _ = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(base, r=4, seed=1)
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(0.5)  # as if trained
    with pytest.raises(ValueError, match="already carry LoRA adapters.*Use the model add_lora returned"):
        fastft.add_lora(base, r=4, seed=1)
    assert float(lora_b.abs().sum()) > 0  # not re-initialised
    assert fastft.add_lora(model, r=4, seed=1) is model  # the returned model: still a no-op re-run


def test_training_without_adapters_raises_naming_full_fine_tuning():
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    with pytest.raises(ValueError, match="no LoRA adapters.*full fine-tuning.*not support yet.*add_lora"):
        Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128))


@pytest.mark.parametrize(
    ("dataset", "max_seq_length", "error", "message"),
    [
        (None, 128, ValueError, "dataset is None"),
        (["a question", "another"], 128, MalformedRowError, r"row 0 .*: the row is a str, not a dict"),
        ("train.jsonl", 128, ValueError, r"pack takes rows, not the path 'train.jsonl'.*load_dataset"),
        (ROWS, 3.5, SettingError, r"max_seq_length must be a whole number \(an int\), got 3.5"),
        (ROWS, 1e9, SettingError, r"max_seq_length must be a whole number \(an int\), got 1000000000.0"),
    ],
)
def test_pack_refuses_what_is_not_rows_or_a_length(base, dataset, max_seq_length, error, message):
    _, tokenizer = base
    with pytest.raises(error, match=message):
        fastft.pack(dataset, tokenizer, max_seq_length)


def test_load_model_checks_its_length_and_device():
    with pytest.raises(SettingError, match="max_seq_length must be a whole number"):
        fastft.load_model("tiny-llama", max_seq_length=1e9)
    with pytest.raises(ModelLoadError, match="device='gpu' is not a device"):
        fastft.load_model("tiny-llama", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available here.*device='cpu'"):
            fastft.load_model("tiny-llama", device="cuda")


def test_output_dir_is_checked_before_training(base, tmp_path):
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4)
    data = fastft.pack(ROWS, tokenizer, 128)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SettingError, match="is a file, not a folder"):
        Trainer(model, tokenizer, data, config=TrainConfig(output_dir=str(a_file)))
    with pytest.raises(SettingError, match="cannot be written"):
        Trainer(model, tokenizer, data, config=TrainConfig(output_dir=str(a_file / "runs")))


def test_an_empty_accuracy_set_is_an_error(base):
    model, tokenizer = base
    with pytest.raises(ValueError, match="no rows"):
        fastft.evaluate_accuracy(model, tokenizer, [])


def test_a_csv_with_an_unclosed_quote_is_an_error_at_its_line(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('text\n"first row\nsecond\nthird\n', encoding="utf-8")
    with pytest.raises(MalformedRowError, match=r"rows.csv line 2: a quote .* is never closed"):
        fastft.load_dataset(str(path))


@pytest.fixture
def no_loading(monkeypatch):
    """The demo must fail before any model loads: loading is a test failure here."""
    import fastft.demo

    def refuse(*args, **kwargs):
        raise AssertionError("the demo loaded a model before checking its settings")

    monkeypatch.setattr(fastft.demo, "load_model", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-samples", "0"], "eval-samples must be at least 1"),
        (["--steps", "-3"], "steps must be at least 1"),
        (["--learning-rate", "inf"], "learning-rate must be a finite number"),
        (["--lora-alpha", "0"], "lora-alpha must be above 0"),
    ],
)
def test_the_demo_cli_prints_the_error_and_fix_without_a_traceback(argv, message, capsys, no_loading):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_demo_checks_its_paths_and_device_before_loading(tmp_path, capsys, no_loading):
    (tmp_path / "runs").write_text("a file")
    assert main(["demo", "--output-dir", str(tmp_path / "runs"), "--name", "x"]) == 2
    assert "cannot be written" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_lora_alpha_takes_a_float_on_the_command_line():
    args = build_parser().parse_args(["demo", "--lora-alpha", "16.5"])
    assert args.lora_alpha == 16.5
    assert DemoConfig(lora_alpha=16.5).lora_alpha == 16.5


def test_a_failing_cli_run_prints_one_error_line_unless_a_traceback_is_asked_for(
    tmp_path, capsys, monkeypatch
):
    argv = ["demo", "--model", "no-such-model", "--output-dir", str(tmp_path), "--name", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "no-such-model" in err and "Traceback" not in err
    monkeypatch.setenv("FASTFT_TRACEBACK", "1")
    with pytest.raises(ModelLoadError):
        main(argv)


def test_a_demo_that_fails_to_load_its_model_leaves_no_empty_run_folder(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["demo", "--model", "no-such-preset", "--output-dir", str(runs), "--name", "x"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    assert not (runs / "x").exists()
