"""A model transformers kernelized (hub kernels, the `kernels` package) keeps fastft's fused forwards.

transformers >= 5.25 kernelizes every ``from_pretrained`` model when `kernels` is installed
(``use_kernels`` defaults to on; `fastft.load_model` turns it off), and re-kernelizes it whenever ``train()`` /
``eval()`` change its mode:
`kernels.kernelize` gives each hub-kernel layer (the RMSNorms) the hub kernel's forward or, with none for the
device (any CPU), the class forward, by deleting the instance ``forward`` that `fastft.patch` installed.
These tests run that real path offline: the default mapping has no CPU kernels, so kernelize falls back, and
a local kernel build (`kernels.LocalLayerRepository`) stands in for a hub kernel that does apply.
"""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch

import fastft
from fastft.data.batch import PackedBatch
from fastft.models.patch import UnfusedWarning, patch, patch_report, unpatch
from fastft.runtime.model_state import model_state
from fastft.training.loss import causal_lm_loss_sum

pytest.importorskip("kernels")
from kernels import LocalLayerRepository, Mode, use_kernel_mapping  # noqa: E402


@pytest.fixture(autouse=True)
def _hub_kernels_on(monkeypatch):
    """transformers' default: hub kernels on unless ``USE_HUB_KERNELS`` turns them off."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)


@pytest.fixture
def norm_calls(monkeypatch) -> list:
    """One entry per call of fastft's fused RMSNorm function."""
    from fastft.kernels import rms_norm as module

    calls, real = [], module.rms_norm
    monkeypatch.setattr(module, "rms_norm", lambda *args: calls.append(1) or real(*args))
    return calls


def _saved_preset(folder, name: str = "tiny-llama"):
    model, tokenizer = fastft.load_model(name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _kernelized(folder, how: str):
    """tiny-llama kernelized the ways a user gets there."""
    if how == "use_kernels=True":  # what TRL's SFTConfig(model_init_kwargs={"use_kernels": True}) passes
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder, use_kernels=True)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:  # kernels turned on for a model already built
        model, tokenizer = fastft.load_model("tiny-llama")
        model.set_use_kernels(True)
    assert model.use_kernels
    return model, tokenizer


def _lora(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        return fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False)


def _fused_forwards(model) -> dict:
    """The forward each patched module runs now, by module."""
    return {module: vars(module).get("forward") for module in model_state(model).kernels.modules}


def _same(forwards: dict, expected: dict) -> bool:
    return all(
        getattr(forwards[module], "__func__", None) is expected[module].__func__ for module in expected
    )


def _batch() -> PackedBatch:
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 500, (n,), generator=generator).numpy() for n in (9, 17)]
    return PackedBatch.from_sequences(ids, [i.copy() for i in ids])


def _norms(model) -> int:
    return 2 * model.config.num_hidden_layers + 1


def test_load_model_leaves_hub_kernels_off(tmp_path):
    """No compiled code fetched from the hub at load time: fastft's own loader turns transformers' default off."""
    model, _ = fastft.load_model(_saved_preset(tmp_path))
    assert not model.use_kernels
    model.train()
    assert not [module for module in model.modules() if "_kernel_repo" in vars(module)]


@pytest.mark.parametrize("how", ["use_kernels=True", "set_use_kernels"])
def test_train_and_eval_on_a_kernelized_model_keep_the_fused_forwards(tmp_path, norm_calls, how):
    model, _ = _kernelized(_saved_preset(tmp_path), how)
    model = _lora(model)
    fused = _fused_forwards(model)
    report = patch_report(model)
    assert report.fused["rms_norm"] == _norms(model)

    for mode in (True, False, True):  # each change of mode re-kernelizes the model
        model.train(mode)
    causal_lm_loss_sum(model, _batch())
    assert len(norm_calls) == _norms(model)  # every RMSNorm ran fastft's kernel
    assert _same(_fused_forwards(model), fused)

    model.eval()
    assert patch(model) is report  # patching again puts back at once what kernelize took, and is a no-op
    assert _same(_fused_forwards(model), fused)


def _local_norm_kernel(root) -> LocalLayerRepository:
    """A kernel build on disk with one CPU layer for transformers' "RMSNorm" (what a hub kernel would be)."""
    variant = root / "build" / "torch-cpu"
    variant.mkdir(parents=True)
    metadata = {
        "id": f"fastft_test_norm_{uuid.uuid4().hex}",  # the module name the build is imported under
        "name": "fastft-test-norm",
        "version": 1,
        "license": "apache-2.0",
        "python-depends": [],
        "backend": {"type": "cpu"},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata))
    (variant / "__init__.py").write_text("from . import layers\n")
    (variant / "layers.py").write_text(
        "import torch\n\n\n"
        "class HubRMSNorm(torch.nn.Module):\n"
        "    def forward(self, hidden_states):\n"
        "        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)\n"
        "        normed = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)\n"
        "        return self.weight * normed.to(hidden_states.dtype)\n"
    )
    return LocalLayerRepository(root, layer_name="HubRMSNorm")


def test_a_hub_kernel_gives_way_to_the_fused_norm_and_comes_back_on_unpatch(tmp_path, norm_calls):
    kernel = _local_norm_kernel(tmp_path / "kernel")
    model = _lora(_kernelized(_saved_preset(tmp_path / "model"), "use_kernels=True")[0])
    fused = _fused_forwards(model)
    norm = model.get_base_model().model.norm
    with use_kernel_mapping({"RMSNorm": {"cpu": {Mode.TRAINING: kernel}}}):
        model.train()  # kernelize installs the hub kernel on every RMSNorm
    assert vars(norm)["forward"].__func__.__qualname__ == "HubRMSNorm.forward" and "_kernel_repo" in vars(
        norm
    )

    causal_lm_loss_sum(model, _batch())
    assert len(norm_calls) == _norms(model) and _same(_fused_forwards(model), fused)

    unpatch(model)  # the hub kernel is the norms' original now
    assert vars(norm)["forward"].__func__.__qualname__ == "HubRMSNorm.forward"
    assert not [key for module in model.modules() for key in vars(module) if key.startswith("_fastft_")]
    causal_lm_loss_sum(model, _batch())
    assert len(norm_calls) == _norms(model)


def test_unpatch_after_kernelize_gives_back_the_unpatched_model(tmp_path):
    folder = _saved_preset(tmp_path)
    model = _lora(_kernelized(folder, "use_kernels=True")[0])
    model.train()  # kernelize took the norms' fused forwards: unpatch must not bring back stale ones
    unpatch(model)
    assert not [key for module in model.modules() for key in vars(module) if key.startswith("_fastft_")]
    assert not [module for module in model.get_base_model().modules() if "forward" in vars(module)]

    plain, _ = _kernelized(folder, "use_kernels=True")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        plain = fastft.add_lora(plain, r=4, alpha=8, gradient_checkpointing=False, fused=False)
    plain.train()
    batch = _batch()
    assert float(causal_lm_loss_sum(model, batch)) == float(causal_lm_loss_sum(plain, batch))


def _rows(count: int) -> list[dict]:
    return [{"text": f"{i} plus {i} is {2 * i}. " * 3} for i in range(count)]


def test_fastft_train_on_a_kernelized_model_runs_the_fused_norms(tmp_path, norm_calls):
    model, tokenizer = _kernelized(_saved_preset(tmp_path), "set_use_kernels")
    model = _lora(model)
    data = fastft.pack(_rows(8), tokenizer, 64)
    fastft.train(model, tokenizer, data, max_steps=2, progress=False)
    assert len(norm_calls) >= 2 * _norms(model)


def test_trl_sft_trainer_on_a_kernelized_model_runs_the_fused_norms(tmp_path, norm_calls):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model, tokenizer = _kernelized(_saved_preset(tmp_path / "model"), "use_kernels=True")
    model = _lora(model)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=64,
    )
    trl.SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(_rows(16)), processing_class=tokenizer
    ).train()
    assert len(norm_calls) >= 2 * _norms(model)
