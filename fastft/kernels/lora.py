"""LoRA-fused projections with hand-derived backward: QKV (or any set of linears sharing an input), and
the whole gated MLP (gate/up -> act -> down). Base weights are frozen, 16-bit, NF4 or FP8.

A LoRA linear with frozen base weight ``W [out, in]``, optional bias ``b``, adapters ``A [r, in]``,
``B [out, r]`` and scale ``s`` computes, for rows ``x [N, in]``::

    xa = x A^T                       [N, r]
    y  = x W^T + b + s xa B^T        [N, out]

and its backward, given ``dy = dL/dy``::

    dB  = s dy^T xa                  [out, r]
    dxa = s dy B                     [N, r]
    dA  = dxa^T x                    [r, in]
    dx  = dy W + dxa A               [N, in]

`LoraLinearsFunction` does this for several projections of one input at once (Q, K and V; gate and up):
one GEMM ``x [A_1; A_2; ...]^T`` gives every ``xa``, one GEMM ``dxa^T x`` every ``dA``, and ``dx``
accumulates ``dy_i W_i`` and ``dxa [A_1; A_2; ...]`` in place (``addmm_``). It saves ``x`` and the small
``xa`` only.

`LoraMLPFunction` fuses a gated MLP ``y = down(act(gate(x)) * up(x))`` with LoRA on any of the three::

    g = gate(x), u = up(x)           [N, I]   (saved)
    h = act(g) u                     [N, I]   (freed after the forward)
    y = down(h)

    dh        = dy W_d + dxa_d A_d                    (down's dx)
    h, dg, du = h(g, u), dh u act'(g), dh act(g)      one Triton pass, written over dh, g and u
    dA_d      = dxa_d^T h
    dx        = dg W_g + du W_u + [dxa_g, dxa_u] [A_g; A_u]

It saves ``x``, ``g``, ``u`` and the ``[N, r]`` LoRA intermediates: two ``[N, I]`` tensors where eager
autograd through transformers' MLP and PEFT keeps four (``g``, ``u``, ``act(g)``, ``h``). The backward
writes ``h``, ``dg`` and ``du`` over the buffers of ``dh``, ``g`` and ``u`` (all private to this function),
so it allocates no ``[N, I]`` tensor beyond ``dh``.

Precision: matmuls run in the compute dtype (the autocast dtype when autocast is on, else the input's)
with fp32 accumulation. The low-rank term is computed first and the base GEMM accumulates into it
(``addmm_``, beta = 1), so the LoRA term is rounded once before the sum and the sum once -- PEFT rounds
``xa B^T``, ``* s`` and ``+`` separately. LoRA weights stored in fp32 (PEFT's default for 16-bit models) are
cast to the compute dtype for the matmuls, as autocast would -- read from `AdapterComputeCopies` when a
patched model's training forward has written them, and kept on ``ctx`` so that the backward reuses its
forward's. Their gradients are returned in their own dtype; on CUDA the gradient GEMMs write fp32 directly
(``torch.mm(..., out_dtype=torch.float32)``), elsewhere they are cast.

Recompute. When activation checkpointing re-runs the MLP inside backward, its output is discarded and its
backward needs only the saved ``x``, ``g``, ``u`` and LoRA intermediates, so the re-run skips the down
projection (27% of a Llama layer's recompute FLOPs); see `LoraMLPFunction.forward`.

NF4 bases (bitsandbytes ``Params4bit``) are dequantised to the compute dtype on use, in the forward and
again in the backward (nothing dequantised is kept between them), by `fastft.kernels.nf4`.

FP8 bases (``FrozenLinear.scale`` set: an e4m3 weight with per-output-channel scales, `fastft.kernels.fp8`)
run their base GEMMs on FP8 tensor cores where the card has them (activations and output gradients quantised
per row on the fly; the LoRA GEMMs stay 16-bit and are added to the FP8 GEMM's output), else dequantised as
NF4 is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastft.weight_formats import NF4, WeightFormat

from . import fp8
from .swiglu import gated_activation_backward, gated_activation_forward, gated_activation_reference
from .tiling import dh_slice_rows, mlp_tile_rows

# Function-local imports: tests replace these names on their modules, so they are looked up when called.


@dataclass(frozen=True, eq=False)
class FrozenLinear:
    """A projection's frozen base: ``weight [out, in]`` (16-bit, or packed in a quantised
    `fastft.weight_formats` format with its ``quant_state``) and an optional ``bias [out]``. Not an autograd
    input: its weight receives no gradient. `weight_format` gives the dense view of a quantised weight
    (default NF4: a bare bitsandbytes ``QuantState``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    quant_state: object | None = None
    scale: torch.Tensor | None = None  # an FP8 weight's per-output-channel scales, fp32 [out]
    weight_format: WeightFormat = NF4

    @property
    def out_features(self) -> int:
        if self.quant_state is not None:
            return int(self.quant_state.shape[0])
        return self.weight.shape[0]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor of `dtype` (dequantised when quantised)."""
        if self.quant_state is not None:
            return self.weight_format.dense_view(self.weight, self.quant_state, dtype)
        if self.scale is not None:
            return fp8.dequantize_weight(self.weight, self.scale, dtype)
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    def fp8_runs(self, x: torch.Tensor) -> bool:
        """Whether this base's GEMMs with rows `x` run on FP8 tensor cores (an FP8 weight on a card that has
        them, `fastft.kernels.fp8.fp8_gemm_runs`)."""
        return self.scale is not None and fp8.fp8_gemm_runs(x, self.weight)

    def times(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x2 W^T`` (no bias): on FP8 tensor cores where `fp8_runs`, else with the dense weight."""
        if self.fp8_runs(x2):
            return fp8.fp8_forward(x2, self.weight, self.scale, dtype)
        return torch.mm(x2, self.dense(dtype).t())

    def grad_operand(self, dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What `accumulate_grad` multiplies ``dy`` by, made once per backward: the dense weight, or (FP8 on
        FP8 tensor cores) the fp8 weight transposed (`fastft.kernels.fp8.transposed`)."""
        if self.fp8_runs(dy):
            return fp8.transposed(self.weight)
        return self.dense(dtype)

    def accumulate_grad(self, dx, dy, operand, dtype: torch.dtype) -> torch.Tensor:
        """``dx + dy W`` (``dy W`` when `dx` is None), with `operand` from `grad_operand`."""
        if operand.dtype == fp8.FP8_DTYPE:
            part = fp8.fp8_input_grad(dy, operand, self.scale, dtype)
            return part if dx is None else dx.add_(part)
        return _accumulate(dx, dy, operand)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class AdapterComputeCopies:
    """Copies of fp32 LoRA weights in the compute dtype, written for a whole model in one multi-tensor copy.

    The fused functions need each fp32 adapter in the compute dtype where they use it: in the forward, again
    in an activation-checkpointing recompute, and in the backward. Cast there, that is about 40 small cast
    launches per decoder layer and step (docs/journal.md, "Measurements once quoted in code comments"). `refresh` writes every copy at once (``torch._foreach_copy_``) at the start of a
    training forward (`fastft.patch` calls it from a pre-hook on the decoder), and `compute_weight` hands a
    function the copy while the weight is unchanged since -- its version counter has not moved -- or else
    casts as before, so a weight the optimizer (or anything else in place) has changed is never read stale.
    The copies stay allocated between steps: 2 bytes per adapter parameter.

    Weights sharded by FSDP2 (``DTensor``) get no copy: outside a layer's forward they are shards, and inside
    it FSDP2 hands the layer its unsharded parameters, other tensors than the ones a copy would be keyed to,
    so those forwards cast as before.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def refresh(self, weights: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Write the `dtype` copy of each of `weights` (those already in `dtype` are skipped)."""
        weights = [w for w in weights if w.dtype != dtype and w.is_floating_point() and not _is_sharded(w)]
        if not weights:
            return
        sources, copies = self._buffers.get(dtype, ([], []))
        if len(sources) != len(weights) or any(a is not b for a, b in zip(sources, weights, strict=True)):
            copies = [torch.empty(w.shape, dtype=dtype, device=w.device) for w in weights]
            self._buffers[dtype] = (weights, copies)
        with torch.no_grad():
            torch._foreach_copy_(copies, weights)
        for weight, copy in zip(weights, copies, strict=True):
            weight._fastft_compute_copy = (copy, weight._version)

    def device_tensors(self) -> list[torch.Tensor]:
        """The copies held between steps (what `fastft.vram.measure.resident_memory` counts)."""
        return [copy for _, copies in self._buffers.values() for copy in copies]

    def release(self) -> None:
        """Forget every copy (the weights cast where they are used again)."""
        for sources, _ in self._buffers.values():
            for weight in sources:
                weight.__dict__.pop("_fastft_compute_copy", None)
        self._buffers.clear()


def _is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a ``DTensor`` (FSDP2's sharded parameters), as `fastft.training.distributed` tells
    them, without importing torch.distributed."""
    return hasattr(tensor, "full_tensor")


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`: its `AdapterComputeCopies` copy while that is current, else a cast."""
    if weight.dtype == dtype:
        return weight
    kept = weight.__dict__.get("_fastft_compute_copy")
    if kept is not None and kept[0].dtype == dtype and kept[1] == weight._version:
        return kept[0]
    return weight.to(dtype)


def _compute_weights(tensors, dtype: torch.dtype) -> tuple:
    return tuple(None if t is None else compute_weight(t, dtype) for t in tensors)


def _mm_in(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in `dtype`: a gradient of an fp32 adapter from 16-bit operands comes out of the GEMM in
    fp32 on CUDA (cuBLAS's fp32 output; no rounding to 16 bits, no cast launch), elsewhere it is cast."""
    if a.dtype == dtype:
        return torch.mm(a, b)
    if a.is_cuda and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).to(dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)


def _project(x2, base: FrozenLinear, xa, b_weight, scale, dtype, out=None) -> torch.Tensor:
    """``x W^T + bias + scale xa B^T`` (``b_weight``, B, already in the compute dtype), written into `out`
    (a row range of a larger output) when given.

    The low-rank term goes first, into the output (``(scale xa) B^T``, K = r: one write of ``[N, out]``),
    and the base GEMM then accumulates into it (``addmm_``, beta = 1: the read of the output happens in the
    epilogue of a compute-bound GEMM). Adding the LoRA term after the base GEMM instead costs a separate
    memory-bound pass that reads and writes ``[N, out]``, a tenth of a short step (docs/journal.md, "Measurements once quoted in code comments").
    """
    bias = None if base.bias is None else base.bias.to(dtype)
    if base.fp8_runs(x2):  # the FP8 GEMM writes its own output; the bias and LoRA term are added to it
        y = base.times(x2, dtype)
        if bias is not None:
            y.add_(bias)
        if b_weight is not None:
            y.addmm_(_scaled(xa, scale), b_weight.t())
        return y if out is None else out.copy_(y)
    weight = base.dense(dtype)
    if b_weight is None:
        if out is None:
            return F.linear(x2, weight, bias)
        if bias is None:
            return torch.mm(x2, weight.t(), out=out)
        return torch.addmm(bias, x2, weight.t(), out=out)
    xa_scaled = _scaled(xa, scale)
    b_t = b_weight.t()
    y = torch.mm(xa_scaled, b_t, out=out) if bias is None else torch.addmm(bias, xa_scaled, b_t, out=out)
    return y.addmm_(x2, weight.t())


def _scaled(t: torch.Tensor, scale: float, inplace: bool = False) -> torch.Tensor:
    """``t * scale``, skipped at ``scale == 1`` (alpha = r): an [N, r] multiply costs a launch, not bandwidth,
    and the layers of a graphed 8B step launch about a hundred of them."""
    if scale == 1.0:
        return t
    return t.mul_(scale) if inplace else t * scale


def _accumulate(out: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out + a b`` in place (``a b`` when there is no ``out`` yet)."""
    return torch.mm(a, b) if out is None else out.addmm_(a, b)


def _in_recompute() -> bool:
    """Whether this forward runs inside a backward pass with grad on: activation checkpointing re-running a
    layer (a forward inside backward under no_grad is something else, and gets a real output)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _discarded_output(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A recompute's MLP output, whose values are never read: ``[rows, columns]`` over one element (stride 0).
    It holds no ``[rows, columns]`` memory; the residual add that reads it makes the layer's output. At the
    end of a long layer's recompute that is one ``[N, hidden]`` tensor less, at the moment a long-context step
    1 is nearest its cap (docs/journal.md, "Design history", "The allocator")."""
    return torch.empty((1, 1), dtype=dtype, device=device).expand(rows, columns)


def _lora_slices(ranks: list[int]) -> list[slice | None]:
    slices, start = [], 0
    for r in ranks:
        slices.append(None if r == 0 else slice(start, start + r))
        start += r
    return slices


def _grad_dtype(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None or like is None:
        return None
    return grad.to(like.dtype)


class LoraLinearsFunction(torch.autograd.Function):
    """Several LoRA linears of one input: ``apply(x, bases, scales, known, A_1, B_1, A_2, B_2, ...)`` -> outputs.

    ``bases`` is a tuple of `FrozenLinear`, ``scales`` a tuple of floats; a projection without LoRA passes
    ``None`` for its ``A`` and ``B``. Returns one tensor ``[..., out_i]`` per projection. ``known``: None, or
    the outputs already computed from this very ``x`` (an offloaded layer's recompute is handed the ones its
    forward kept): they are returned as they are, and only the small ``x A^T`` the backward needs is
    computed.
    """

    @staticmethod
    def forward(ctx, x, bases, scales, known, *adapters):
        dtype = _compute_dtype(x)
        x2 = _rows(x).to(dtype)
        # the adapters in the compute dtype, kept on ctx for the backward: its saved tensors come back as
        # plain tensors, without the parameters' compute copies (see AdapterComputeCopies)
        ctx.compute = _compute_weights(adapters, dtype)
        a_list = ctx.compute[0::2]
        b_list = ctx.compute[1::2]
        ranks = [0 if a is None else a.shape[0] for a in a_list]
        slices = _lora_slices(ranks)
        outputs = []
        with torch.autocast(x.device.type, enabled=False):
            lora_a = [a for a in a_list if a is not None]
            xa = torch.mm(x2, _cat(lora_a).t()) if lora_a else None
            for i, (base, sl, b_weight, scale) in enumerate(zip(bases, slices, b_list, scales, strict=True)):
                if known is not None:
                    outputs.append(known[i].view_as(known[i]))  # a fresh view: autograd owns the output
                    continue
                y = _project(x2, base, None if sl is None else xa[:, sl], b_weight, scale, dtype)
                outputs.append(y.view(*x.shape[:-1], y.shape[-1]))
        ctx.bases, ctx.scales, ctx.slices, ctx.dtype = bases, scales, slices, dtype
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        ctx.save_for_backward(x2, xa, *adapters)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x2, xa, *adapters = ctx.saved_tensors
        a_list, b_list = adapters[0::2], adapters[1::2]
        a_compute, b_compute = ctx.compute[0::2], ctx.compute[1::2]
        dtype = ctx.dtype
        grad_adapters: list[torch.Tensor | None] = [None] * len(adapters)
        dx = None
        dxa_parts, a_parts, dys = [], [], []
        with torch.autocast(x2.device.type, enabled=False):
            for i, (base, sl, scale, grad) in enumerate(
                zip(ctx.bases, ctx.slices, ctx.scales, grads, strict=True)
            ):
                if grad is None:
                    continue
                dy = _rows(grad).to(dtype)
                dys.append((base, dy))
                if sl is None:
                    continue
                a_weight, b_weight = a_list[i], b_list[i]
                if b_weight.requires_grad:
                    grad_adapters[2 * i + 1] = _scaled(_mm_in(dy.t(), xa[:, sl], b_weight.dtype), scale, True)
                dxa_parts.append(_scaled(torch.mm(dy, b_compute[i]), scale, True))
                a_parts.append((i, a_weight))
            if dxa_parts:
                dxa = torch.cat(dxa_parts, 1) if len(dxa_parts) > 1 else dxa_parts[0]
                if ctx.needs_input_grad[0]:  # the K = r term first; the big GEMMs accumulate into it
                    dx = torch.mm(dxa, _cat([a_compute[i] for i, _ in a_parts]))
                if any(a.requires_grad for _, a in a_parts):
                    da = _mm_in(dxa.t(), x2, a_parts[0][1].dtype)
                    start = 0
                    for i, a_weight in a_parts:
                        r = a_weight.shape[0]
                        if a_weight.requires_grad:
                            grad_adapters[2 * i] = da[start : start + r].to(a_weight.dtype)
                        start += r
            if ctx.needs_input_grad[0]:
                for base, dy in dys:
                    dx = base.accumulate_grad(dx, dy, base.grad_operand(dy, dtype), dtype)
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, None, None, None, *grad_adapters)


class LoraMLPFunction(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))`` with LoRA on any of the three projections.

    ``apply(x, gate, up, down, scales, kind, recomputing, A_g, B_g, A_u, B_u, A_d, B_d)``: ``gate``/``up``/
    ``down`` are `FrozenLinear`, ``scales`` a 3-tuple, ``kind`` a `fastft.kernels.swiglu` kind; absent adapters
    are None. ``recomputing`` (see `_in_recompute`; decided outside, where grad mode is the caller's) skips the
    down projection: the output is then uninitialised memory of the right shape.
    """

    @staticmethod
    def forward(ctx, x, gate, up, down, scales, kind, recomputing, a_g, b_g, a_u, b_u, a_d, b_d):
        dtype = _compute_dtype(x)
        x2 = _rows(x).to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            ctx.compute = _compute_weights((a_g, b_g, a_u, b_u, a_d, b_d), dtype)  # see LoraLinearsFunction
            ca_g, cb_g, ca_u, cb_u, ca_d, cb_d = ctx.compute
            lora_in = [a for a in (ca_g, ca_u) if a is not None]
            xa = torch.mm(x2, _cat(lora_in).t()) if lora_in else None
            slices = _lora_slices([0 if a is None else a.shape[0] for a in (a_g, a_u)])
            g = _project(x2, gate, None if slices[0] is None else xa[:, slices[0]], cb_g, scales[0], dtype)
            u = _project(x2, up, None if slices[1] is None else xa[:, slices[1]], cb_u, scales[1], dtype)
            h = _activate(g, u, kind)
            ha = torch.mm(h, ca_d.t()) if a_d is not None else None
            if recomputing:
                # Re-run by activation checkpointing: backward needs only what is saved below (it recomputes
                # h from g and u itself), and the layer's output is discarded -- so skip the down projection,
                # 27% of a Llama layer's recompute FLOPs. The values returned are never read.
                y = _discarded_output(h.shape[0], down.out_features, dtype, h.device)
            else:
                y = _project(h, down, ha, cb_d, scales[2], dtype)
        del h
        ctx.bases, ctx.scales, ctx.kind, ctx.slices, ctx.dtype = (gate, up, down), scales, kind, slices, dtype
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        ctx.save_for_backward(x2, g, u, xa, ha, a_g, b_g, a_u, b_u, a_d, b_d)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2, g, u, xa, ha, a_g, b_g, a_u, b_u, a_d, b_d = ctx.saved_tensors
        ca_g, cb_g, ca_u, cb_u, ca_d, cb_d = ctx.compute
        gate, up, down = ctx.bases
        s_g, s_u, s_d = ctx.scales
        dtype = ctx.dtype
        grads: dict[str, torch.Tensor | None] = {}
        with torch.autocast(x2.device.type, enabled=False):
            dy = _rows(grad).to(dtype)
            dha = None
            if a_d is not None:
                dha = _scaled(torch.mm(dy, cb_d), s_d, True)
                grads["b_d"] = _scaled(_mm_in(dy.t(), ha, b_d.dtype), s_d, True)
            # dh in row slices (`fastft.kernels.tiling.DH_SLICE_BYTES`), each turned at once into h, dg, du
            # over itself and the saved g, u rows: two [N, I] tensors held, not three
            down_weight = down.grad_operand(dy, dtype)
            step = dh_slice_rows(dy.shape[0], g.shape[1], g.element_size())
            for rows in _tiles(dy.shape[0], step):
                dh = None if dha is None else torch.mm(dha[rows], ca_d)
                dh = down.accumulate_grad(dh, dy[rows], down_weight, dtype)
                h, _, _ = _activate_backward(dh, g[rows], u[rows], ctx.kind)
                if dha is not None:
                    part = _mm_in(dha[rows].t(), h, a_d.dtype)
                    grads["a_d"] = part if "a_d" not in grads else grads["a_d"].add_(part)
                del h, dh
            del dy, down_weight
            dg, du = g, u
            dx = None
            dxa_parts, a_parts = [], []
            for name, d, a_weight, b_weight, compute_a, compute_b, scale, sl in (
                ("g", dg, a_g, b_g, ca_g, cb_g, s_g, ctx.slices[0]),
                ("u", du, a_u, b_u, ca_u, cb_u, s_u, ctx.slices[1]),
            ):
                if a_weight is None:
                    continue
                grads["b_" + name] = _scaled(_mm_in(d.t(), xa[:, sl], b_weight.dtype), scale, True)
                dxa_parts.append(_scaled(torch.mm(d, compute_b), scale, True))
                a_parts.append((name, a_weight, compute_a))
            if dxa_parts:
                dxa = torch.cat(dxa_parts, 1) if len(dxa_parts) > 1 else dxa_parts[0]
                dx = torch.mm(dxa, _cat([compute_a for _, _, compute_a in a_parts]))
                da = _mm_in(dxa.t(), x2, a_parts[0][1].dtype)
                start = 0
                for name, a_weight, _ in a_parts:
                    grads["a_" + name] = da[start : start + a_weight.shape[0]]
                    start += a_weight.shape[0]
            dx = gate.accumulate_grad(dx, dg, gate.grad_operand(dg, dtype), dtype)
            dx = up.accumulate_grad(dx, du, up.grad_operand(du, dtype), dtype)
        dx = dx.view(ctx.x_shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        tensors = {"a_g": a_g, "b_g": b_g, "a_u": a_u, "b_u": b_u, "a_d": a_d, "b_d": b_d}
        adapter_grads = [
            _grad_dtype(grads.get(key), tensors[key])
            if tensors[key] is not None and tensors[key].requires_grad
            else None
            for key in ("a_g", "b_g", "a_u", "b_u", "a_d", "b_d")
        ]
        return (dx, None, None, None, None, None, None, *adapter_grads)


class LoraTiledMLPFunction(torch.autograd.Function):
    """`LoraMLPFunction` over the rows in tiles of ``tile`` rows (`fastft.kernels.tiling`): the same arguments
    with ``tile`` after ``recomputing``, the same results, and no ``[N, I]`` tensor ever allocated.

    The forward computes each tile's ``g``, ``u``, ``h`` and output rows and keeps none of them: it saves only
    its input (and the adapters). The backward recomputes each tile's ``g`` and ``u`` from the saved input
    (and ``h A_d^T``, the down projection's LoRA input), then runs `LoraMLPFunction`'s backward on the tile.
    The adapters' gradients accumulate over the tiles in fp32; the input gradient is written tile by tile
    into one ``[N, in]`` tensor.

    Cost: under activation checkpointing the recompute calls this with ``recomputing`` (its output is
    discarded) and it returns at once, so the gate and up GEMMs run once per backward, as untiled (where the
    recompute computes and saves them). Without checkpointing they run in both passes: 2 of a layer's 9
    per-token GEMM passes more, the price of not keeping ``2 N I`` values per layer. Each tile re-derives
    ``h`` before its backward for ``h A_d^T`` (an elementwise pass and one ``[tile, I]`` transient), and an
    NF4 base is dequantised once per tile and projection.
    """

    @staticmethod
    def forward(ctx, x, gate, up, down, scales, kind, recomputing, tile, a_g, b_g, a_u, b_u, a_d, b_d):
        dtype = _compute_dtype(x)
        x2 = _rows(x).to(dtype)
        n = x2.shape[0]
        ctx.compute = _compute_weights((a_g, b_g, a_u, b_u, a_d, b_d), dtype)  # see LoraLinearsFunction
        slices = _lora_slices([0 if a is None else a.shape[0] for a in (a_g, a_u)])
        if recomputing:  # a recompute's output is discarded (see LoraMLPFunction): nothing to compute
            y = _discarded_output(n, down.out_features, dtype, x.device)
        else:
            y = torch.empty((n, down.out_features), dtype=dtype, device=x.device)
            ca_d, cb_d = ctx.compute[4:]
            with torch.autocast(x.device.type, enabled=False):
                for rows in _tiles(n, tile):
                    g, u, _ = _gate_up(x2[rows], gate, up, ctx.compute, slices, scales, dtype)
                    h = _activate(g, u, kind)
                    del g, u
                    ha = torch.mm(h, ca_d.t()) if a_d is not None else None
                    _project(h, down, ha, cb_d, scales[2], dtype, out=y[rows])
                    del h, ha
        ctx.bases, ctx.scales, ctx.kind, ctx.slices = (gate, up, down), scales, kind, slices
        ctx.dtype, ctx.tile, ctx.x_dtype, ctx.x_shape = dtype, tile, x.dtype, x.shape
        ctx.save_for_backward(x2, a_g, b_g, a_u, b_u, a_d, b_d)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2, a_g, b_g, a_u, b_u, a_d, b_d = ctx.saved_tensors
        ca_g, cb_g, ca_u, cb_u, ca_d, cb_d = ctx.compute
        gate, up, down = ctx.bases
        s_g, s_u, s_d = ctx.scales
        dtype = ctx.dtype
        sums: dict[str, torch.Tensor] = {}  # adapter gradients summed over the tiles, in fp32

        def add(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
            product = _mm_in(a, b, torch.float32) if a.dtype != torch.float64 else torch.mm(a, b)
            if key in sums:
                sums[key].add_(product)
            else:
                sums[key] = product

        lora_in = [(name, a) for name, a in (("a_g", a_g), ("a_u", a_u)) if a is not None]
        in_a = _cat([c for c in (ca_g, ca_u) if c is not None]) if lora_in else None
        dx = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        with torch.autocast(x2.device.type, enabled=False):
            dy_all = _rows(grad).to(dtype)
            for rows in _tiles(x2.shape[0], ctx.tile):
                xt, dy = x2[rows], dy_all[rows]
                g, u, xa = _gate_up(xt, gate, up, ctx.compute, ctx.slices, ctx.scales, dtype)
                dh = dha = None
                if a_d is not None:
                    ha = torch.mm(_activate(g, u, ctx.kind), ca_d.t())
                    add("b_d", dy.t(), ha)
                    del ha
                    dha = _scaled(torch.mm(dy, cb_d), s_d, True)
                    dh = torch.mm(dha, ca_d)
                dh = down.accumulate_grad(dh, dy, down.grad_operand(dy, dtype), dtype)
                h, dg, du = _activate_backward(dh, g, u, ctx.kind)  # over dh, g, u
                if dha is not None:
                    add("a_d", dha.t(), h)
                del h
                dxa_parts = []
                for name, d, compute_b, scale, sl in (
                    ("g", dg, cb_g, s_g, ctx.slices[0]),
                    ("u", du, cb_u, s_u, ctx.slices[1]),
                ):
                    if sl is not None:
                        add("b_" + name, d.t(), xa[:, sl])
                        dxa_parts.append(_scaled(torch.mm(d, compute_b), scale, True))
                dxa = None
                if dxa_parts:
                    dxa = torch.cat(dxa_parts, 1) if len(dxa_parts) > 1 else dxa_parts[0]
                    add("in_a", dxa.t(), xt)
                if dx is not None and (gate.fp8_runs(dg) or up.fp8_runs(du)):
                    part = None if dxa is None else torch.mm(dxa, in_a)
                    part = gate.accumulate_grad(part, dg, gate.grad_operand(dg, dtype), dtype)
                    dx[rows] = up.accumulate_grad(part, du, up.grad_operand(du, dtype), dtype)
                elif dx is not None:
                    out = dx[rows]
                    if dxa is not None:
                        torch.mm(dxa, in_a, out=out).addmm_(dg, gate.dense(dtype))
                    else:
                        torch.mm(dg, gate.dense(dtype), out=out)
                    out.addmm_(du, up.dense(dtype))
                del g, u, dg, du, dh, xa, dxa
        if "in_a" in sums:
            start = 0
            for name, a_weight in lora_in:
                sums[name] = sums["in_a"][start : start + a_weight.shape[0]]
                start += a_weight.shape[0]
        for key, scale in (("b_g", s_g), ("b_u", s_u), ("b_d", s_d)):
            if key in sums:
                _scaled(sums[key], scale, True)
        dx = dx.view(ctx.x_shape).to(ctx.x_dtype) if dx is not None else None
        adapters = {"a_g": a_g, "b_g": b_g, "a_u": a_u, "b_u": b_u, "a_d": a_d, "b_d": b_d}
        adapter_grads = [
            sums[key].to(t.dtype) if t is not None and t.requires_grad and key in sums else None
            for key, t in adapters.items()
        ]
        return (dx, None, None, None, None, None, None, None, *adapter_grads)


def _tiles(n: int, tile: int):
    for start in range(0, n, tile):
        yield slice(start, min(start + tile, n))


def _gate_up(x2, gate, up, compute, slices, scales, dtype):
    """``(g, u, xa)`` of rows `x2`: the gate and up projections with their LoRA terms, and ``x [A_g; A_u]^T``
    (None without adapters on either)."""
    ca_g, cb_g, ca_u, cb_u = compute[:4]
    lora_in = [a for a in (ca_g, ca_u) if a is not None]
    xa = torch.mm(x2, _cat(lora_in).t()) if lora_in else None
    g = _project(x2, gate, None if slices[0] is None else xa[:, slices[0]], cb_g, scales[0], dtype)
    u = _project(x2, up, None if slices[1] is None else xa[:, slices[1]], cb_u, scales[1], dtype)
    return g, u, xa


def _activate(g: torch.Tensor, u: torch.Tensor, kind: str) -> torch.Tensor:
    from . import use_triton

    if use_triton(g):
        return gated_activation_forward(g, u, kind)
    return gated_activation_reference(g, u, kind)


def _activate_backward(dh, g, u, kind):
    """``(h, dg, du)`` written over ``(dh, g, u)``."""
    from . import use_triton

    if use_triton(g):
        gated_activation_backward(dh, g, u, kind, out_h=dh, out_dgate=g, out_dup=u)
        return dh, g, u
    with torch.enable_grad():
        g_ = g.detach().requires_grad_(True)
        u_ = u.detach().requires_grad_(True)
        h = gated_activation_reference(g_, u_, kind)
        dg, du = torch.autograd.grad(h, (g_, u_), dh)
    h = h.detach()
    dh.copy_(h)
    g.copy_(dg)
    u.copy_(du)
    return dh, g, u


# ------------------------------------------------------------------------------------------- references


def lora_linear_reference(x, base: FrozenLinear, a=None, b=None, scale: float = 1.0) -> torch.Tensor:
    """PEFT's formula in plain PyTorch: ``base(x) + (x A^T) B^T * scale``."""
    weight = base.dense(x.dtype)
    y = F.linear(x, weight, None if base.bias is None else base.bias.to(x.dtype))
    if a is not None:
        y = y + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * scale
    return y


def lora_mlp_reference(x, gate, up, down, scales, kind, a_g, b_g, a_u, b_u, a_d, b_d) -> torch.Tensor:
    g = lora_linear_reference(x, gate, a_g, b_g, scales[0])
    u = lora_linear_reference(x, up, a_u, b_u, scales[1])
    return lora_linear_reference(gated_activation_reference(g, u, kind), down, a_d, b_d, scales[2])


# ------------------------------------------------------------------------------------------- functional


def lora_linears(x, bases, scales, adapters, known=None) -> tuple[torch.Tensor, ...]:
    """Outputs of several LoRA linears sharing input `x`; `adapters` is ``[(A_1, B_1), (A_2, B_2), ...]``
    with ``(None, None)`` for a projection without LoRA. `known`: the outputs, where they were already
    computed from this `x` (see `LoraLinearsFunction`); they come back with the backward of computing them."""
    flat = [t for pair in adapters for t in pair]
    known = None if known is None else tuple(known)
    return LoraLinearsFunction.apply(x, tuple(bases), tuple(float(s) for s in scales), known, *flat)


def lora_mlp(
    x, gate, up, down, scales, kind, adapters, output_discarded_in_recompute=False, tile_rows=None
) -> torch.Tensor:
    """The fused gated MLP; `adapters` is ``[(A_g, B_g), (A_u, B_u), (A_d, B_d)]`` (None pairs allowed).

    ``output_discarded_in_recompute``: the caller promises that nothing saves this output for backward (a
    decoder layer's MLP whose output only enters the residual add), so when activation checkpointing
    re-runs it the down projection is skipped. Where anything else reads the output -- Qwen2-MoE's gated
    shared expert, whose product saves it -- the output must be real in recompute too: leave it False.

    Long inputs run over the rows in tiles (`LoraTiledMLPFunction`; `fastft.kernels.tiling` decides, or
    ``tile_rows`` forces a tile size: the parity tests tile small inputs).
    """
    flat = [t for pair in adapters for t in pair]
    scales = tuple(float(s) for s in scales)
    skip = output_discarded_in_recompute and _in_recompute()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    tile = tile_rows
    if tile is None:
        tile = mlp_tile_rows(rows, gate.out_features, _compute_dtype(x).itemsize)
    if tile is not None and tile < rows:
        return LoraTiledMLPFunction.apply(x, gate, up, down, scales, kind, skip, tile, *flat)
    return LoraMLPFunction.apply(x, gate, up, down, scales, kind, skip, *flat)


__all__ = [
    "AdapterComputeCopies",
    "FrozenLinear",
    "LoraLinearsFunction",
    "LoraMLPFunction",
    "LoraTiledMLPFunction",
    "compute_weight",
    "lora_linear_reference",
    "lora_linears",
    "lora_mlp",
    "lora_mlp_reference",
]
