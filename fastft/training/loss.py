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
from fastft.models.moe import collect_moe_router_stats
from fastft.models.patch import is_fused
from fastft.runtime.attention import choose_backend, is_patched, mask_marker
from fastft.runtime.model_state import base_model
from fastft.runtime.routing import load_balancing_loss

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora); tests replace these names on their modules, so
# they are looked up when called.


def causal_lm_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Sum of cross-entropy (fp32) over the batch's trained tokens; a scalar on the model's device.

    A model switched to packed attention (`fastft.runtime.attention.patch_packed_attention`) gets the
    batch itself, so every layer reads its boundaries; any other model gets ``position_ids`` and
    transformers finds the boundaries itself. An MoE model whose config sets ``output_router_logits``
    adds, while training, its router load-balancing loss times ``router_aux_loss_coef`` per trained token.
    """
    coefficient = router_aux_loss_coefficient(model)
    if coefficient is not None:
        return _with_router_aux_loss(model, batch, coefficient)
    return _loss_sum(model, batch)


def _loss_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    return _target_losses(model, batch, "sum")


def target_losses(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Cross-entropy (fp32) of each trained target of the batch, ``[num_targets]`` in the order of
    ``batch.target_ids`` (0 at an ignored pad target); the same forward as `causal_lm_loss_sum`, with the
    fused head where the model has one (no ``[tokens, vocab]`` logits). Its negation is each target's
    log-probability (`fastft.training.objectives.preference` sums them per sequence)."""
    return _target_losses(model, batch, "none")


def _target_losses(model: torch.nn.Module, batch: PackedBatch, reduction: str) -> torch.Tensor:
    packed = {}
    if is_patched(model):
        choose_backend(model, batch)
        packed = {
            "fastft_batch": batch,
            "attention_mask": mask_marker(batch),
        }
    if _asks_for_router_logits(model):  # transformers' own aux loss would misread the packed mask marker
        packed["output_router_logits"] = False
    if is_fused(model):
        loss = _fused_loss_sum(model, batch, packed, reduction)
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
    return F.cross_entropy(logits.float(), batch.target_ids, reduction=reduction)


def _asks_for_router_logits(model: torch.nn.Module) -> bool:

    base = base_model(model)
    return bool(getattr(getattr(base, "config", None), "output_router_logits", False))


def router_aux_loss_coefficient(model: torch.nn.Module) -> float | None:
    """``router_aux_loss_coef`` when the model's config asks for the router's load-balancing loss
    (``output_router_logits``, transformers' switch) and the model is training; else None."""

    if not (model.training and _asks_for_router_logits(model)):
        return None
    base = base_model(model)
    # transformers' MoE heads copy the coefficient from the config at construction and read their copy
    return float(getattr(base, "router_aux_loss_coef", getattr(base.config, "router_aux_loss_coef", 0.0)))


def _with_router_aux_loss(model: torch.nn.Module, batch: PackedBatch, coefficient: float) -> torch.Tensor:
    """The summed cross-entropy plus ``coefficient * aux * trained tokens``: divided by the trained-token
    count (as the caller does) this is transformers' ``loss + router_aux_loss_coef * aux_loss``, with the
    load-balancing loss pooled over every MoE layer of this batch (`fastft.runtime.routing`)."""

    base = base_model(model)
    # under offloaded checkpointing each layer hands its statistics out as outputs of its autograd node
    # (`fastft.runtime.offload`), so the gradient reaches the routers in every checkpointing mode
    with collect_moe_router_stats(base) as stats:
        loss = _loss_sum(model, batch)
    aux = load_balancing_loss(stats) if stats else loss.new_zeros(())
    return loss + coefficient * batch.num_trained_tokens * aux


def _linear_head(head: torch.nn.Module | None) -> torch.nn.Linear | None:
    """The `nn.Linear` the output head's forward runs: the head itself, or, for a head trained whole
    (``add_lora(modules_to_save=["lm_head"])``), the module PEFT's wrapper would call (the active adapter's
    trained copy, or the original while adapters are disabled). None for any other head (eager path)."""
    if type(head) is torch.nn.Linear:
        return head
    copies = getattr(head, "modules_to_save", None)
    if copies is None or not hasattr(head, "original_module"):
        return None
    active = head.active_adapters
    if head.disable_adapters or not active or any(name not in copies for name in active):
        module = head.original_module
    elif len(active) == 1:
        module = copies[active[0]]
    else:
        return None
    return module if type(module) is torch.nn.Linear else None


def _fused_loss_sum(
    model: torch.nn.Module, batch: PackedBatch, packed: dict, reduction: str = "sum"
) -> torch.Tensor | None:
    """The decoder's hidden states at the trained positions, then fused linear cross-entropy over the
    output head: the ``[tokens, vocab]`` logits never exist. None when the head is not a plain linear
    layer (the caller then takes the eager path)."""

    from fastft.kernels.fused_linear_ce import fused_linear_cross_entropy

    base = base_model(model)
    head = _linear_head(base.get_output_embeddings())
    if head is None or not hasattr(base, "get_decoder"):
        return None
    output = base.get_decoder()(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **packed
    )
    hidden = output[0][0].index_select(0, batch.target_positions)
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return fused_linear_cross_entropy(
        hidden, head.weight, batch.target_ids, bias=head.bias, softcap=softcap, reduction=reduction
    )
