"""The competitors' models for the benches (each built in its own worker process: Liger and Unsloth patch
transformers' classes globally): transformers + PEFT (optionally with Liger's kernels) and Unsloth. Nothing
in fastft's engine imports this module; the libraries are imported when a model is built."""

from __future__ import annotations

import time

import torch

from fastft.bench.harness import ATTENTION_TARGETS, EXPERT_PARAMETERS, TARGETS
from fastft.models.remote_code import from_pretrained

# Function-local imports: transformers, peft, TRL and the engine load where used: a bench's Unsloth worker imports
# this module and must import unsloth before them (torch may come first; tests/tools/test_bench.py checks it); peft
# imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora); Unsloth is a competitor the benches load only in
# its own worker.


def hf_model(folder: str, precision: str, liger: bool, device, lora_targets: str = "all"):
    """transformers + PEFT from `folder` (SDPA attention, NF4 through bitsandbytes for "nf4", Liger's kernels
    patched in with `liger`), LoRA r=16 on `lora_targets`, non-reentrant gradient checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    quantization = None
    if precision == "nf4":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = from_pretrained(
        AutoModelForCausalLM,
        folder,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device_map=device.type,
        attn_implementation="sdpa",
        quantization_config=quantization,
    )
    linears = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    moe = any(hasattr(m, "gate_up_proj") for m in model.modules())
    wanted = ATTENTION_TARGETS if lora_targets == "attention" else TARGETS
    config = LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=[name for name in wanted if name in linears],
        target_parameters=EXPERT_PARAMETERS if moe and lora_targets == "all" else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def unsloth_model(folder: str, precision: str, seq: int, lora_targets: str = "all"):
    """Unsloth's ``FastLanguageModel`` from `folder`, LoRA r=16, its own gradient checkpointing."""
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        folder, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=precision == "nf4"
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        # on an MoE model Unsloth maps gate/up/down onto the experts' stacked weights itself
        target_modules=ATTENTION_TARGETS if lora_targets == "attention" else TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    return model


def trl_run_settings(cuda: bool) -> dict:
    """The TRL trainer settings every TRL baseline shares: log each step, report and save nothing, no data
    loader workers, bf16 on CUDA (the CPU in fp32)."""
    return dict(
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )


def step_clock(device):
    """A transformers `TrainerCallback` whose ``marks`` hold the wall time at each step's end, after a CUDA
    sync on `device` (so every step's host stalls count)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, train_args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.marks.append(time.perf_counter())

    return StepClock()
