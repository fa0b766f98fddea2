"""How the `tiny-llama` preset's shipped weights are made.

LoRA adapts a network that already computes something; on random weights it learns almost
nothing in a CPU minute (measured: loss 6.3 → 4.7 in 200 steps, where full training reaches 1.2).
So `tiny-llama` ships weights trained in full on every skill family, answering in a wordy style
("The answer is 7000 m.") with no system prompt, never on a held-out eval prompt. The demo's SFT
run on the bundled data then teaches it what instruction tuning teaches real models: to follow
the system prompt ("Answer with the result only."), which exact-match accuracy measures.

``python -m fastft.training.warmstart`` retrains them (a few minutes on two CPU cores) into
``assets/tiny-llama.safetensors``. The other presets stay random: they serve parity tests.
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import save_file

from fastft.data.skills import SEED, generate, held_out_prompts
from fastft.models.presets import ASSETS_DIR, PRESETS, build_preset_model, load_preset_tokenizer

WARMSTART_FILES = {"tiny-llama": ASSETS_DIR / "tiny-llama.safetensors"}


def pretrain(name: str = "tiny-llama", steps: int = 2500, learning_rate: float = 3e-3) -> torch.nn.Module:
    """Train every weight of the random-init preset on verbose-style skill rows."""
    from fastft.data.packing import pack
    from fastft.training.trainer import train

    tokenizer = load_preset_tokenizer()
    model = build_preset_model(PRESETS[name], len(tokenizer), torch.float32, warm_start=False)
    rows = list(generate(24000, SEED + 7, exclude=held_out_prompts(), style="verbose"))
    data = pack(rows, tokenizer, 256)
    train(model, tokenizer, data, max_steps=steps, learning_rate=learning_rate, micro_batch_bins=4, seed=SEED)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    args = parser.parse_args()
    model = pretrain(steps=args.steps, learning_rate=args.learning_rate)
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, WARMSTART_FILES["tiny-llama"], metadata={"steps": str(args.steps)})
    print(f"wrote {WARMSTART_FILES['tiny-llama']}")


if __name__ == "__main__":
    main()
