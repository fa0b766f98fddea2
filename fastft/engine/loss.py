"""The training loss of a packed batch: summed next-token cross-entropy over trained tokens.

Only the positions whose next token is trained reach the output head (``logits_to_keep`` with
the batch's precomputed `target_positions`), so prompt tokens cost no vocabulary matmul. The
sum is divided by the step's trained-token count by the caller, which makes gradient
accumulation token-weighted: a step's loss does not depend on how its tokens were split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastft.data.batch import PackedBatch
from fastft.engine.attention import choose_backend, is_patched
from fastft.models.patch import is_fused


def _marker(batch: PackedBatch) -> torch.Tensor:
    # A 4-D attention mask makes transformers skip its own mask building (and its packed-sequence
    # detection, a host sync); fastft's packed attention reads the PackedBatch instead.
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=batch.device)


def causal_lm_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Sum of cross-entropy (fp32) over the batch's trained tokens; a scalar on the model's device.

    A model switched to packed attention (`fastft.engine.attention.patch_packed_attention`) gets the
    batch itself, so every layer reads its boundaries; any other model gets ``position_ids`` and
    transformers finds the boundaries itself.
    """
    packed = {}
    if is_patched(model):
        choose_backend(model, batch)
        packed = {
            "fastft_batch": batch,
            "attention_mask": batch.artifact("mask_marker", lambda: _marker(batch)),
        }
    if is_fused(model):
        loss = _fused_loss_sum(model, batch, packed)
        if loss is not None:
            return loss
    output = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=batch.target_positions,
        **packed,
    )
    logits = output.logits[0]
    return F.cross_entropy(logits.float(), batch.target_ids, reduction="sum")


def _fused_loss_sum(model: torch.nn.Module, batch: PackedBatch, packed: dict) -> torch.Tensor | None:
    """The decoder's hidden states at the trained positions, then fused linear cross-entropy over the
    output head: the ``[tokens, vocab]`` logits never exist. None when the head is not a plain linear
    layer (the caller then takes the eager path)."""
    from peft import PeftModel

    from fastft.kernels.fused_linear_ce import fused_linear_cross_entropy

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or not hasattr(base, "get_decoder"):
        return None
    output = base.get_decoder()(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **packed
    )
    hidden = output[0][0].index_select(0, batch.target_positions)
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return fused_linear_cross_entropy(
        hidden, head.weight, batch.target_ids, bias=head.bias, softcap=softcap, reduction="sum"
    )
