"""Right-padded training batches run unpadded: the real tokens of a ``[B, L]`` batch (TRL's trainers without
packing, the HF Trainer, Unsloth's notebooks) become one packed row ``[1, T]``, each batch row a sequence at its
own positions, so padding takes no compute in any layer and no ``[B, 1, L, L]`` mask is built; the decoder's
output goes back into its padded rows after. `fastft.runtime.attention`'s decoder hooks call `takes_padded_batch`
and `unpad` before the first layer and `repad` after the last, and hand the batch to the packed attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastft.data.batch import PackedBatch

# Decoder keywords an unpadded training forward understands; any other (token types, a cache position, router
# logits, attention weights asked for) leaves the padded batch to transformers.
_UNPADDED_KEYWORDS = frozenset(
    {"input_ids", "inputs_embeds", "attention_mask", "use_cache", "output_hidden_states", "return_dict"}
)
_UNPADDED = "unpadded_rows"  # the `PackedBatch` artefact that tells `repad` where each token came from


def takes_padded_batch(decoder: torch.nn.Module, kwargs: dict) -> bool:
    """Whether this decoder call is a padded training batch the packed attention takes (`unpad`): a 2-D
    attention mask (Hugging Face's padded batches: TRL's trainers without packing, the HF Trainer), in
    training, no cache, no position ids of the caller's, and no keyword beyond `_UNPADDED_KEYWORDS` set."""
    mask = kwargs.get("attention_mask")
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not (
        decoder.training
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and tokens is not None
        and tuple(tokens.shape[:2]) == tuple(mask.shape)
        and not kwargs.get("use_cache")
        and kwargs.get("return_dict") is not False
        and all(key in _UNPADDED_KEYWORDS or value is None or value is False for key, value in kwargs.items())
    ):
        return False
    # the packed backends count a sliding window along each row's kept tokens, transformers along the row:
    # the same wherever no row is longer than the window
    window = getattr(decoder.config, "sliding_window", None)
    if window and mask.shape[1] > window:
        return False
    # NEFTune (the trainers' neftune_noise_alpha) scales its noise by the embeddings' sequence length
    embeddings = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    hooks = getattr(embeddings, "_forward_hooks", {}).values()
    return not any("neftune" in getattr(hook, "__name__", "") for hook in hooks)


def unpad(kwargs: dict) -> tuple[PackedBatch, dict] | None:
    """A right-padded batch ``[B, L]`` (TRL's and the HF collators' padding side) run as one packed row of its
    real tokens ``[1, T]``, each row a sequence: the `PackedBatch` and the decoder's keywords with the packed
    tokens and positions (None: the batch stays on transformers' path).

    Each real token attends causally to the row's tokens before it, at positions ``0 .. n-1`` (as
    transformers gives a padded batch): exactly what transformers computes for the real tokens. Padding
    takes no compute in any layer, no ``[B, 1, L, L]`` mask is built, and attention runs on the packed
    backend (FlashAttention-2 varlen on CUDA). `repad` puts the decoder's output back into ``[B, L, ...]``,
    zero at the padding, where transformers leaves values that only a label on a padding position reads
    (the collators put -100 there). Left padding and masks with holes go to transformers: there the
    position before a row's first real token predicts it, from a padding position. The one host sync: the
    rows' lengths (the packed row's size) and whether every row is right-padded, read together, where
    transformers' mask builder synced twice."""
    mask = kwargs["attention_mask"]
    rows, length = mask.shape
    keep = (mask != 0).to(torch.uint8)
    lengths = keep.sum(1)
    right_padded = (keep[:, 1:] <= keep[:, :-1]).all().view(1)  # every row: ones, then zeros
    *host, right = torch.cat((lengths, right_padded.to(lengths.dtype))).tolist()  # the one sync
    tokens = sum(host)
    if not right or min(host) == 0:  # an empty row is no sequence: transformers' path
        return None
    keep = keep.reshape(-1)
    # the kept tokens' indices in order, with no sync (a stable sort puts every kept token first)
    index = torch.argsort(1 - keep, stable=True)[:tokens]
    device = mask.device
    positions = torch.arange(length, device=device).repeat(rows).index_select(0, index).view(1, tokens)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    input_ids = kwargs.get("input_ids")
    batch = PackedBatch(
        input_ids=positions
        if input_ids is None
        else input_ids.reshape(-1).index_select(0, index).view(1, -1),
        labels=torch.full((1, tokens), -100, dtype=torch.int64, device=device),
        position_ids=positions,
        cu_seqlens=F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)),
        target_positions=empty,
        target_ids=empty,
        max_seqlen=max(host),
        num_sequences=rows,
        num_tokens=tokens,
        num_trained_tokens=0,
        sequence_lengths=tuple(host),
    )
    batch.artifact(_UNPADDED, lambda: (index, rows, length))
    kwargs = dict(kwargs, position_ids=positions)
    if input_ids is not None:
        kwargs["input_ids"] = batch.input_ids
    else:
        embeds = kwargs["inputs_embeds"]
        kwargs["inputs_embeds"] = embeds.reshape(rows * length, -1).index_select(0, index).unsqueeze(0)
    return batch, kwargs


def repad(decoder: torch.nn.Module, args: tuple, kwargs: dict, output):
    """The decoder's output of an unpadded batch (`unpad`) back in its padded rows: the last hidden state
    (and every layer's, when asked for) ``[1, T, H] -> [B, L, H]``, zero at the padding."""
    batch = kwargs.get("fastft_batch")
    if batch is None or _UNPADDED not in batch._artifacts:
        return None
    index, rows, length = batch.artifact(_UNPADDED, lambda: None)

    def into_rows(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.new_zeros(rows * length, hidden.shape[-1])
        return flat.index_copy(0, index, hidden.reshape(-1, hidden.shape[-1])).view(rows, length, -1)

    output.last_hidden_state = into_rows(output.last_hidden_state)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(into_rows(hidden) for hidden in output.hidden_states)
    return output
