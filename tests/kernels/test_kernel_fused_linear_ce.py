"""fastft.kernels.fused_linear_ce: chunked lm_head + cross-entropy (loss, dHidden, dW, dBias) against the
plain-PyTorch reference.

Without a GPU the row kernel runs on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported); CPU tests count the kernel launches to prove the Triton path, not the reference,
ran. Shapes are small and awkward (vocab 257 and 1001, never a power of two) because the interpreter is slow.

Tolerances (``rel`` = ``||a - b|| / ||b||`` over a whole tensor):

    | inputs and weight | compared with                        | rel  |
    | ----------------- | ------------------------------------ | ---- |
    | fp32              | reference, fp32                      | 1e-5 |
    | bf16, fp16        | reference, same dtype                | 2e-2 |
    | bf16 (GPU)        | reference run on fp32 copies         | 2e-2 |

The 16-bit rows allow for the gradient being rounded at a different point: the fused path rounds
``dloss/dlogits`` to the input dtype before ``grad_output`` scales the matmul results, autograd after.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from fastft.kernels import fused_linear_ce  # noqa: E402
from fastft.kernels.fused_linear_ce import (  # noqa: E402
    FusedLinearCrossEntropyFunction,
    cross_entropy_chunk_,
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    lm_head_loss,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def _interpret_on_cpu(monkeypatch):
    """Keep the dispatch on the Triton path for CPU tensors even if another test changed the environment."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    """Counts the row-kernel launches (one per chunk) made through ``cross_entropy_chunk_``."""
    calls = []
    real = fused_linear_ce.cross_entropy_chunk_

    def counting(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(fused_linear_ce, "cross_entropy_chunk_", counting)
    return calls


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.double(), expected.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    rel = _rel(actual, expected)
    assert rel <= tol, f"{what}: relative error {rel:.3e} > {tol:.0e}"


def _inputs(n, h, v, dtype, *, seed=0, bias=False, logit_scale=2.0, ignored=()):
    """hidden ~ N(0, 1), weight scaled so logits have std ``logit_scale``; targets with ``ignored`` rows."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, device=DEVICE)
    weight = torch.randn(v, h, generator=gen, device=DEVICE) * (logit_scale / h**0.5)
    b = torch.randn(v, generator=gen, device=DEVICE) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen, device=DEVICE)
    targets[list(ignored)] = -100
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), targets, cast(b)


def _run(fn, hidden, weight, targets, bias=None, grad_output=None, **kwargs):
    """``(loss, grads)`` of ``fn`` on fresh leaves; grads for hidden, weight (and bias when given)."""
    leaves = [hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_(True))
    loss = fn(leaves[0], leaves[1], targets, bias=leaves[2] if bias is not None else None, **kwargs)
    if grad_output is None:
        grad_output = torch.full_like(loss, 1.5)  # not 1: the backward must really scale
    grads = torch.autograd.grad(loss, leaves, grad_output)
    return loss, grads


def _compare(dtype, hidden, weight, targets, bias=None, what="", **kwargs):
    loss, grads = _run(fused_linear_cross_entropy, hidden, weight, targets, bias, **kwargs)
    kwargs.pop("chunk_size", None)
    loss_ref, grads_ref = _run(fused_linear_cross_entropy_reference, hidden, weight, targets, bias, **kwargs)
    tol = TOLERANCES[dtype]
    assert loss.dtype == torch.float32
    _check(loss, loss_ref, tol, f"loss {what}")
    assert len(grads) == len(grads_ref)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), grads, grads_ref, strict=False):
        assert a.dtype == dtype, name
        _check(a, b, tol, f"{name} {what}")
    return loss, grads


# ------------------------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------------------------

SHAPES = [(1, 24, 257), (3, 100, 1001), (37, 24, 257)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_reference(shape, reduction, launches):
    hidden, weight, targets, bias = _inputs(*shape, torch.float32, seed=1, bias=shape[0] == 3)
    loss, _ = _compare(
        torch.float32, hidden, weight, targets, bias, f"{shape} {reduction}", reduction=reduction
    )
    assert loss.grad_fn.name() == f"{FusedLinearCrossEntropyFunction.__name__}Backward"
    assert launches, "the Triton row kernel did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_half_precision_matches_reference(shape, dtype, launches):
    hidden, weight, targets, bias = _inputs(*shape, dtype, seed=2, bias=True, ignored=(0,))
    _compare(dtype, hidden, weight, targets, bias, f"{shape} {dtype}", reduction="mean")
    assert launches


@pytest.mark.parametrize(("v", "block_size"), [(257, 64), (1001, 128), (1001, 1024)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_row_kernel_masks_the_vocab_tail(v, block_size, softcap):
    """The kernel alone, several vocab blocks with a ragged last one: loss and per-row-scaled gradient."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, v, generator=gen) * 4).to(DEVICE)
    targets = torch.tensor([0, v - 1, -100, 7, v // 2], device=DEVICE)
    scale = torch.tensor([1.0, 0.5, 2.0, -1.0, 3.0], device=DEVICE)
    x = logits.clone().requires_grad_(True)
    z = softcap * torch.tanh(x / softcap) if softcap else x
    loss_ref = torch.nn.functional.cross_entropy(z, targets, reduction="none")
    (grad_ref,) = torch.autograd.grad(loss_ref, x, scale)

    work, losses = logits.clone(), torch.empty(5, device=DEVICE)
    cross_entropy_chunk_(work, targets, losses, scale, softcap=softcap, block_size=block_size)
    _check(losses, loss_ref, 1e-5, f"loss V={v} block={block_size}")
    _check(work, grad_ref, 1e-5, f"dlogits V={v} block={block_size}")
    assert (work[2] == 0).all() and losses[2] == 0

    untouched, losses2 = logits.clone(), torch.empty(5, device=DEVICE)
    cross_entropy_chunk_(untouched, targets, losses2, None, softcap=softcap, block_size=block_size)
    assert torch.equal(untouched, logits) and torch.equal(losses2, losses)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_kernel_rounds_gradient_to_nearest(dtype):
    """16-bit ``dloss/dlogits`` is the fp32 gradient rounded to nearest even (what autograd's cast does)."""
    gen = torch.Generator().manual_seed(19)
    logits = (torch.randn(4, 1001, generator=gen) * 3).to(DEVICE, dtype)
    targets = torch.tensor([5, 0, 1000, 17], device=DEVICE)
    x = logits.float().requires_grad_(True)
    loss_ref = torch.nn.functional.cross_entropy(x, targets, reduction="sum")
    (grad_ref,) = torch.autograd.grad(loss_ref, x)
    work, losses = logits.clone(), torch.empty(4, device=DEVICE)
    cross_entropy_chunk_(work, targets, losses, torch.ones(1, device=DEVICE), block_size=256)
    same = (work == grad_ref.to(dtype)).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of gradients equal the round-to-nearest fp32 gradient"


# ------------------------------------------------------------------------------------------------------------
# Ignored rows, softcap, chunks, large logits, reductions
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ignored_rows_are_masked_and_mean_counts_the_rest(reduction):
    hidden, weight, targets, _ = _inputs(9, 24, 257, torch.float32, seed=4, ignored=(0, 4, 8))
    loss, (d_hidden, _) = _compare(
        torch.float32, hidden, weight, targets, what=reduction, reduction=reduction, chunk_size=4
    )
    assert (d_hidden[[0, 4, 8]] == 0).all()
    keep = targets != -100
    alone = fused_linear_cross_entropy_reference(hidden[keep], weight, targets[keep], reduction=reduction)
    _check(loss.detach(), alone, 1e-5, "loss over the kept rows alone")


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction, launches):
    hidden, weight, targets, bias = _inputs(5, 24, 257, torch.bfloat16, seed=5, bias=True, ignored=range(5))
    loss, grads = _run(fused_linear_cross_entropy, hidden, weight, targets, bias, reduction=reduction)
    assert launches
    assert (loss == 0).all()
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_reference(dtype):
    hidden, weight, targets, _ = _inputs(7, 24, 1001, dtype, seed=6, logit_scale=30.0, ignored=(2,))
    _compare(dtype, hidden, weight, targets, what=f"softcap {dtype}", softcap=15.0, chunk_size=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_smaller_than_rows_with_partial_last_chunk(dtype, launches):
    hidden, weight, targets, bias = _inputs(37, 24, 257, dtype, seed=7, bias=True, ignored=(36,))
    _compare(dtype, hidden, weight, targets, bias, f"chunks {dtype}", chunk_size=8)
    assert launches == [8, 8, 8, 8, 5]
    launches.clear()
    whole, _ = _run(fused_linear_cross_entropy, hidden, weight, targets, bias, chunk_size=37)
    assert launches == [37]
    launches.clear()
    chunked, _ = _run(fused_linear_cross_entropy, hidden, weight, targets, bias, chunk_size=8)
    _check(chunked, whole, 1e-6 if dtype == torch.float32 else 1e-3, "loss with 5 chunks against 1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_do_not_overflow(dtype):
    hidden, weight, targets, _ = _inputs(6, 24, 257, dtype, seed=8, logit_scale=5000.0)
    logits = (hidden.float() @ weight.float().T).abs().max()
    assert logits > 1e4, f"logits reach only {logits:.0f}"
    loss, grads = _compare(dtype, hidden, weight, targets, what=f"logits ~1e4 {dtype}")
    assert loss > 1e3


def test_near_ties_at_large_logits_keep_full_precision():
    """Logits all near 1e4 (fp32 ulp 1e-3): softmax values come from ``(z - max) - log(sum)``, never from
    ``z - lse``, whose rounding would cost ~5e-4 relative in every one of them."""
    gen = torch.Generator().manual_seed(23)
    logits = (1e4 + torch.randn(3, 1001, generator=gen) * 2).to(DEVICE)
    targets = torch.tensor([0, 500, 1000], device=DEVICE)
    x = logits.clone().requires_grad_(True)
    loss_ref = torch.nn.functional.cross_entropy(x, targets, reduction="none")
    (grad_ref,) = torch.autograd.grad(loss_ref.sum(), x)
    work, losses = logits.clone(), torch.empty(3, device=DEVICE)
    cross_entropy_chunk_(work, targets, losses, torch.ones(1, device=DEVICE), block_size=256)
    _check(losses, loss_ref, 1e-5, "loss near 1e4")
    _check(work, grad_ref, 1e-5, "dlogits near 1e4")


def test_reduction_none_per_row_grad_output(launches):
    """``"none"``: the per-row ``grad_output`` scales each row before ``dx.T @ h``; the backward recomputes."""
    hidden, weight, targets, bias = _inputs(11, 24, 257, torch.float32, seed=9, bias=True, ignored=(3,))
    grad_output = torch.randn(11, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    loss, _ = _compare(
        torch.float32,
        hidden,
        weight,
        targets,
        bias,
        "none",
        reduction="none",
        chunk_size=4,
        grad_output=grad_output,
    )
    assert loss.shape == (11,) and loss[3] == 0
    assert launches == [4, 4, 3] * 2, "forward, then backward recomputing the three chunks"


def test_leading_dims_and_int32_targets():
    hidden, weight, targets, _ = _inputs(12, 24, 257, torch.float32, seed=11, ignored=(5,))
    hidden3, targets3 = hidden.view(3, 4, 24), targets.view(3, 4).to(torch.int32)
    _compare(torch.float32, hidden3, weight, targets3, what="3-D mean", reduction="mean")
    loss, _ = _compare(
        torch.float32, hidden3, weight, targets3.long(), what="3-D none", reduction="none", chunk_size=5
    )
    assert loss.shape == (3, 4)


# ------------------------------------------------------------------------------------------------------------
# Which gradients: tied, frozen; no-grad evaluation; the reference fallback
# ------------------------------------------------------------------------------------------------------------


def test_tied_weight_accumulates_both_uses():
    """The lm_head is the embedding matrix: its gradient is the embedding's plus the head's."""
    v, h = 257, 24
    gen = torch.Generator().manual_seed(12)
    table = (torch.randn(v, h, generator=gen) * 0.3).to(DEVICE)
    ids = torch.randint(0, v, (10,), generator=gen).to(DEVICE)
    targets = torch.randint(0, v, (10,), generator=gen).to(DEVICE)
    proj = (torch.randn(h, h, generator=gen) / h**0.5).to(DEVICE)
    grads = []
    for fn in (fused_linear_cross_entropy, fused_linear_cross_entropy_reference):
        emb = torch.nn.Embedding(v, h, device=DEVICE)
        with torch.no_grad():
            emb.weight.copy_(table)
        hidden = torch.tanh(emb(ids) @ proj)
        fn(hidden, emb.weight, targets, reduction="mean").backward()
        grads.append(emb.weight.grad)
    _check(grads[0], grads[1], 1e-5, "tied weight grad")
    head = table.clone().requires_grad_(True)
    head_only = torch.autograd.grad(
        fused_linear_cross_entropy_reference(torch.tanh(table[ids] @ proj), head, targets, reduction="mean"),
        head,
    )[0]
    assert _rel(grads[1], head_only) > 1e-2, "the embedding's share must be visible in the tied grad"


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_frozen_inputs_get_no_gradient(frozen, launches):
    hidden, weight, targets, _ = _inputs(5, 24, 257, torch.bfloat16, seed=13)
    h = hidden.clone().requires_grad_(frozen != "hidden")
    w = weight.clone().requires_grad_(frozen != "weight")
    loss = fused_linear_cross_entropy(h, w, targets)
    assert launches
    trained = w if frozen == "hidden" else h
    (grad,) = torch.autograd.grad(loss, trained)
    _, grads_ref = _run(
        fused_linear_cross_entropy_reference,
        hidden,
        weight,
        targets,
        grad_output=torch.tensor(1.0, device=DEVICE),
    )
    _check(grad, grads_ref[1 if frozen == "hidden" else 0], 2e-2, f"grad with frozen {frozen}")


def test_no_grad_evaluation_runs_losses_only(launches):
    hidden, weight, targets, _ = _inputs(6, 24, 257, torch.float32, seed=14, ignored=(1,))
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden.requires_grad_(), weight, targets, reduction="mean")
    assert loss.grad_fn is None and launches == [6]
    _check(
        loss, fused_linear_cross_entropy_reference(hidden, weight, targets, reduction="mean"), 1e-5, "eval"
    )


def test_reference_fallback_without_triton(monkeypatch, launches):
    if DEVICE != "cpu":
        pytest.skip("the fallback is for CPU tensors without the interpreter")
    monkeypatch.delenv("TRITON_INTERPRET")
    hidden, weight, targets, _ = _inputs(4, 24, 257, torch.float32, seed=15)
    loss, grads = _run(fused_linear_cross_entropy, hidden, weight, targets)
    assert not launches and loss.grad_fn.name() != f"{FusedLinearCrossEntropyFunction.__name__}Backward"
    loss_ref, grads_ref = _run(fused_linear_cross_entropy_reference, hidden, weight, targets)
    assert torch.equal(loss, loss_ref) and all(
        torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=False)
    )


def test_lm_head_loss_reads_weight_and_bias():
    head = torch.nn.Linear(24, 257, bias=True, device=DEVICE)
    hidden, _, targets, _ = _inputs(4, 24, 257, torch.float32, seed=16)
    loss = lm_head_loss(hidden, head, targets, reduction="mean")
    expected = fused_linear_cross_entropy_reference(
        hidden, head.weight, targets, bias=head.bias, reduction="mean"
    )
    _check(loss.detach(), expected.detach(), 1e-5, "lm_head_loss")
    loss.backward()
    assert head.weight.grad is not None and head.bias.grad is not None


def test_second_backward_through_the_same_graph_raises():
    """The stored gradients are scaled in place: a retained graph cannot be walked twice (silently wrong)."""
    hidden, weight, targets, _ = _inputs(3, 24, 257, torch.float32, seed=17)
    h = hidden.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_invalid_arguments_name_the_fix():
    hidden, weight, targets, _ = _inputs(3, 24, 257, torch.float32, seed=18)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="cast one"):
        fused_linear_cross_entropy(hidden, weight.to(torch.bfloat16), targets)
    with pytest.raises(ValueError, match="hidden size"):
        fused_linear_cross_entropy(hidden, weight[:, :20], targets)
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_cross_entropy(hidden, weight, targets[:2])
    with pytest.raises(ValueError, match="bias is"):
        fused_linear_cross_entropy(
            hidden, weight, targets, bias=torch.zeros(257, device=DEVICE, dtype=torch.float16)
        )
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_cross_entropy(hidden, weight, targets, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_size=0)


def test_empty_input_gives_zero_loss():
    hidden, weight, targets, _ = _inputs(0, 24, 257, torch.float32)
    loss, (d_hidden, d_weight) = _run(fused_linear_cross_entropy, hidden, weight, targets, reduction="mean")
    assert loss == 0 and d_hidden.shape == (0, 24) and (d_weight == 0).all()


def test_default_chunk_size_bounds_the_logits_bytes():
    """256 MiB of logits per chunk for a frozen head, 1 GiB for a trained one (fewer roundings of its
    gradient), rows balanced over the chunks (the memory math of the module docstring)."""
    assert default_chunk_size(16384, 128256, 2) == 1024  # 16 chunks of 1024 rows: 263 MB bf16 logits
    assert default_chunk_size(16384, 32001, 2) == 4096  # 4 chunks, 262 MB
    assert default_chunk_size(16384, 128256, 4) == 512  # fp32: 32 chunks
    assert default_chunk_size(16384, 128256, 2, weight_trained=True) == 4096  # 4 chunks, 1.05 GB
    assert default_chunk_size(16384, 32001, 2, weight_trained=True) == 16384  # one chunk, 1.05 GB
    assert default_chunk_size(3, 151936, 2) == 3
    for trained, budget in (
        (False, fused_linear_ce.LOGITS_CHUNK_BYTES),
        (True, fused_linear_ce.TRAINED_WEIGHT_CHUNK_BYTES),
    ):
        for n, v, size in ((16384, 128256, 2), (10000, 151936, 2), (5, 10**9, 4)):
            rows = default_chunk_size(n, v, size, weight_trained=trained)
            assert rows * v * size <= max(budget, v * size)
            assert triton.cdiv(n, rows) == triton.cdiv(n, max(1, budget // (v * size)))


# ------------------------------------------------------------------------------------------------------------
# GPU (H200): full-size vocab against fp32, no host sync, memory and time against eager
# ------------------------------------------------------------------------------------------------------------


def _eager(hidden, weight, targets, bias=None, **_):
    """What transformers does: 16-bit logits, then ``F.cross_entropy(logits.float())``."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [None, 1024])
@pytest.mark.parametrize("n", [3, 4096])
@pytest.mark.parametrize("vocab", [32001, 128256])
def test_gpu_bf16_against_fp32(vocab, n, chunk_size):
    hidden, weight, targets, _ = _inputs(
        n, 4096, vocab, torch.bfloat16, seed=20, logit_scale=3.0, ignored=(1,)
    )
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in forward or backward raises
    try:
        loss = fused_linear_cross_entropy(h, w, targets, reduction="mean", chunk_size=chunk_size)
        d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.grad_fn.name() == f"{FusedLinearCrossEntropyFunction.__name__}Backward"
    loss_ref, (dh_ref, dw_ref) = _run(
        fused_linear_cross_entropy_reference,
        hidden.float(),
        weight.float(),
        targets,
        reduction="mean",
        grad_output=torch.tensor(1.0, device=DEVICE),
    )
    what = f"V={vocab} N={n} chunk={chunk_size}"
    _check(loss, loss_ref, 2e-2, f"loss {what}")
    _check(d_hidden, dh_ref, 2e-2, f"d_hidden {what}")
    _check(d_weight, dw_ref, 2e-2, f"d_weight {what}")


def _peak_extra_bytes(fn) -> int:
    """Peak allocated bytes beyond what was allocated before ``fn`` (inputs, cuBLAS workspace)."""
    fn()  # warm-up: Triton compile, cuBLAS workspace
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("train_weight", [False, True])
def test_gpu_memory_one_eighth_of_eager(train_weight):
    """16384 tokens x vocab 128256 x hidden 4096, bf16: the fused path's peak extra memory (forward and
    backward, gradients included) is at most 1/8 of eager's (~25 GB eager; ~1.2 GB fused, ~2.3 GB with
    dW)."""
    hidden, weight, targets, _ = _inputs(16384, 4096, 128256, torch.bfloat16, seed=21)
    h = hidden.requires_grad_(True)
    w = weight.requires_grad_(train_weight)
    leaves = (h, w) if train_weight else (h,)

    def step(fn):
        return lambda: torch.autograd.grad(fn(h, w, targets), leaves)

    extra = {
        name: _peak_extra_bytes(step(fn))
        for name, fn in (("fused", fused_linear_cross_entropy), ("eager", _eager))
    }
    print(
        f"\npeak extra (train_weight={train_weight}): fused {extra['fused'] / 2**30:.2f} GiB, eager {extra['eager'] / 2**30:.2f} GiB"
    )
    assert extra["fused"] <= extra["eager"] / 8


@pytest.mark.gpu
@pytest.mark.parametrize("train_weight", [False, True])
def test_gpu_time_not_slower_than_eager(train_weight):
    hidden, weight, targets, _ = _inputs(16384, 4096, 128256, torch.bfloat16, seed=22)
    h = hidden.requires_grad_(True)
    w = weight.requires_grad_(train_weight)
    leaves = (h, w) if train_weight else (h,)
    ms = {
        name: triton.testing.do_bench(lambda fn=fn: torch.autograd.grad(fn(h, w, targets), leaves))
        for name, fn in (("fused", fused_linear_cross_entropy), ("eager", _eager))
    }
    print(
        f"\nforward + backward (train_weight={train_weight}): fused {ms['fused']:.1f} ms, eager {ms['eager']:.1f} ms"
    )
    assert ms["fused"] <= ms["eager"]
