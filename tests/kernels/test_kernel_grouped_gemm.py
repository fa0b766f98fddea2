"""fastft.kernels.grouped_gemm: the Triton grouped GEMM (forward, dA, dW, fused gather / scatter / add) against
its plain-PyTorch per-expert loop, on awkward shapes (experts with no rows, M not a multiple of the tile, K and N
not multiples of the tile), plus determinism. On the CPU the kernels run through the Triton interpreter; with a
GPU the same cases run on CUDA and the `gpu` tests add Qwen3-30B-A3B shapes.

Tolerances (``rel`` = ``||a - b|| / ||b||`` over a whole tensor), against the reference on fp32 copies:

    | inputs  | rel   |
    | ------- | ----- |
    | fp32    | 1e-5  |
    | bf16    | 2e-2  |
    | fp16    | 2e-2  |
"""

from __future__ import annotations

import os
import shutil

# The interpreter must be on before any @triton.jit function is defined (conftest does the same).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from grouped_gemm_cases import DEVICE, QWEN3_MOE, TOLERANCE, _rel, _routing  # noqa: E402

from fastft.kernels.grouped_gemm import GroupedMMFunction, grouped_mm, grouped_mm_reference  # noqa: E402

FUNCTION_NAME = GroupedMMFunction.__name__ + "Backward"


def _expert_weight(experts, n, k, dtype, generator):
    return (torch.randn(experts, n, k, generator=generator) / k**0.5).to(DEVICE, dtype)


def _compare(dtype, a, weight, group_end, **options):
    """Forward and every gradient (``a``, ``weight``, ``add`` when given) of the kernel path in ``dtype``
    against the reference on fp32 copies, under one random upstream gradient."""
    generator = torch.Generator().manual_seed(7)
    add = options.pop("add", None)
    a_, w_ = a.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    leaves = [a_, w_]
    if add is not None:
        add_ = add.to(dtype).requires_grad_()
        leaves.append(add_)
        options["add"] = add_
    y = grouped_mm(a_, w_, group_end, **options)
    assert y.dtype == dtype
    assert y.grad_fn.name() == FUNCTION_NAME
    dy = torch.randn(y.shape, generator=generator).to(DEVICE)
    grads = torch.autograd.grad(y, leaves, dy.to(dtype))

    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    if add is not None:
        options["add"] = leaves32[2]
    y32 = grouped_mm_reference(leaves32[0], leaves32[1], group_end, **options)
    expected = torch.autograd.grad(y32, leaves32, dy)
    tol = TOLERANCE[dtype]
    assert _rel(y, y32) <= tol, f"forward rel {_rel(y, y32):.2e}"
    for name, got, want, leaf in zip(("da", "dweight", "dadd"), grads, expected, leaves, strict=False):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert _rel(got, want) <= tol, f"{name} rel {_rel(got, want):.2e}"
    return y, grads


# ------------------------------------------------------------------------------------------- parity, CPU-sized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [24, 40])
def test_plain_grouped_mm_matches_per_expert_loop(dtype, k):
    generator = torch.Generator().manual_seed(k)
    counts = torch.tensor([9, 0, 17, 0, 11])  # M = 37, two experts without rows, one spanning two tiles
    group_end = counts.cumsum(0).to(DEVICE, torch.int32)
    a = torch.randn(37, k, generator=generator).to(DEVICE)
    _compare(dtype, a, _expert_weight(5, 18, k, torch.float32, generator), group_end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [24, 40])
def test_gate_up_gather_of_slots_with_top_k_duplicates(dtype, k):
    """MoE gate/up: rows ``x[slot // top_k]``, every token read twice; dA sums each token's two slots."""
    generator = torch.Generator().manual_seed(100 + k)
    tokens, top_k, experts = 19, 2, 5
    slots, group_end = _routing(tokens, top_k, experts, generator, empty=(1, 3))
    x = torch.randn(tokens, k, generator=generator).to(DEVICE)
    _compare(dtype, x, _expert_weight(experts, 18, k, torch.float32, generator), group_end,
             gather_rows=slots, top_k=top_k)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_down_scatter_back_to_slot_order(dtype):
    """MoE down: sorted rows written back to their slots, so ``out.view(T, top_k, N)`` is token-major."""
    generator = torch.Generator().manual_seed(3)
    tokens, top_k, experts = 19, 2, 5
    slots, group_end = _routing(tokens, top_k, experts, generator, empty=(0,))
    h = torch.randn(tokens * top_k, 40, generator=generator).to(DEVICE)
    weight = _expert_weight(experts, 18, 40, torch.float32, generator)
    y, _ = _compare(dtype, h, weight, group_end, scatter_rows=slots)
    # slot s = slots[m] (token s // top_k, its (s % top_k)-th expert) holds sorted row m times its expert's weight
    expert_of_row = torch.searchsorted(
        group_end.long(), torch.arange(tokens * top_k, device=DEVICE), right=True
    )
    want = torch.stack(
        [h[m].to(dtype).float() @ weight[expert_of_row[m]].to(dtype).float().t() for m in range(len(slots))]
    )
    assert _rel(y[slots], want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gather_and_scatter_together_with_add(dtype):
    """Both fusions in one call plus the beta = 1 add (a LoRA term in output order), a row gather of any
    int rows with repeats (``top_k = 1``: dA accumulated with a fixed-order index_put), and a permutation."""
    generator = torch.Generator().manual_seed(4)
    experts, rows_in, m, k, n = 5, 13, 37, 24, 18
    counts = torch.tensor([0, 12, 0, 20, 5])
    group_end = counts.cumsum(0).to(DEVICE, torch.int32)
    gather = torch.randint(0, rows_in, (m,), generator=generator).to(DEVICE)
    scatter = torch.randperm(m, generator=generator).to(DEVICE)
    a = torch.randn(rows_in, k, generator=generator).to(DEVICE)
    add = torch.randn(m, n, generator=generator).to(DEVICE)
    _compare(dtype, a, _expert_weight(experts, n, k, torch.float32, generator), group_end,
             gather_rows=gather, scatter_rows=scatter, add=add)  # fmt: skip


def test_partial_slots_leave_unrouted_slots_with_zero_gradient():
    """Fewer routed rows than ``tokens * top_k`` (a dropped slot): dA of the dropped slot contributes 0."""
    generator = torch.Generator().manual_seed(5)
    tokens, top_k, experts = 19, 2, 5
    slots, _ = _routing(tokens, top_k, experts, generator)
    kept = slots[:37]  # 37 of 38 slots routed
    group_end = torch.tensor([7, 7, 20, 30, 37], dtype=torch.int32, device=DEVICE)
    x = torch.randn(tokens, 24, generator=generator).to(DEVICE)
    _compare(torch.float32, x, _expert_weight(experts, 18, 24, torch.float32, generator), group_end,
             gather_rows=kept, top_k=top_k)  # fmt: skip


def test_strided_and_fp32_lora_weight():
    """A LoRA B stored ``[E, r, N]`` passed as its ``transpose(1, 2)`` view, kept in fp32 beside bf16 rows:
    the product runs in bf16, the weight's gradient comes back in fp32 with the view's shape."""
    generator = torch.Generator().manual_seed(6)
    experts, rank, n = 5, 16, 18
    counts = torch.tensor([4, 0, 20, 0, 13])
    group_end = counts.cumsum(0).to(DEVICE, torch.int32)
    xa = torch.randn(37, rank, generator=generator).to(DEVICE, torch.bfloat16).requires_grad_()
    lora_b = (torch.randn(experts, rank, n, generator=generator) * 0.2).to(DEVICE).requires_grad_()
    y = grouped_mm(xa, lora_b.transpose(1, 2), group_end)
    assert y.dtype == torch.bfloat16 and y.grad_fn.name() == FUNCTION_NAME
    dy = torch.randn(y.shape, generator=generator).to(DEVICE)
    dxa, db = torch.autograd.grad(y, (xa, lora_b), dy.bfloat16())
    assert db.dtype == torch.float32 and db.shape == lora_b.shape

    xa32, b32 = xa.detach().float().requires_grad_(), lora_b.detach().requires_grad_()
    y32 = grouped_mm_reference(xa32, b32.transpose(1, 2), group_end)
    want_dxa, want_db = torch.autograd.grad(y32, (xa32, b32), dy)
    assert _rel(y, y32) <= 2e-2
    assert _rel(dxa, want_dxa) <= 2e-2
    assert _rel(db, want_db) <= 2e-2


def test_experts_without_rows_get_zero_weight_gradient():
    generator = torch.Generator().manual_seed(8)
    counts = torch.tensor([0, 21, 0, 0, 16])
    group_end = counts.cumsum(0).to(DEVICE, torch.int32)
    a = torch.randn(37, 40, generator=generator).to(DEVICE)
    weight = _expert_weight(5, 18, 40, torch.float32, generator).requires_grad_()
    # leave NaNs in the allocator's free memory: a dW buffer left unwritten would likely show them
    torch.full((5, 18, 40), float("nan"), device=DEVICE).sum()
    y = grouped_mm(a, weight, group_end)
    (dweight,) = torch.autograd.grad(y, (weight,), torch.randn(y.shape, generator=generator).to(DEVICE))
    for e in (0, 2, 3):
        assert torch.equal(dweight[e], torch.zeros_like(dweight[e]))
    assert dweight[1].abs().sum() > 0 and dweight[4].abs().sum() > 0


def test_frozen_weight_gets_no_gradient_and_many_experts():
    """E = 128 (most without rows, the tile schedule's vector at full width) and a frozen weight: only dA."""
    generator = torch.Generator().manual_seed(9)
    tokens, top_k, experts = 12, 4, 128
    slots, group_end = _routing(tokens, top_k, experts, generator)
    x = torch.randn(tokens, 16, generator=generator).to(DEVICE).requires_grad_()
    weight = _expert_weight(experts, 16, 16, torch.float32, generator)  # no requires_grad
    y = grouped_mm(x, weight, group_end, gather_rows=slots, top_k=top_k)
    assert y.grad_fn.name() == FUNCTION_NAME
    dy = torch.randn(y.shape, generator=generator).to(DEVICE)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    x32 = x.detach().requires_grad_()
    y32 = grouped_mm_reference(x32, weight, group_end, gather_rows=slots, top_k=top_k)
    (want,) = torch.autograd.grad(y32, (x32,), dy)
    assert _rel(y, y32) <= 1e-5 and _rel(dx, want) <= 1e-5


def test_two_runs_are_bit_identical():
    generator = torch.Generator().manual_seed(10)
    tokens, top_k, experts = 19, 2, 5
    slots, group_end = _routing(tokens, top_k, experts, generator, empty=(2,))
    x = torch.randn(tokens, 40, generator=generator).to(DEVICE, torch.bfloat16)
    weight = _expert_weight(experts, 18, 40, torch.bfloat16, generator)
    dy = torch.randn(tokens * top_k, 18, generator=generator).to(DEVICE, torch.bfloat16)

    def run():
        x_, w_ = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = grouped_mm(x_, w_, group_end, gather_rows=slots, top_k=top_k)
        return (y, *torch.autograd.grad(y, (x_, w_), dy))

    for first, second in zip(run(), run(), strict=True):
        assert torch.equal(first, second)


def test_no_rows_at_all():
    group_end = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    a = torch.randn(0, 24, device=DEVICE, requires_grad=True)
    weight = torch.randn(5, 18, 24, device=DEVICE, requires_grad=True)
    y = grouped_mm(a, weight, group_end)
    assert y.shape == (0, 18)
    da, dw = torch.autograd.grad(y.sum(), (a, weight))
    assert da.shape == (0, 24) and torch.equal(dw, torch.zeros_like(dw))


def test_cpu_without_interpreter_takes_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = torch.randn(6, 24, requires_grad=True)
    group_end = torch.tensor([2, 6], dtype=torch.int32)
    y = grouped_mm(a, torch.randn(2, 18, 24), group_end)
    assert y.grad_fn.name() != FUNCTION_NAME


def test_autotuning_results_are_kept_on_disk_where_triton_can():
    """Each new process (a notebook restart, every bench worker) reuses the timed configs instead of
    re-timing them; Tritons without the option (< 3.4) still get an autotuner. Checked in a process
    without the interpreter, which turns Triton's disk cache off."""
    import inspect
    import os
    import subprocess
    import sys

    import triton

    supported = "cache_results" in inspect.signature(triton.autotune).parameters
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    probe = (
        "from fastft.kernels.grouped_gemm import _tuned_kernel; "
        "print([bool(getattr(_tuned_kernel(n), 'cache_results', False)) for n in ('fwd', 'dw')])"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str([supported, supported])


def test_bad_inputs_name_the_fix():
    a = torch.randn(6, 24, device=DEVICE)
    with pytest.raises(ValueError, match="transpose"):
        grouped_mm(a, torch.randn(2, 24, 18, device=DEVICE), torch.tensor([2, 6], device=DEVICE))
    with pytest.raises(ValueError, match="group_end"):
        grouped_mm(a, torch.randn(2, 18, 24, device=DEVICE), torch.tensor([2, 4, 6], device=DEVICE))
    with pytest.raises(ValueError, match="top_k"):
        grouped_mm(a, torch.randn(2, 18, 24, device=DEVICE), torch.tensor([2, 6], device=DEVICE), top_k=0)


# ------------------------------------------------------------------------------------------- GPU, real sizes

# Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate 768; 4096 tokens (batch 2 x 2048).


def _qwen3_operands(seed=0, skew=False):
    generator = torch.Generator().manual_seed(seed)
    cfg = QWEN3_MOE
    empty = tuple(range(0, cfg["experts"], 3)) if skew else ()
    slots, group_end = _routing(cfg["tokens"], cfg["top_k"], cfg["experts"], generator, empty=empty)
    x = torch.randn(cfg["tokens"], cfg["hidden"], generator=generator).to(DEVICE, torch.bfloat16)
    w_gate_up = _expert_weight(
        cfg["experts"], 2 * cfg["intermediate"], cfg["hidden"], torch.bfloat16, generator
    )
    w_down = _expert_weight(cfg["experts"], cfg["hidden"], cfg["intermediate"], torch.bfloat16, generator)
    return slots, group_end, x, w_gate_up, w_down


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "a_third_of_experts_empty"])
def test_gpu_qwen3_moe_shapes_match_fp32_loop(skew):
    slots, group_end, x, w_gate_up, w_down = _qwen3_operands(skew=skew)
    top_k = QWEN3_MOE["top_k"]
    _compare(torch.bfloat16, x, w_gate_up, group_end, gather_rows=slots, top_k=top_k)
    h = torch.randn(slots.shape[0], QWEN3_MOE["intermediate"], device=DEVICE)
    _compare(torch.bfloat16, h, w_down, group_end, scatter_rows=slots)


@pytest.mark.gpu
def test_gpu_lora_low_rank_shapes_match_fp32_loop():
    """The LoRA GEMMs on the experts at r = 16 (their own autotune regimes: N = r and K = r)."""
    slots, group_end, x, w_gate_up, _ = _qwen3_operands(seed=3)
    generator = torch.Generator().manual_seed(3)
    experts, rank = QWEN3_MOE["experts"], 16
    lora_a = _expert_weight(experts, rank, QWEN3_MOE["hidden"], torch.float32, generator)
    lora_b = _expert_weight(experts, w_gate_up.shape[1], rank, torch.float32, generator)
    _compare(torch.bfloat16, x, lora_a, group_end, gather_rows=slots, top_k=QWEN3_MOE["top_k"])
    xa = torch.randn(slots.shape[0], rank, generator=generator).to(DEVICE)
    _compare(torch.bfloat16, xa, lora_b, group_end)


@pytest.mark.gpu
def test_gpu_two_runs_are_bit_identical():
    slots, group_end, x, w_gate_up, w_down = _qwen3_operands(seed=1)
    top_k = QWEN3_MOE["top_k"]
    dy = torch.randn(x.shape, device=DEVICE, dtype=torch.bfloat16)

    def run(token_rows=False):
        """``token_rows``: gather ``slots // top_k`` with ``top_k = 1`` (rows repeat: the index_put path)."""
        x_, wgu, wd = (
            x.clone().requires_grad_(),
            w_gate_up.clone().requires_grad_(),
            w_down.clone().requires_grad_(),
        )
        if token_rows:
            gate_up = grouped_mm(x_, wgu, group_end, gather_rows=slots // top_k)
        else:
            gate_up = grouped_mm(x_, wgu, group_end, gather_rows=slots, top_k=top_k)
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        y = grouped_mm(h, wd, group_end, scatter_rows=slots).view(x.shape[0], top_k, -1).sum(1)
        return (y, *torch.autograd.grad(y, (x_, wgu, wd), dy))

    for first, second in zip(run(token_rows=True), run(token_rows=True), strict=True):
        assert torch.equal(first, second)

    for first, second in zip(run(), run(), strict=True):
        assert torch.equal(first, second)


@pytest.mark.gpu
def test_gpu_step_has_no_host_sync():
    """Forward and backward of both MoE GEMMs under CUDA's sync debug mode "error" (after the autotuner's
    first, synchronising, benchmark runs)."""
    slots, group_end, x, w_gate_up, w_down = _qwen3_operands(seed=2)
    top_k = QWEN3_MOE["top_k"]

    def step():
        x_ = x.clone().requires_grad_()
        gate_up = grouped_mm(x_, w_gate_up, group_end, gather_rows=slots, top_k=top_k)
        y = grouped_mm(gate_up[:, : QWEN3_MOE["intermediate"]], w_down, group_end, scatter_rows=slots)
        y.backward(torch.ones_like(y))
        return x_.grad

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
