"""`fastft bench attention`: the attention kernels a packed bin can run on, on this GPU, forward and
forward + backward, for the bins fastft trains on.

Each case is a bin of sequence lengths with ``q_heads / kv_heads`` (GQA) of ``--head-dim``, bf16 on a GPU
(fp32 on the CPU), q / k / v ``[tokens, heads, dim]`` as a projection gives them. Methods:

- ``fastft``: `fastft.runtime.attention.packed_attention` with the backend ``auto`` resolves to (``varlen`` on a
  GPU: FA2 varlen for a ragged bin, one batched causal SDPA call for an equal-length one; ``sdpa_masked`` on
  the CPU).
- ``fa2_varlen``: ``torch.nn.attention.varlen.varlen_attn`` on every bin (CUDA).
- ``sdpa_<kernel>``: equal-length bins only, ``[n, heads, len, dim]`` causal SDPA pinned to one kernel
  (``flash``, ``cudnn``, ``efficient``; CUDA) or left to PyTorch (``default``), GQA by ``enable_gqa``.
- ``sdpa_segments``: fastft's causal SDPA per sequence (any device).

Times are the median of ``--reps`` calls (`fastft.bench.common.time_calls`: CUDA events, perf_counter on the CPU); ``max_diff`` is the
largest absolute difference of the output and of the gradients from the case's first method.

    fastft bench attention --cases 2x2048:32/8,2x2048:32/4,1x16384:32/8,ragged8192:32/8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable

import torch

from fastft.bench.common import environment, markdown_table, time_calls
from fastft.bench.harness import save_record
from fastft.data.batch import PackedBatch
from fastft.runtime.attention import _sdpa_uniform, packed_attention

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

DEFAULT_CASES = "2x2048:32/8,2x2048:32/4,1x16384:32/8,ragged8192:32/8"
SDPA_KERNELS = ("flash", "cudnn", "efficient", "default")


def parse_case(text: str, seed: int = 0) -> tuple[str, list[int], int, int]:
    """``NxLEN:Q/KV`` (N sequences of LEN tokens) or ``raggedTOTAL:Q/KV`` (chat-length sequences of 100 to
    1,500 tokens filling TOTAL, the last one taking the rest) -> ``(label, lengths, q_heads, kv_heads)``."""
    try:
        bin_text, heads = text.split(":")
        q_heads, kv_heads = (int(h) for h in heads.split("/"))
        if bin_text.startswith("ragged"):
            total = int(bin_text[len("ragged") :])
            generator = torch.Generator().manual_seed(seed)
            lengths: list[int] = []
            while sum(lengths) < total - 1600:
                lengths.append(int(torch.randint(100, 1500, (1,), generator=generator)))
            lengths.append(total - sum(lengths))
        else:
            count, length = (int(v) for v in bin_text.split("x"))
            lengths = [length] * count
    except ValueError as error:
        raise ValueError(f"bad case {text!r}: use NxLEN:Q/KV (2x2048:32/8) or raggedTOTAL:Q/KV") from error
    if q_heads % kv_heads or min(lengths) < 1:
        raise ValueError(f"bad case {text!r}: q heads must be a multiple of kv heads, lengths positive")
    return text, lengths, q_heads, kv_heads


def _methods(lengths: list[int], scale: float, cuda: bool, batch) -> dict[str, Callable]:
    """name -> ``f(q, k, v) -> [T, q heads, dim]`` for q / k / v ``[T, heads, dim]``."""

    uniform = len(set(lengths)) == 1
    length = lengths[0]
    methods: dict[str, Callable] = {}

    def packed(backend: str) -> Callable:
        def run(q, k, v):
            heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, T, dim] views
            return packed_attention(*heads_first, batch, backend, scaling=scale)[0]

        return run

    methods["fastft"] = packed("varlen" if cuda else "sdpa_masked")  # what "auto" resolves to
    if cuda:
        from torch.nn.attention.varlen import varlen_attn

        def fa2(q, k, v):
            return varlen_attn(
                q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen, scale=scale
            )

        methods["fa2_varlen"] = fa2
    if uniform:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pinned = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
        }

        def batched(backend) -> Callable:  # fastft's equal-length path, with the SDPA kernel pinned or not
            def run(q, k, v):
                heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
                with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
                    return _sdpa_uniform(*heads_first, length, scale)[0]

            return run

        for name in SDPA_KERNELS if cuda else ("default",):
            methods[f"sdpa_{name}"] = batched(pinned.get(name))
    methods["sdpa_segments"] = packed("sdpa_segments")
    return methods


def _median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(time_calls(fn, device, reps))


def _time_method(method, qkv, inputs, upstream, device: torch.device, warmup: int, reps: int) -> dict:
    with torch.no_grad():
        forward_ms = _median_ms(lambda: method(*qkv), device, warmup, reps)

    def forward_backward():
        torch.autograd.grad(method(*inputs), inputs, upstream)

    return {
        "forward_ms": forward_ms,
        "forward_backward_ms": _median_ms(forward_backward, device, warmup, reps),
    }


def bench_case(case: str, head_dim: int, device: torch.device, warmup: int, reps: int) -> list[dict]:
    label, lengths, q_heads, kv_heads = parse_case(case)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    total = sum(lengths)
    ids = [torch.zeros(n, dtype=torch.int64).numpy() for n in lengths]
    batch = PackedBatch.from_sequences(ids, ids).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(total, h, head_dim, device=device, dtype=dtype, generator=generator)
        for h in (q_heads, kv_heads, kv_heads)
    )
    upstream = torch.randn(total, q_heads, head_dim, device=device, dtype=dtype, generator=generator)
    rows, reference = [], None
    for name, method in _methods(lengths, head_dim**-0.5, cuda, batch).items():
        row = {"case": label, "method": name, "sequences": len(lengths), "tokens": total}
        try:
            inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = method(*inputs)
            grads = torch.autograd.grad(out, inputs, upstream)
            if reference is None:
                reference = (out.detach().float(), [g.float() for g in grads])
            row["max_diff"] = max(
                float((a.float() - b).abs().max())
                for a, b in zip([out.detach(), *grads], [reference[0], *reference[1]], strict=True)
            )
            row.update(_time_method(method, (q, k, v), inputs, upstream, device, warmup, reps))
        except Exception as error:  # one kernel that does not run here must not lose the others
            row["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        rows.append(row)
    fastest = min((r["forward_backward_ms"] for r in rows if "forward_backward_ms" in r), default=None)
    for row in rows:
        if fastest and "forward_backward_ms" in row:
            row["time_vs_fastest"] = row["forward_backward_ms"] / fastest
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastft bench attention", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default=DEFAULT_CASES, help="comma-separated NxLEN:Q/KV or raggedTOTAL:Q/KV"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/attention.json")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for case in args.cases.split(","):
        rows.extend(bench_case(case.strip(), args.head_dim, device, args.warmup, args.reps))
    columns = [
        ("case", "bin:heads"),
        ("method", "method"),
        ("forward_ms", "forward ms"),
        ("forward_backward_ms", "fwd + bwd ms"),
        ("time_vs_fastest", "fwd + bwd / fastest"),
        ("max_diff", "max abs diff"),
        ("error", "error"),
    ]
    table = markdown_table(rows, columns)
    print(table)
    result = {"benchmark": "attention", "environment": environment(), "head_dim": args.head_dim, "rows": rows}
    save_record(args.out, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
