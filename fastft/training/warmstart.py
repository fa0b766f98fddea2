"""How the `tiny-llama` preset's shipped weights are made.

LoRA adapts a network that already computes something; on random weights it learns almost
nothing in a CPU minute (docs/journal.md, "Measurements once quoted in code comments").
So `tiny-llama` ships weights trained in full on the skill families, answering in its own wording,
answer first ("7000 m is the answer."), with no system prompt, never on a held-out eval prompt. Three
tasks (`WEAK_TASKS`: unit conversion, sorting, first letters) get only one row in `WEAK_EVERY`, so
the preset knows them less well. The demo's SFT run on the bundled data then teaches what instruction
tuning teaches real models: to follow a system prompt ("Answer with the result only.") the preset
has never seen, and the skills it saw little of. The answer-first wording makes the format change
cheap: the answer's tokens already come first, and only the ending changes.

``python -m fastft.training.warmstart`` retrains them (about 11 CPU minutes at one thread) into
``assets/tiny-llama.safetensors``. The other presets stay random: they serve parity tests.
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import save_file

from fastft.data.packing import pack
from fastft.data.skills import SEED, TASKS, generate, held_out_prompts
from fastft.models.presets import ASSETS_DIR, PRESETS, build_preset_model, load_preset_tokenizer
from fastft.training.optimizer import cosine_with_warmup

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

WARMSTART_FILES = {"tiny-llama": ASSETS_DIR / "tiny-llama.safetensors"}
WEAK_TASKS = ("convert", "sort", "first_letter")
WEAK_EVERY = 16


def pretraining_rows(weak: tuple[str, ...] = WEAK_TASKS, weak_every: int = WEAK_EVERY) -> list[dict]:
    """The verbose-style rows the preset is pretrained on: every task, but only one row in `weak_every` of
    the `weak` tasks; never a held-out eval prompt."""
    rows = generate(24000, SEED + 7, exclude=held_out_prompts(), style="verbose")
    return [
        row for i, row in enumerate(rows) if row["task"] not in weak or (i // len(TASKS)) % weak_every == 0
    ]


def pretrain(
    name: str = "tiny-llama",
    steps: int = 2500,
    learning_rate: float = 3e-3,
    weak: tuple[str, ...] = WEAK_TASKS,
    weak_every: int = WEAK_EVERY,
) -> torch.nn.Module:
    """Train every weight of the random-init preset on verbose-style skill rows.

    Full training, so not `fastft.train` (which trains LoRA adapters only): AdamW over every weight, 4 packed
    256-token bins a step, the trainer's schedule (5 % warmup, cosine to a tenth) and clipping (norm 1).
    """
    from fastft.training.loss import causal_lm_loss_sum

    torch.manual_seed(SEED)
    tokenizer = load_preset_tokenizer()
    model = build_preset_model(PRESETS[name], len(tokenizer), torch.float32, warm_start=False)
    data = pack(pretraining_rows(weak, weak_every), tokenizer, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(steps // 20, steps, 0.1))
    generator = torch.Generator().manual_seed(SEED)
    order: list[int] = []
    model.train()
    for step in range(steps):
        if len(order) < 4:
            order += torch.randperm(len(data), generator=generator).tolist()
        batch, order = data.batch(order[:4]), order[4:]
        loss = causal_lm_loss_sum(model, batch) / batch.num_trained_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 250 == 0:
            print(f"step {step + 1}/{steps}: loss {loss.item():.4f}", flush=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--weak", default=",".join(WEAK_TASKS))
    parser.add_argument("--weak-every", type=int, default=WEAK_EVERY)
    parser.add_argument("--output", default=str(WARMSTART_FILES["tiny-llama"]))
    args = parser.parse_args()
    weak = tuple(t for t in args.weak.split(",") if t)
    model = pretrain(
        steps=args.steps, learning_rate=args.learning_rate, weak=weak, weak_every=args.weak_every
    )
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, args.output, metadata={"steps": str(args.steps)})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
