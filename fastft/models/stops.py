"""The tokens that end a model's answer."""

from __future__ import annotations


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends an answer, the tokenizer's EOS first, then each EOS id of the model's generation
    config: Gemma 3 stops at ``<end_of_turn>`` as well as at its tokenizer's ``<eos>``, Llama 3 at
    ``<|eot_id|>`` as well as ``<|end_of_text|>``. [] when neither names one."""
    ids: list[int] = []
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, *(extra if isinstance(extra, (list, tuple)) else [extra])):
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids
