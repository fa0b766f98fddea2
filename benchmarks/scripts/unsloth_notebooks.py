"""Three of Unsloth's official notebooks, their call sequence run by Unsloth and by fastft's drop-in layer.

The notebooks (unslothai/notebooks, nb/ and python_scripts/), their calls and arguments as they stand, with
only the import module switched (``unsloth`` or ``fastft.unsloth``), the hub model replaced by a folder of
the same architecture with random weights, the hub data set by a local file of realistic rows, and the
steps cut to ``--steps``:

* ``llama31-alpaca`` -- Llama3.1_(8B)-Alpaca: Llama-3.1-8B in 4-bit, LoRA r=16 on the seven projections,
  the Alpaca prompt with EOS, ``SFTTrainer(tokenizer=, dataset_text_field="text", max_seq_length=2048,
  packing=False)``, batch 2 x 4 accumulated, AdamW 8-bit, lr 2e-4.
* ``qwen3-chat`` -- Qwen3_(4B)-Instruct: Qwen3-4B in 4-bit, r=32, ``get_chat_template("qwen3-instruct")``,
  ``standardize_data_formats`` on ShareGPT rows, then ``train_on_responses_only`` with the ChatML markers.
* ``zephyr-dpo`` -- Zephyr_(7B)-DPO: ``PatchDPOTrainer()``, a Mistral-7B in 4-bit, r=64, the alignment
  handbook's prompt / chosen / rejected strings, ``DPOTrainer(ref_model=None, beta=0.1, max_length=1024,
  max_prompt_length=512, tokenizer=)``, lr 5e-6 with ``warmup_ratio=0.1``. (GRPO is not timed here: Unsloth
  generates with vLLM, fastft with its own engine, so a step's time would compare two generators.)

The weights are saved once per architecture (``--folder``; a tiny preset's with ``--tiny``) and each system
loads them from there in its own process (Unsloth patches transformers and TRL globally), with the same
data, seeds and arguments. Each process logs the loss of every step, the wall time of every step (CUDA
synchronised at each step's end), the tokens each step trained on (non-padding tokens of its batches) and
the peak of ``torch.cuda.max_memory_allocated``.

The comparison (``notebooks.md``) judges the loss curves: the first step's loss is computed from the same
weights on the same batches (LoRA's B starts at zero), so the two systems differ there only by rounding:
bf16 keeps 8 significant bits (a relative step of 2^-8 = 0.39 %), and a loss summed over a few thousand
tokens through 32 layers of such roundings stays within about 1 %; the later steps add the two optimisers'
own rounding of the same updates, allowed 2 % per step. Speed: fastft's tokens per second over Unsloth's,
on the steps after ``--warmup``.

    python benchmarks/scripts/unsloth_notebooks.py --systems unsloth,fastft --steps 12 --out /tmp/nb \
        --unsloth-path /tmp/site_unsloth
    python benchmarks/scripts/unsloth_notebooks.py --tiny --systems fastft --steps 2 --device cpu  # CPU test
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

MODULES = {"unsloth": "unsloth", "fastft": "fastft.unsloth"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NOTEBOOKS = {
    "llama31-alpaca": {
        "notebook": "nb/Llama3.1_(8B)-Alpaca.ipynb",
        "model": "meta-llama/Llama-3.1-8B",
        "tiny": "tiny-llama",
        "max_seq_length": 2048,
        "r": 16,
    },
    "qwen3-chat": {
        "notebook": "nb/Qwen3_(4B)-Instruct.ipynb",
        "model": "Qwen/Qwen3-4B",  # the architecture of Qwen3-4B-Instruct-2507
        "tiny": "tiny-qwen3",
        "max_seq_length": 2048,
        "r": 32,
    },
    "zephyr-dpo": {
        "notebook": "nb/Zephyr_(7B)-DPO.ipynb",
        "model": "mistralai/Mistral-7B-v0.3",  # zephyr-sft is a Mistral-7B (v0.1: 32,000 tokens, v0.3: 32,768)
        "tiny": "tiny-mistral",
        "max_seq_length": 4096,
        "r": 64,
    },
}
# the zephyr-sft tokenizer's chat template (what the DPO notebook's formatting reads)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
ALPACA = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n"
    "### Response:\n{}"
)
FIRST_STEP_TOLERANCE = 0.01  # relative; see the module docstring
STEP_TOLERANCE = 0.02


# ----------------------------------------------------------------------------------------------------- data


def _words() -> list[str]:
    """English prose to draw rows from: this repository's README and design notes."""
    root = Path(__file__).resolve().parents[2]
    text = " ".join((root / name).read_text(encoding="utf-8") for name in ("README.md", "docs/DESIGN.md"))
    return [w for w in text.split() if w.isascii() and not w.startswith(("|", "`", "#", "http"))]


def write_rows(kind: str, path: Path, rows: int, tokens_per_word: float, scale: float, seed: int = 0) -> None:
    """`rows` rows of the notebook's hub data set's columns, as JSON lines, with log-normal lengths (in
    tokens of the real models' tokenizers, ~1.3 per word, converted to words of this tokenizer's ratio):
    Alpaca (instruction 20, input 30 in 40 % of rows, output 150), FineTome (1-3 turns, 80 / 300),
    UltraFeedback (prompt 100, chosen and rejected answers 250)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = _words()

    def text(median_tokens: float) -> str:
        count = max(1, int(rng.lognormal(math.log(median_tokens * scale / tokens_per_word), 0.7)))
        start = int(rng.integers(0, len(words) - count - 1))
        return " ".join(words[start : start + count])

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            if kind == "llama31-alpaca":
                row = {
                    "instruction": text(20),
                    "input": text(30) if rng.random() < 0.4 else "",
                    "output": text(150),
                }
            elif kind == "qwen3-chat":
                turns = []
                for _ in range(int(rng.integers(1, 4))):
                    turns += [{"from": "human", "value": text(80)}, {"from": "gpt", "value": text(300)}]
                row = {"conversations": turns, "source": "local", "score": 5.0}
            else:
                prompt = text(100)
                row = {
                    "prompt": prompt,
                    "chosen": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": text(250)},
                    ],
                    "rejected": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": text(250)},
                    ],
                }
            f.write(json.dumps(row) + "\n")


def prepare(args, name: str) -> tuple[Path, Path]:
    """The notebook's model folder and data file (written once, read by every system)."""
    root = Path(args.folder)
    spec = NOTEBOOKS[name]
    model_id = spec["tiny"] if args.tiny else spec["model"]
    folder = root / f"{name}-{model_id.replace('/', '--')}"
    tokenizer = _tokenizer(name, spec["tiny"])
    if not (folder / "config.json").exists():
        print(f"saving random-weight {model_id} to {folder} ...", file=sys.stderr, flush=True)
        _save_weights(model_id, folder, args.tiny)
        tokenizer.save_pretrained(folder)  # the family's tokenizer and chat template
    data = root / f"{name}-rows.jsonl"
    ratio = len(tokenizer(" ".join(_words()[:2000]))["input_ids"]) / 2000
    write_rows(name, data, args.rows, ratio, args.length_scale)
    return folder, data


def _tokenizer(name: str, preset: str):
    from fastft.models.presets import load_preset_tokenizer

    tokenizer = load_preset_tokenizer(preset)
    if name == "zephyr-dpo":
        tokenizer.chat_template = ZEPHYR_TEMPLATE
    return tokenizer


def _save_weights(model_id: str, folder: Path, tiny: bool) -> None:
    if tiny:
        from fastft.models.loading import load_model

        model, _ = load_model(model_id)
        model.save_pretrained(folder, safe_serialization=True)
        return
    import torch

    from fastft.bench.harness import save_random_checkpoint

    save_random_checkpoint(model_id, folder)
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- worker


def _batch_tokens(batch) -> tuple[int, int | None]:
    """(non-padding tokens, trained tokens or None) of one collated batch, whatever its keys."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask") and hasattr(v, "sum")]
    ids = [v for k, v in batch.items() if k.endswith("input_ids") and hasattr(v, "numel")]
    tokens = sum(int(m.sum()) for m in masks) if masks else sum(int(i.numel()) for i in ids)
    if "labels" in batch:
        trained = int((batch["labels"][..., 1:] != -100).sum())
    elif "completion_mask" in batch:
        trained = int(batch["completion_mask"].sum())
    else:
        trained = None
    return tokens, trained


def _sft_alpaca(mod, model, tokenizer, dataset, args):
    from trl import SFTConfig, SFTTrainer

    eos = tokenizer.eos_token

    def formatting(examples):
        return {
            "text": [
                ALPACA.format(i, x, o) + eos
                for i, x, o in zip(
                    examples["instruction"], examples["input"], examples["output"], strict=True
                )
            ]
        }

    dataset = dataset.map(formatting, batched=True)
    return SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=NOTEBOOKS["llama31-alpaca"]["max_seq_length"],
        packing=False,
        args=SFTConfig(
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            warmup_steps=5,
            max_steps=args.steps,
            learning_rate=2e-4,
            logging_steps=1,
            optim="adamw_8bit",
            weight_decay=0.01,
            lr_scheduler_type="linear",
            seed=3407,
            output_dir=args.scratch,
            report_to="none",
        ),
    )


def _sft_chat(mod, model, tokenizer, dataset, args):
    from trl import SFTConfig, SFTTrainer

    templates = importlib.import_module(MODULES[args.system] + ".chat_templates")
    tokenizer = templates.get_chat_template(tokenizer, chat_template="qwen3-instruct")
    dataset = templates.standardize_data_formats(dataset)

    def formatting(examples):
        return {
            "text": [
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                for c in examples["conversations"]
            ]
        }

    dataset = dataset.map(formatting, batched=True)
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        eval_dataset=None,
        args=SFTConfig(
            dataset_text_field="text",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            warmup_steps=5,
            max_steps=args.steps,
            learning_rate=2e-4,
            logging_steps=1,
            optim="adamw_8bit",
            weight_decay=0.001,
            lr_scheduler_type="linear",
            seed=3407,
            output_dir=args.scratch,
            report_to="none",
        ),
    )
    return templates.train_on_responses_only(
        trainer, instruction_part="<|im_start|>user\n", response_part="<|im_start|>assistant\n"
    )


def _dpo(mod, model, tokenizer, dataset, args):
    from trl import DPOConfig, DPOTrainer

    prefix = "<|assistant|>\n"

    def formatting(row):  # the alignment handbook's "dpo" task: an empty system turn, answers without prefix
        prompt = [{"role": "system", "content": ""}, row["chosen"][0]]
        answers = {
            key: tokenizer.apply_chat_template(row[key][1:], tokenize=False).removeprefix(prefix)
            for key in ("chosen", "rejected")
        }
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return {"prompt": text, **answers}

    dataset = dataset.map(formatting, remove_columns=dataset.column_names)
    return DPOTrainer(
        model=model,
        ref_model=None,
        args=DPOConfig(
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            warmup_ratio=0.1,
            max_steps=args.steps,
            learning_rate=5e-6,
            logging_steps=1,
            optim="adamw_8bit",
            weight_decay=0.0,
            lr_scheduler_type="linear",
            seed=42,
            output_dir=args.scratch,
            report_to="none",
        ),
        beta=0.1,
        train_dataset=dataset,
        tokenizer=tokenizer,
        max_length=1024,
        max_prompt_length=512,
    )


BUILDERS = {"llama31-alpaca": _sft_alpaca, "qwen3-chat": _sft_chat, "zephyr-dpo": _dpo}


def _perturb_lora_a(model) -> None:
    """Each LoRA A entry times 1 +- 2^-8 (signs from a fixed seed): one bf16 rounding's worth of difference in
    the starting point, the same for both systems, so a run beside its perturbed twin shows how far bf16 noise
    alone moves the curve."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_A" in name:
                signs = torch.randint(0, 2, weight.shape, generator=generator).to(weight.device) * 2 - 1
                weight.mul_(1 + signs.to(weight.dtype) * 2**-8)


def run_worker(args) -> dict:
    if args.system == "unsloth":
        import unsloth  # noqa: F401 - first, so it patches transformers and TRL before they load
    mod = importlib.import_module(MODULES[args.system])
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback

    spec = NOTEBOOKS[args.notebook]
    cuda = torch.cuda.is_available() and args.device == "cuda"
    if args.notebook == "zephyr-dpo":
        mod.PatchDPOTrainer()
    started = time.perf_counter()
    extra = (
        {"load_in_8bit": False, "full_finetuning": False}
        if args.notebook == "qwen3-chat"
        else {"dtype": None}
    )
    model, tokenizer = mod.FastLanguageModel.from_pretrained(
        model_name=args.model_folder, max_seq_length=spec["max_seq_length"], load_in_4bit=True, **extra
    )
    model = mod.FastLanguageModel.get_peft_model(
        model,
        r=spec["r"],
        target_modules=TARGETS,
        lora_alpha=spec["r"],
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
    )
    if args.perturb:
        _perturb_lora_a(model)
    load_seconds = time.perf_counter() - started
    dataset = load_dataset("json", data_files=args.data, split="train")
    trainer = BUILDERS[args.notebook](mod, model, tokenizer, dataset, args)

    counts: list[tuple[int, int | None]] = []
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        counts.append(_batch_tokens(batch))
        return batch

    trainer.data_collator = counting  # after train_on_responses_only, which may set its own collator

    class Log(TrainerCallback):
        def __init__(self):
            self.ends, self.losses, self.tokens, self.trained, self.seen = [], {}, [], [], 0

        def on_step_end(self, train_args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            step = counts[self.seen :]
            self.seen = len(counts)
            self.tokens.append(sum(t for t, _ in step))
            trained = [t for _, t in step]
            self.trained.append(None if any(t is None for t in trained) else sum(trained))

        def on_log(self, train_args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

    log = Log()
    trainer.add_callback(log)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    trainer.train()
    marks = [begin, *log.ends]
    step_seconds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    timed = slice(min(args.warmup, len(step_seconds) - 1), None)
    seconds = sum(step_seconds[timed])
    return {
        "system": args.system,
        "notebook": args.notebook,
        "losses": [log.losses.get(step) for step in range(1, len(step_seconds) + 1)],
        "step_seconds": step_seconds,
        "tokens": log.tokens,
        "trained_tokens": log.trained,
        "tokens_per_s": sum(log.tokens[timed]) / seconds if seconds else None,
        "median_step_s": statistics.median(step_seconds[timed]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "load_s": load_seconds,
        "timed_steps": len(step_seconds[timed]),
    }


# --------------------------------------------------------------------------------------------------- driver


def compare(results: list[dict]) -> list[dict]:
    """Per notebook: the loss curves side by side, the verdict, and fastft's speed over Unsloth's."""
    rows = []
    for name in dict.fromkeys(r["notebook"] for r in results):
        by = {r["system"]: r for r in results if r["notebook"] == name}
        ours, theirs = by.get("fastft"), by.get("unsloth")
        row = {"notebook": name}
        for system, result in by.items():
            row[f"{system}_error"] = result.get("error")
        if ours and theirs and "error" not in ours and "error" not in theirs:
            pairs = [(a, b) for a, b in zip(ours["losses"], theirs["losses"], strict=False) if a and b]
            relative = [abs(a - b) / abs(b) for a, b in pairs]
            row.update(
                steps=len(pairs),
                first_step_relative=relative[0] if relative else None,
                max_step_relative=max(relative) if relative else None,
                same_curve=bool(relative)
                and relative[0] <= FIRST_STEP_TOLERANCE
                and max(relative) <= STEP_TOLERANCE
                and len(ours["losses"]) == len(theirs["losses"]),
                speed_ratio=ours["tokens_per_s"] / theirs["tokens_per_s"],
                peak_ratio=(ours["peak_gib"] / theirs["peak_gib"])
                if ours["peak_gib"] and theirs["peak_gib"]
                else None,
            )
        rows.append(row)
    return rows


def markdown(results: list[dict], rows: list[dict]) -> str:
    lines = [
        "| notebook | system | tokens/s | median step s | peak GiB | losses |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['notebook']} | {r['system']} | – | – | – | error: {r['error'][:200]} |")
            continue
        losses = ", ".join(f"{x:.4f}" if x is not None else "–" for x in r["losses"])
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] else "–"
        lines.append(
            f"| {r['notebook']} | {r['system']} | {r['tokens_per_s']:,.0f} | {r['median_step_s']:.3f} | {peak} | {losses} |"
        )
    lines += [
        "",
        f"Same curve: first step within {FIRST_STEP_TOLERANCE:.0%} and every step within {STEP_TOLERANCE:.0%} "
        "(relative); speed: fastft's tokens/s over Unsloth's.",
        "",
        "| notebook | steps | first step Δ | max step Δ | same curve | fastft / Unsloth speed | peak ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "speed_ratio" not in row:
            lines.append(f"| {row['notebook']} | – | – | – | not compared | – | – |")
            continue
        peak = f"{row['peak_ratio']:.2f}" if row["peak_ratio"] else "–"
        lines.append(
            f"| {row['notebook']} | {row['steps']} | {row['first_step_relative']:.2%} | "
            f"{row['max_step_relative']:.2%} | {'yes' if row['same_curve'] else 'NO'} | "
            f"{row['speed_ratio']:.2f}x | {peak} |"
        )
    return "\n".join(lines) + "\n"


def _write(out: Path, args, results: list[dict]) -> str:
    from fastft.bench.common import environment

    rows = compare(results)
    settings = {
        k: getattr(args, k)
        for k in ("notebooks", "systems", "steps", "warmup", "rows", "length_scale", "tiny")
    }
    payload = {"benchmark": "unsloth-notebooks", "settings": settings, "environment": environment()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "notebooks.json").write_text(
        json.dumps({**payload, "results": results, "comparison": rows}, indent=2)
    )
    table = markdown(results, rows)
    (out / "notebooks.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", default=",".join(NOTEBOOKS), help=f"from {','.join(NOTEBOOKS)}")
    parser.add_argument("--systems", default="unsloth,fastft", help="unsloth and/or fastft")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (the notebooks' max_steps)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the speed (compilation)")
    parser.add_argument("--rows", type=int, default=400, help="rows of each local data set")
    parser.add_argument("--length-scale", type=float, default=1.0, help="scales every row's length")
    parser.add_argument("--tiny", action="store_true", help="the tiny presets of the families (a CPU test)")
    parser.add_argument("--folder", default="/dev/shm/fastft-notebooks", help="weights and data")
    parser.add_argument("--out", default="benchmarks/unsloth_notebooks")
    parser.add_argument(
        "--unsloth-path", default=None, help="site folder put first on PYTHONPATH for Unsloth"
    )
    parser.add_argument("--timeout", type=float, default=240, help="seconds per notebook and system")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--remove-weights", action="store_true", help="delete each model folder after use")
    parser.add_argument(
        "--perturb", action="store_true", help="LoRA A times 1 +- 2^-8: a bf16-noise twin of the run"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--notebook", help=argparse.SUPPRESS)
    parser.add_argument("--model-folder", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default="/tmp/fastft-notebooks-run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0
    args.notebooks = [n.strip() for n in args.notebooks.split(",") if n.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in args.notebooks if n not in NOTEBOOKS] + [
        s for s in args.systems if s not in MODULES
    ]
    if unknown:
        parser.error(
            f"unknown notebooks or systems {unknown}: notebooks {list(NOTEBOOKS)}, systems {list(MODULES)}"
        )
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: no step would be timed")

    from fastft.bench.harness import worker_env

    results = []
    for name in args.notebooks:
        folder, data = prepare(args, name)
        for system in args.systems:
            argv_worker = [
                "--worker", "--system", system, "--notebook", name, "--model-folder", str(folder),
                "--data", str(data), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--device", args.device, "--scratch", f"{args.scratch}-{name}-{system}",
            ] + (["--perturb"] if args.perturb else [])  # fmt: skip
            env = worker_env(system, args.unsloth_path)
            if args.device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            started = time.perf_counter()
            result = _run_script(argv_worker, env, args.timeout)
            result.setdefault("system", system)
            result.setdefault("notebook", name)
            result["wall_s"] = time.perf_counter() - started
            results.append(result)
            _write(Path(args.out), args, results)  # a later timeout keeps what was measured
            summary = result.get("error") or (
                f"{result['tokens_per_s']:,.0f} tok/s, losses {[round(x, 4) for x in result['losses'] if x]}"
            )
            print(f"{name:>15} {system:>8}: {summary}", file=sys.stderr, flush=True)
        if args.remove_weights:  # the next architecture's weights need the room (/dev/shm)
            shutil.rmtree(folder, ignore_errors=True)
    print(_write(Path(args.out), args, results))
    return 0


def _run_script(argv: list[str], env: dict, timeout: float) -> dict:
    """This script as a worker in its own process; its last JSON line, or the error."""
    from fastft.bench.harness import run_command

    return run_command([sys.executable, os.path.abspath(__file__), *argv], env, timeout)


if __name__ == "__main__":
    sys.exit(main())
