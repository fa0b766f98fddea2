"""The VRAM estimate: components against hand-computed bytes and against what autograd and peft really
create, monotonicity, the longest context against the verdict, GPU presets, the CLI and its errors.

Everything here runs on the CPU; the estimate's GPU calibration is `fastft bench vram`.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import fastft
from fastft.cli import main
from fastft.models.catalog import CATALOG
from fastft.models.loading import ModelLoadError, UnknownModelError
from fastft.vram import (
    GPUS,
    VramEstimateError,
    capped_gpu,
    detect_gpu,
    estimate_vram,
    fits,
    get_gpu,
    max_context,
    measure,
)
from fastft.vram import activation_bytes as act
from fastft.vram.gpus import GiB, MiB
from fastft.vram.inventory import inventory_of

# tiny-llama: hidden 128, intermediate 344, 4 layers, 4 heads / 2 KV heads of 32, vocabulary 512, untied
TINY_LINEAR_SHAPES = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 344), (128, 344), (344, 128)]
TINY_LINEAR_PARAMS = 4 * sum(i * o for i, o in TINY_LINEAR_SHAPES)  # 724,992
TINY_OTHER_PARAMS = 2 * 512 * 128 + 4 * 2 * 128 + 128  # embedding, head, 8 layer norms, final norm


def test_weights_of_tiny_llama_in_bf16_nf4_and_int8_match_hand_computed_bytes():
    assert TINY_LINEAR_PARAMS == 724_992 and TINY_OTHER_PARAMS == 132_224
    bf16 = estimate_vram("tiny-llama", 256, gpu=None)
    assert bf16.parameters == 857_216
    assert bf16["weights"] == 2 * 857_216 and bf16["quant_constants"] == 0

    nf4 = estimate_vram("tiny-llama", 256, precision="nf4", gpu=None)
    assert nf4["weights"] == TINY_LINEAR_PARAMS // 2 + 2 * TINY_OTHER_PARAMS  # 4-bit codes; bf16 rest
    # per linear: an 8-bit absmax per 64 weights, an fp32 absmax per 256 of those, the fp32 offset,
    # the 16-entry NF4 codebook and the 256-entry map of the nested quantisation (fp32)
    blocks = [i * o // 64 for i, o in TINY_LINEAR_SHAPES]
    per_layer = sum(b + 4 * -(-b // 256) + 4 + 4 * 16 + 4 * 256 for b in blocks)
    assert nf4["quant_constants"] == 4 * per_layer == 42_112

    int8 = estimate_vram("tiny-llama", 256, precision="int8", gpu=None)
    assert int8["weights"] == TINY_LINEAR_PARAMS + 2 * TINY_OTHER_PARAMS
    assert int8["quant_constants"] == 4 * 4 * sum(o for _, o in TINY_LINEAR_SHAPES)  # fp32 scale per row

    # fp16 compute (a T4): add_lora keeps everything not quantised in fp16, as bf16 keeps bf16
    t4 = estimate_vram("tiny-llama", 256, precision="nf4", gpu="t4")
    assert t4["weights"] == nf4["weights"] and t4.settings.precision == "nf4"
    assert t4["activations"] == estimate_vram("tiny-llama", 256, precision="nf4", gpu="h100")["activations"]


def test_nf4_bytes_equal_a_model_quantised_by_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    from fastft.models.random_model import quantize_in_place

    model, _ = fastft.load_model("tiny-llama", dtype=torch.bfloat16, device="cpu")
    try:
        quantize_in_place(model, "nf4", torch.bfloat16, torch.device("cpu"))
    except (RuntimeError, NotImplementedError) as error:  # a bitsandbytes build without CPU kernels
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot quantise on the CPU: {error}")
    loaded = estimate_vram(model, 256, gpu=None)
    named = estimate_vram("tiny-llama", 256, precision="nf4", gpu=None)
    assert loaded.settings.precision == "nf4"
    assert loaded["weights"] == named["weights"] and loaded["quant_constants"] == named["quant_constants"]


@pytest.mark.parametrize(
    ("preset", "r", "targets"),
    [
        ("tiny-llama", 8, "all-linear"),
        ("tiny-llama", 5, ["q_proj", "v_proj", "down_proj"]),
        ("tiny-moe", 4, "all-linear"),
    ],
)
def test_lora_parameters_equal_what_add_lora_creates(preset, r, targets):
    model, _ = fastft.load_model(preset, dtype=torch.float32, device="cpu")
    model = fastft.add_lora(model, r=r, target_modules=targets, gradient_checkpointing=False, fused=False)
    created = sum(p.numel() for p in model.parameters() if p.requires_grad)
    estimate = estimate_vram(preset, 256, lora_r=r, targets=targets, gpu=None)
    assert estimate.lora_parameters == created
    assert estimate_vram(model, 256, gpu=None).lora_parameters == created  # read back from the model


def test_optimizer_and_gradient_bytes_follow_the_adapter_count(monkeypatch):
    adamw = estimate_vram("Qwen/Qwen3-8B", 1024, checkpointing="recompute", gpu=None)
    n = adamw.lora_parameters
    assert n == 43_646_976  # r=16 on q/k/v/o/gate/up/down of 36 layers
    assert adamw["optimizer"] == 8 * n  # fp32 m and v
    # q and o, k and v, gate and up, down
    per_layer = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 12288) + 12288 + 4096)
    assert 36 * per_layer == n
    # all gradients exist only at the end of backward; under offload nothing stored is freed before then
    offload = estimate_vram("Qwen/Qwen3-8B", 1024, checkpointing="offload", gpu=None)
    assert offload.component("gradients").own_bytes == 4 * n
    # under recompute each finished layer frees its stored input (1024 × 4096 × 2 B), more than its
    # gradients (4 B × 1.2M): the peak is the last layer's backward, with only that layer's gradients
    assert adamw.component("gradients").own_bytes == 4 * per_layer
    # at 128 tokens a layer input (1 MiB) is smaller: the peak is the first layer's, all gradients made
    # and 35 layer inputs freed
    short = estimate_vram("Qwen/Qwen3-8B", 128, checkpointing="recompute", gpu=None)
    assert short.component("gradients").own_bytes == 4 * n - 35 * 128 * 4096 * 2
    assert estimate_vram("Qwen/Qwen3-8B", 1024, optimizer="adamw_8bit", gpu=None)["optimizer"] == 2 * n
    assert estimate_vram("Qwen/Qwen3-8B", 1024, optimizer="sgd", gpu=None)["optimizer"] == 0
    # on peft's path autocast's cast cache keeps a 16-bit copy of each adapter through the step; the fused
    # path casts where it uses one, unless fastft's compute copies are on (`tiling.ADAPTER_COMPUTE_COPIES`)
    assert adamw["lora"] == 4 * n
    assert estimate_vram("Qwen/Qwen3-8B", 1024, fused=False, gpu=None)["lora"] == 6 * n
    from fastft.kernels import tiling

    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", True)
    assert estimate_vram("Qwen/Qwen3-8B", 1024, checkpointing="recompute", gpu=None)["lora"] == 6 * n


def _saved_bytes_of_layer(preset: str, fused: bool, tokens: int, layer: int = 1) -> int:
    """Bytes autograd saves inside one decoder layer (storages counted once, parameters excluded)."""
    from fastft.data.batch import PackedBatch
    from fastft.runtime.attention import patch_packed_attention
    from fastft.training.loss import causal_lm_loss_sum

    model, _ = fastft.load_model(preset, dtype=torch.bfloat16, device="cpu")
    model = fastft.add_lora(model, r=8, gradient_checkpointing=False, fused=fused)
    patch_packed_attention(model, "sdpa_segments")
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = {"now": False}
    block = model.get_base_model().model.layers[layer]
    block.register_forward_pre_hook(lambda *_: inside.update(now=True))
    block.register_forward_hook(lambda *_: inside.update(now=False))
    seen, total = set(), [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        # tokens is prime: a tensor whose size it does not divide is a weight copy, not an activation;
        # storages saved earlier (RoPE's cos/sin, shared by every layer) belong to the layer that made them
        if storage.data_ptr() not in parameters | seen and tensor.numel() % tokens == 0:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes() if inside["now"] else 0
        return tensor

    ids = np.random.default_rng(0).integers(3, 500, size=tokens)
    batch = PackedBatch.from_sequences([ids], [ids])
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        causal_lm_loss_sum(model, batch)
    return total[0]


@pytest.mark.parametrize(
    ("preset", "fused"),
    [("tiny-llama", True), ("tiny-qwen3", True), ("tiny-qwen3", False), ("tiny-moe", False)],
)
def test_saved_activations_of_a_layer_equal_what_autograd_saves(preset, fused):
    tokens = 61
    measured = _saved_bytes_of_layer(preset, fused, tokens)
    inventory = inventory_of(preset)
    profile = act.Profile.of(
        "bf16", fused=fused, model_type=inventory.model_type, hidden_act=inventory.hidden_act
    )
    # on the CPU the fused path runs the plain-PyTorch RMSNorm and q/k-norm (Triton only on a GPU), which save
    # what transformers' do; the LoRA-fused projections and MLP are the GPU's
    profile = dataclasses.replace(profile, fused_norms=False)
    layer = inventory.layers[1]
    estimated = act.layer_bytes(layer, inventory, profile, set(inventory.lora_target_names()), 8) * tokens
    if profile.fused_projections:
        # CPU SDPA returns a heads-major output, so o_proj saves a token-major copy; CUDA's varlen
        # returns it token-major and o_proj saves nothing beyond what attention saved
        estimated += 2 * layer.linear("q_proj").out_features * tokens
    assert measured == estimated


def test_memory_grows_with_seq_len_and_shrinks_with_stronger_checkpointing():
    totals = [estimate_vram("Qwen/Qwen3-8B", n, gpu=None).total_bytes for n in (512, 2048, 8192, 32768)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    for model, precision in (
        ("Qwen/Qwen3-8B", "bf16"),
        ("Qwen/Qwen3-30B-A3B", "nf4"),
        ("tiny-llama", "bf16"),
    ):
        stored = {
            mode: estimate_vram(model, 4096, precision=precision, checkpointing=mode, gpu=None)["activations"]
            for mode in ("none", "recompute", "offload")
        }
        assert stored["recompute"] < stored["none"]
        # offload's two device buffers (layer input, attention and o_proj outputs) beat one input per layer
        # from a few layers on; a 4-layer toy is below that
        assert (stored["offload"] < stored["recompute"]) == (model != "tiny-llama")
    # recompute keeps one bf16 hidden state per layer and token; offload two buffers in all, each a layer
    # input, an attention output with its fp32 log-sum-exp and o_proj's output (the final norm's input is
    # freed by the loss's backward, before any layer's: it is part of the loss phase)
    hidden, layers, heads, head_dim, tokens = 4096, 36, 32, 128, 4096
    recompute = estimate_vram("Qwen/Qwen3-8B", tokens, checkpointing="recompute", gpu=None)
    offload = estimate_vram("Qwen/Qwen3-8B", tokens, checkpointing="offload", gpu=None)
    assert recompute["activations"] == layers * hidden * 2 * tokens
    assert offload["activations"] == 2 * (hidden * 2 + heads * (head_dim * 2 + 4) + hidden * 2) * tokens


def test_moe_counts_every_expert_weight_and_top_k_routed_activations():
    spec = CATALOG["Qwen/Qwen3-30B-A3B"]
    estimate = estimate_vram(spec.hub_id, 2048, checkpointing="none", gpu=None)
    assert estimate.parameters == spec.parameter_count()  # all 128 experts, not the 3B active
    assert estimate["weights"] == 2 * spec.parameter_count()
    config = spec.to_config()
    config.num_experts_per_tok = 16  # twice the routed pairs
    doubled = estimate_vram(config, 2048, checkpointing="none", gpu=None)
    # gate/up, act, weight (the fused block keeps no expert output); indices; top-k
    per_pair = (3 * 768 + 1) * 2 + 3 * 8 + 3 * 4
    per_pair += 2 * 16 * 2  # "all-linear" adapts the experts too: the fused block keeps x @ A twice (r = 16)
    assert doubled["activations"] - estimate["activations"] == 48 * 2048 * 8 * per_pair
    # transformers' grouped_mm path keeps each pair's expert output for the routing-weight product
    unfused = estimate_vram(config, 2048, checkpointing="none", gpu=None, fused=False)
    unfused_half = estimate_vram(spec.hub_id, 2048, checkpointing="none", gpu=None, fused=False)
    unfused_pair = (3 * 768 + 2048 + 1) * 2 + 3 * 8 + 3 * 4 + (2048 + 768) * 2  # + PEFT keeps x and h
    assert unfused["activations"] - unfused_half["activations"] == 48 * 2048 * 8 * unfused_pair


def test_fused_loss_holds_one_balanced_logits_chunk_and_the_final_hidden_states():
    from fastft.kernels.fused_linear_ce import default_chunk_size
    from fastft.vram.part_bytes import fused_ce_rows

    for rows, vocab, size in (
        (8192, 151936, 2),
        (18944, 151936, 2),
        (2048, 128256, 2),
        (5, 32000, 4),
        (1, 7, 2),
    ):
        assert fused_ce_rows(rows, vocab, size) == default_chunk_size(rows, vocab, size)
    assert fused_ce_rows(8192, 151936, 2) == 820  # 10 balanced chunks, not 883-row chunks of 256 MiB
    tokens, hidden, vocab = 8192, 4096, 151936
    estimate = estimate_vram("Qwen/Qwen3-8B", tokens, gpu=None)
    final_norm = (2 * hidden + 4) * tokens  # its saved input (the last layer's output) and fp32 rstd
    output = 2 * hidden * tokens  # the decoder's output, alive through the loss
    trained = 2 * 2 * hidden * tokens  # index_select copy of the trained positions, and its gradient
    assert estimate.component("logits").own_bytes == (
        final_norm + output + 820 * vocab * 2 + trained + 4 * tokens
    )


def test_backward_counts_the_recomputed_layer_once_and_the_mlp_backward_buffers():
    tokens, h, inter = 1000, 4096, 12288
    inventory = inventory_of("Qwen/Qwen3-8B")
    profile = act.Profile.of("bf16", fused=True, model_type="qwen3", hidden_act=inventory.hidden_act)
    targets = set(inventory.lora_target_names())
    layer = inventory.layers[0]
    saved = act.layer_bytes(layer, inventory, profile, targets, 16)
    recompute = estimate_vram("Qwen/Qwen3-8B", tokens, checkpointing="recompute", gpu=None)
    # the re-run's first norm saves the layer input, which the stored activations already hold
    assert recompute.component("recompute").own_bytes == (saved - 2 * h) * tokens
    # an offloaded layer is re-run whole: its output is alive too; from 2,048 tokens on its attention
    # output and log-sum-exp are the kept ones, in the offload buffer
    offload = estimate_vram("Qwen/Qwen3-8B", tokens, checkpointing="offload", gpu=None)
    assert offload.component("recompute").own_bytes == saved * tokens
    offload = estimate_vram("Qwen/Qwen3-8B", 4096, checkpointing="offload", gpu=None)
    assert offload.component("recompute").own_bytes == (saved - 32 * (2 * 128 + 4)) * 4096
    offload = estimate_vram("Qwen/Qwen3-8B", 4096, checkpointing="offload", gpu=None, keep_attention=False)
    assert offload.component("recompute").own_bytes == saved * 4096
    # the MLP's backward: the gradient arriving (h), dh (I) and its dx (h), bf16; by the attention's
    # backward the MLP's saved g, u and input are freed, which outweighs FlashAttention's buffers
    assert recompute.component("backward_workspace").own_bytes == (2 * h + 2 * (inter + h)) * tokens
    attention = 2 * 2 * h + 4 * h + 2 * (h + 2 * 1024) + 2 * h + 4 * 32
    freed = act.mlp_side_bytes(layer, inventory, profile, targets, 16)
    assert freed == 2 * h + 2 * 2 * inter + 2 * 3 * 16 + (2 * h + 4)  # input, g, u, x@A and h@A; norm
    assert attention - freed < 2 * h + 2 * (inter + h)


def test_offload_counts_an_moe_layers_kept_routing_order():
    """Offloaded MoE layers keep their routing order (int32 per routed slot) with their inputs: two device
    buffers' worth, at any length (below 2,048 tokens nothing else is kept)."""
    tokens, top_k = 1024, 8  # Qwen3-30B-A3B routes each token to 8 of 128 experts
    kept = estimate_vram("Qwen/Qwen3-30B-A3B", tokens, checkpointing="offload", gpu=None)
    plain = estimate_vram(
        "Qwen/Qwen3-30B-A3B", tokens, checkpointing="offload", gpu=None, keep_attention=False
    )
    assert kept["activations"] - plain["activations"] == 2 * 4 * top_k * tokens
    dense = estimate_vram("Qwen/Qwen3-8B", tokens, checkpointing="offload", gpu=None)
    dense_plain = estimate_vram(
        "Qwen/Qwen3-8B", tokens, checkpointing="offload", gpu=None, keep_attention=False
    )
    assert dense["activations"] == dense_plain["activations"]


def test_int8_keeps_every_projection_input_and_the_down_projection_outlier_columns():
    tokens = 2048
    h, q, inter, layers = 4096, 4096, 14336, 32
    estimate = estimate_vram(
        "mistralai/Mistral-7B-Instruct-v0.3", tokens, precision="int8", checkpointing="recompute", gpu=None
    )
    # per layer: its input (checkpointing), and bitsandbytes' ctx.tensors: the attention input, o_proj's
    # input, the MLP input, down_proj's input and its outlier columns (worst case: all of them)
    kept = 2 * (h + q + h + inter) + 2 * inter
    assert estimate["activations"] == layers * (2 * h + kept) * tokens
    inventory = inventory_of("mistralai/Mistral-7B-Instruct-v0.3")
    profile = act.Profile.of("int8", fused=True, model_type="mistral", hidden_act="silu")
    assert act.int8_shares_inputs(profile) and not profile.fused_projections
    layer = inventory.layers[0]
    assert act.int8_outlier_bytes(layer, inventory, profile) == 2 * inter
    terms = act.layer_terms(layer, inventory, profile, set(inventory.lora_target_names()), 16)
    # under autocast peft's 8-bit LoRA layer feeds lora_A the input bitsandbytes keeps: no copies
    assert terms["projection_inputs"] == 0
    assert terms["int8_inputs"] == 2 * (h + h + inter) and terms["int8_outliers"] == 2 * inter
    # the peak: down_proj's forward re-run in backward, its outlier columns' weights dequantised in fp32
    # (int8 gather + two fp32 products per weight) beside its int8 input, and the gradient arriving
    assert estimate.peak_phase == "backward"
    assert estimate["dequant"] == tokens * inter + 9 * h * inter
    assert estimate["backward_workspace"] == 2 * h * tokens
    assert any("outlier" in note for note in estimate.notes)
    # offloaded layers run their forward under no_grad: bitsandbytes keeps nothing between the passes
    offload = estimate_vram(
        "mistralai/Mistral-7B-Instruct-v0.3", tokens, precision="int8", checkpointing="offload", gpu=None
    )
    # two layer-input buffers: a quantised base keeps no attention output by default
    assert offload["activations"] == 2 * 2 * h * tokens


def test_bitsandbytes_8bit_matmul_keeps_input_and_outlier_columns_through_checkpointing():
    """What `int8_kept_bytes` assumes of ``MatMul8bitLt`` (the CUDA training path; its default kernels run on
    the CPU too): for a frozen weight it keeps ``(None, A[:, outlier_cols], A)`` as ctx attributes, which
    non-reentrant checkpointing does not drop and backward does not free."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    rows, width, out = 37, 24, 10
    weight, scales, _ = bnb_functional.int8_vectorwise_quant(torch.randn(out, width).half())
    state = MatmulLtState()
    state.CB, state.SCB, state.threshold = weight, scales, 6.0  # a frozen 8-bit weight, LLM.int8() threshold
    state.has_fp16_weights, state.is_training = False, True
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    inputs = []

    def project(x):
        h = x * 1.0  # a fresh input, as a norm's output is
        with torch.no_grad():
            h[[3, 30], [2, 7]] = torch.tensor([9.0, -7.0], dtype=h.dtype)  # outliers in columns 2 and 7
        inputs.append(h)
        return MatMul8bitLt.apply(h, weight, None, None, state)

    y = checkpoint(project, x, use_reentrant=False)
    node = y.grad_fn
    y.float().sum().backward()
    assert x.grad is not None
    no_weight_grad, outliers, kept = node.tensors
    assert no_weight_grad is None
    assert kept.untyped_storage().data_ptr() == inputs[0].untyped_storage().data_ptr()  # the input itself
    assert outliers.shape == (rows, 2) and outliers.dtype == torch.bfloat16
    assert torch.equal(outliers, inputs[0][:, [2, 7]])


def test_recorded_h200_peaks_and_longest_context_are_reproduced(monkeypatch):
    """The estimate against `fastft bench vram`'s H200 run (benchmarks/results/vram/several_bf16+int8+nf4_h200_2026-11-30.json, offloading
    without kept attention outputs and without adapter compute copies, which came later, and with the MLP
    tiled only from 1 GiB per [rows, I] tensor and its backward's dh made whole, as they then were): every peak within 2.5 %, every longest
    context at most the one that trained and at most one 512-token step (or 5 %) below it -- the prediction
    is rounded down to whole steps, so a 1 % error can cost one."""
    from pathlib import Path

    from fastft.kernels import tiling

    monkeypatch.setattr(tiling, "TILE_FROM_BYTES", 1 << 30)
    monkeypatch.setattr(tiling, "DH_SLICE_BYTES", 1 << 62)

    recorded = json.loads(
        (
            Path(__file__).resolve().parents[2]
            / "benchmarks"
            / "results"
            / "vram"
            / "several_bf16+int8+nf4_h200_2026-11-30.json"
        ).read_text()
    )
    errors = {}
    for row in recorded["peaks"]:
        estimate = estimate_vram(
            row["model"],
            row["seq_len"],
            precision=row["precision"],
            lora_r=row["lora_r"],
            checkpointing=row["checkpointing"],
            fused=row["fused"],
            gpu=None,
            keep_attention=False,
        )
        # Recorded before the fused path kept 16-bit compute copies of the adapters (AdapterComputeCopies):
        # those persist through the step, so today's peak is the recorded one plus their bytes -- the
        # difference between today's LoRA component and the recorded estimate's (zero where nothing
        # changed). The step bench saw it: Llama-3.1-8B bf16 2x2048, 16.47 -> 16.54 GiB for 84 MB of copies.
        copies = estimate.component("lora").own_bytes - row["components"]["lora"]
        errors[row["config"]] = estimate.allocated_bytes / (row["measured_gib"] * GiB + copies) - 1
    assert len(errors) == 19 and all(abs(e) < 0.025 for e in errors.values()), errors
    measured_contexts = [row for row in recorded["contexts"] if "measured" in row]
    assert len(measured_contexts) == 4
    for row in measured_contexts:
        predicted = max_context(
            row["model"],
            capped_gpu(int(row["cap_gib"] * GiB)),
            precision=row["precision"],
            lora_r=row["lora_r"],
            checkpointing=row["checkpointing"],
            fused=row["fused"],
            multiple_of=512,
        )
        slack = max(512, 0.05 * row["measured"])
        assert row["measured"] - slack <= predicted <= row["measured"], (row["config"], predicted)


def test_max_context_is_the_longest_length_fits_accepts():
    settings = dict(precision="nf4", checkpointing="recompute")
    longest = max_context("Qwen/Qwen3-8B", "rtx4090", multiple_of=256, **settings)
    assert longest > 0 and longest % 256 == 0
    assert fits("Qwen/Qwen3-8B", longest, gpu="rtx4090", **settings)
    assert not fits("Qwen/Qwen3-8B", longest + 256, gpu="rtx4090", **settings)
    assert max_context("Qwen/Qwen3-32B", "t4") == 0  # the weights alone do not fit


def test_fits_offers_only_fixes_that_fit():
    verdict = fits("Qwen/Qwen3-8B", 32768, gpu="rtx4090", checkpointing="recompute")
    assert not verdict and not verdict.fits and verdict.fixes
    descriptions = [fix.description for fix in verdict.fixes]
    assert "use checkpointing='offload'" in descriptions
    assert any(d.startswith("lower seq_len to ") for d in descriptions)
    assert any("nf4" in d for d in descriptions)
    for fix in verdict.fixes:
        changes = {"checkpointing": "recompute", **fix.changes}
        seq_len = changes.pop("seq_len", 32768)
        assert estimate_vram("Qwen/Qwen3-8B", seq_len, gpu="rtx4090", **changes).fits


def test_estimate_fits_and_training_share_one_checkpointing_default():
    """ "auto" is `add_lora`'s default and the estimator's: on a GPU both mean offload, so `fits` with no
    checkpointing argument judges the run training does and never offers that mode as a fix."""
    import inspect

    from fastft.cli import build_parser
    from fastft.models.lora import add_lora
    from fastft.runtime.activation_checkpointing import Checkpointing

    training = inspect.signature(add_lora).parameters["gradient_checkpointing"].default
    assert inspect.signature(estimate_vram).parameters["checkpointing"].default == training == "auto"
    assert build_parser().parse_args(["estimate", "Qwen/Qwen3-8B"]).checkpointing == training
    on_gpu = Checkpointing.parse(training).resolved(cuda=True).kind
    default = estimate_vram("Qwen/Qwen3-8B", 65536, gpu="rtx4090")
    assert default.settings.checkpointing == on_gpu == "offload"
    offload = estimate_vram("Qwen/Qwen3-8B", 65536, gpu="rtx4090", checkpointing="offload")
    assert default.total_bytes == offload.total_bytes
    # 32k tokens fit under offload (the default) though not under recompute: no false alarm
    assert fits("Qwen/Qwen3-8B", 32768, gpu="rtx4090")
    verdict = fits("Qwen/Qwen3-8B", 65536, gpu="rtx4090")
    assert not verdict and verdict.fixes
    for fix in verdict.fixes:
        assert "checkpointing" not in fix.changes and "checkpointing" not in fix.description, fix
    # a model with adapters already: "auto" is the mode its add_lora call chose
    for mode, expected in (("auto", "offload"), ("recompute", "recompute"), ("none", "none")):
        model = fastft.add_lora(fastft.load_model("tiny-llama")[0], r=8, gradient_checkpointing=mode)
        assert estimate_vram(model, 256, gpu=None).settings.checkpointing == expected
        assert (
            estimate_vram(model, 256, gpu=None, checkpointing="offload").settings.checkpointing == "offload"
        )
    assert "Fixes:" in verdict.message and "RTX 4090" in str(verdict)
    assert fits("tiny-llama", 512, gpu="t4").fits


def test_gpu_presets_hold_usable_capacities():
    assert {
        "t4",
        "rtx3090",
        "rtx4090",
        "rtx5090",
        "l4",
        "a100-40gb",
        "a100-80gb",
        "h100",
        "h200",
        "b200",
    } <= set(GPUS)
    assert GPUS["rtx4090"].capacity_bytes == 24563 * MiB  # what torch reports, not "24 GB"
    gib = {name: gpu.capacity_gib for name, gpu in GPUS.items()}
    assert 14 < gib["t4"] < 16 and 79 < gib["h100"] < 80 and 139 < gib["h200"] < 141 and gib["b200"] > 170
    assert not GPUS["t4"].bf16 and GPUS["h100"].bf16
    assert get_gpu("RTX 4090") is GPUS["rtx4090"] and get_gpu("A100").name == "a100-80gb"
    with pytest.raises(ValueError, match="rtx4090"):
        get_gpu("rtx9090")
    assert capped_gpu(24 * GiB).context_bytes == 0
    if not torch.cuda.is_available():
        assert detect_gpu() is None
        assert estimate_vram("tiny-llama", 128).gpu is None  # "auto" without a GPU: no verdict
        with pytest.raises(VramEstimateError, match="rtx4090"):
            fits("tiny-llama", 128)


def test_estimate_from_a_config_and_from_a_loaded_model():
    by_name = estimate_vram("Qwen/Qwen2.5-1.5B-Instruct", 2048, gpu="l4")
    by_config = estimate_vram(CATALOG["Qwen/Qwen2.5-1.5B-Instruct"].to_config(), 2048, gpu="l4")
    assert by_config.total_bytes == by_name.total_bytes
    assert estimate_vram("qwen/qwen2.5-1.5b-instruct", 2048, gpu="l4").total_bytes == by_name.total_bytes

    model, _ = fastft.load_model("tiny-qwen3", dtype=torch.float32, device="cpu")
    model = fastft.add_lora(model, r=4, target_modules=["q_proj", "o_proj"], gradient_checkpointing=False)
    estimate = estimate_vram(model, 256, gpu=None)
    assert estimate.settings.precision == "fp32" and estimate.settings.lora_r == 4
    assert estimate.settings.targets == ("q_proj", "o_proj")
    assert estimate["weights"] == 4 * sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    with pytest.raises(VramEstimateError, match="loaded in fp32"):
        estimate_vram(model, 256, precision="nf4", gpu=None)


def test_breakdown_table_and_dict_add_up():
    estimate = estimate_vram("Qwen/Qwen3-8B", 8192, precision="nf4", gpu="rtx4090")
    assert sum(c.bytes for c in estimate.components) == estimate.total_bytes
    peak = estimate.phase_bytes(estimate.peak_phase)
    assert (
        estimate.allocated_bytes
        == peak
        == max(estimate.phase_bytes("loss"), estimate.phase_bytes("backward"))
    )
    data = json.loads(json.dumps(estimate.to_dict()))
    assert data["fits"] is True and data["gpu"]["name"] == "rtx4090"
    assert {c["key"] for c in data["components"]} >= {
        "weights",
        "activations",
        "logits",
        "optimizer",
        "context",
    }
    table = estimate.table()
    assert (
        "model weights" in table and "saved activations" in table and "fits NVIDIA GeForce RTX 4090" in table
    )
    assert estimate.with_gpu("t4").gpu.name == "t4"


def test_cli_estimate_prints_the_breakdown_and_verdict(capsys):
    assert main(["estimate", "tiny-llama", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "component" in out and "saved activations" in out and "total" in out and "tiny-llama" in out
    assert main(["estimate", "Qwen/Qwen3-8B", "--seq-len", "65536", "--gpu", "rtx4090", "--max-context"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "Fixes:" in out and "Longest context" in out
    assert main(["estimate", "tiny-llama", "--seq-len", "64", "--json", "--gpu", "h100"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_unknown_models_and_bad_settings_name_the_fix(capsys):
    with pytest.raises(UnknownModelError, match="tiny-llama"):
        estimate_vram("tiny-lama", 512)
    with pytest.raises(ModelLoadError, match="config.json"):  # offline, and not in the catalog
        estimate_vram("someorg/not-in-the-catalog", 512)
    with pytest.raises(VramEstimateError, match="q_proj"):
        estimate_vram("tiny-llama", 512, targets=["query"])
    with pytest.raises(VramEstimateError, match="batch_tokens"):
        estimate_vram("tiny-llama", 512, batch_tokens=256)
    with pytest.raises(VramEstimateError, match="checkpointing"):
        estimate_vram("tiny-llama", 512, checkpointing="sometimes")
    assert main(["estimate", "tiny-lama", "--seq-len", "64"]) == 2
    assert "Did you mean" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error only")
def test_measure_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        measure("tiny-llama", 128)


def test_bench_vram_is_registered_and_plans_at_least_twelve_configurations(capsys):
    from fastft.bench import BENCHMARKS
    from fastft.bench import vram as bench

    assert BENCHMARKS["vram"] == "fastft.bench.vram"
    assert bench.main(["--list"]) == 0
    peaks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("peak")]
    assert len(peaks) >= 12
    configs = bench.PEAK_CONFIGS
    assert {c.precision for c in configs} >= {"bf16", "nf4"} and {c.checkpointing for c in configs} == {
        "none",
        "recompute",
        "offload",
    }
    assert any(CATALOG[c.model].is_moe for c in configs)
    sizes = [CATALOG[c.model].parameter_count() for c in configs]
    assert min(sizes) < 0.6e9 and max(sizes) > 30e9


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("model", "precision", "checkpointing", "seq_len"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", "bf16", "recompute", 16384),
        ("Qwen/Qwen3-1.7B", "bf16", "none", 4096),
        # bitsandbytes' kept inputs and outlier columns (random weights: all of down_proj's), 13.95 GiB
        ("mistralai/Mistral-7B-Instruct-v0.3", "int8", "recompute", 2048),
    ],
)
def test_gpu_estimate_is_within_ten_percent_of_the_measured_peak(model, precision, checkpointing, seq_len):
    """Two real training steps against the estimate (`fastft bench vram` runs 16 such configurations)."""
    result = measure(model, seq_len, precision=precision, checkpointing=checkpointing, steps=2)
    assert abs(result.error) <= 0.10, result.to_dict()
