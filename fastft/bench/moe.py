"""`fastft bench moe`: one mixture-of-experts block alone, forward + backward, fastft beside transformers.

The first decoder layer of a catalog MoE architecture (default Qwen3-30B-A3B: 128 experts, top-8, hidden
2048, expert width 768) with random bf16 weights and LoRA r=16 through `fastft.add_lora`, in three ways:

* ``fastft``: the fused block (one routing plan, Triton grouped GEMMs, expert LoRA as grouped low-rank GEMMs);
* ``transformers grouped_mm``: `add_lora(fused=False)`, transformers' default ``grouped_mm`` experts (and PEFT's
  ``ParamWrapper``, which materialises W + dW per expert, when the experts carry LoRA);
* ``transformers loop``: the same with ``experts_implementation="eager"``, the per-expert Python loop.

Each for LoRA on the experts (``experts``) and with frozen experts (``attention``: the block's LoRA-free case,
its input gradient only). Timed per call with CUDA events (perf_counter on a CPU) after warm-up: the block's
forward and backward on ``tokens`` random hidden states. Also the routing plan alone (router logits to
sorted slots and offsets): what building it once per layer costs, and what building it again for each of
the four consumers that read it (gate/up GEMM, down GEMM, the expert LoRA GEMMs, backward) would add.

    fastft bench moe --model Qwen/Qwen3-30B-A3B --tokens 4096
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import torch

from fastft.bench.common import environment, environment_line, markdown_table, time_calls
from fastft.bench.harness import report_parser
from fastft.models.catalog import CATALOG
from fastft.models.lora import add_lora
from fastft.models.patch import UnfusedWarning
from fastft.models.presets import PRESETS
from fastft.models.random_model import random_model

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

WAYS = ("fastft", "transformers grouped_mm", "transformers loop")
TARGETS = {"experts": ["q_proj", "k_proj", "v_proj", "o_proj", "experts"], "attention": ["q_proj", "v_proj"]}
PLAN_CONSUMERS = 4  # gate/up GEMM, down GEMM, expert LoRA GEMMs, backward


def _block(model_name: str, way: str, targets: str, device: torch.device, dtype: torch.dtype, lora_r: int):
    """The MoE block of layer 0 of a one-layer cut of `model_name`, with LoRA, as `way` runs it."""

    torch.manual_seed(0)
    # the block alone: a small embedding and head keep memory for the experts
    cut = {} if model_name in PRESETS else {"num_hidden_layers": 1, "vocab_size": 128}
    model = random_model(model_name, device, dtype, **cut)
    if way == "transformers loop":
        model.config._experts_implementation = "eager"
        for module in model.modules():
            if hasattr(module, "config") and hasattr(module, "gate_up_proj"):
                module.config._experts_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        model = add_lora(
            model, r=lora_r, alpha=lora_r, target_modules=TARGETS[targets], fused=way == "fastft", seed=1
        )
    layer = model.get_base_model().model.layers[0]
    return model, layer.mlp


def measure_block(
    model_name: str,
    way: str,
    targets: str,
    tokens: int,
    warmup: int = 3,
    reps: int = 10,
    lora_r: int = 16,
    device: torch.device | None = None,
) -> dict:
    """Median ms of the block's forward, and of forward + backward, for one way and LoRA target set."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, block = _block(model_name, way, targets, device, dtype, lora_r)
    hidden = model.config.hidden_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    trainable = [p for p in block.parameters() if p.requires_grad]

    def output():
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    def forward():
        with torch.no_grad():
            output()

    def forward_backward():
        torch.autograd.grad(output(), [x, *trainable], dy)

    time_calls(forward_backward, device, warmup)
    fb = time_calls(forward_backward, device, reps)
    fwd = time_calls(forward, device, reps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    else:
        peak = None
    with torch.no_grad():
        reference = output().float()
    return {
        "way": way,
        "lora": targets,
        "tokens": tokens,
        "forward_ms": statistics.median(fwd),
        "forward_backward_ms": statistics.median(fb),
        "peak_extra_gib": peak,
        "trainable_in_block": sum(p.numel() for p in trainable),
        "_output": reference,
    }


def measure_routing(model_name: str, tokens: int, reps: int = 20, device: torch.device | None = None) -> dict:
    """The routing plan alone: router GEMM + top-k + sort + offsets, once per layer vs once per consumer."""
    from fastft.runtime.routing import build_routing_plan, router_spec

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if model_name in PRESETS:
        from fastft.models.loading import load_model

        config = load_model(model_name)[0].config
    else:
        config = CATALOG[model_name].to_config()
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, config.hidden_size, generator=generator).to(device=device, dtype=dtype)
    router = torch.randn(experts, config.hidden_size, generator=generator).to(device=device, dtype=dtype)
    spec = router_spec(config)

    def plan():
        return build_routing_plan(x @ router.t(), spec)

    time_calls(plan, device, 3)
    once = statistics.median(time_calls(plan, device, reps))
    return {
        "tokens": tokens,
        "experts": experts,
        "top_k": config.num_experts_per_tok,
        "plan_ms": once,
        "plan_per_consumer_ms": PLAN_CONSUMERS * once,
        "saved_by_reuse_ms": (PLAN_CONSUMERS - 1) * once,
    }


def run(
    model_name: str, tokens: int, ways=WAYS, targets=tuple(TARGETS), warmup: int = 3, reps: int = 10
) -> dict:
    rows = []
    outputs: dict[str, torch.Tensor] = {}
    for target in targets:
        for way in ways:
            try:
                row = measure_block(model_name, way, target, tokens, warmup, reps)
            except Exception as error:  # a way this machine cannot run is reported, the others still run
                rows.append({"way": way, "lora": target, "tokens": tokens, "status": f"error: {error}"[:300]})
                continue
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            out = row.pop("_output")
            first = outputs.setdefault(target, out)
            row["max_abs_diff_vs_first"] = float((out - first).abs().max())
            row["status"] = "ok"
            rows.append(row)
            print(
                f"  {target:>9} {way:<24} fwd {row['forward_ms']:8.3f} ms  fwd+bwd {row['forward_backward_ms']:8.3f} ms",
                flush=True,
            )
    for target in targets:
        base = next(
            (r for r in rows if r["lora"] == target and r["way"] == "fastft" and r["status"] == "ok"), None
        )
        for row in rows:
            if base is not None and row["lora"] == target and row["status"] == "ok":
                row["vs_fastft"] = row["forward_backward_ms"] / base["forward_backward_ms"]
    return {
        "benchmark": "moe",
        "model": model_name,
        "environment": environment(),
        "rows": rows,
        "routing": measure_routing(model_name, tokens),
    }


COLUMNS = [
    ("lora", "LoRA on"),
    ("way", "MoE block"),
    ("forward_ms", "forward ms"),
    ("forward_backward_ms", "fwd + bwd ms"),
    ("vs_fastft", "time / fastft"),
    ("peak_extra_gib", "peak extra GiB"),
    ("max_abs_diff_vs_first", "max |out − fastft|"),
    ("status", "status"),
]


def report(result: dict) -> str:
    env, routing = result["environment"], result["routing"]
    head = (
        f"MoE block alone — {result['model']} layer 0, {routing['tokens']} tokens, LoRA r=16; "
        f"{environment_line(env, 'torch', 'transformers')}\n\n"
    )
    tail = (
        f"\n\nRouting plan ({routing['experts']} experts, top-{routing['top_k']}): {routing['plan_ms']:.3f} ms once "
        f"per layer; built again for each of its {PLAN_CONSUMERS} consumers it would cost "
        f"{routing['plan_per_consumer_ms']:.3f} ms ({routing['saved_by_reuse_ms']:.3f} ms saved per layer forward)."
    )
    return head + markdown_table(result["rows"], COLUMNS) + tail


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("moe", __doc__)
    parser.add_argument(
        "--model", default="Qwen/Qwen3-30B-A3B", help="catalog MoE architecture or MoE preset"
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, from {', '.join(WAYS)}")
    parser.add_argument("--lora", default="experts,attention", help="experts and/or attention")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error(f"unknown ways {unknown}; choose from {', '.join(WAYS)}")
    targets = [t.strip() for t in args.lora.split(",") if t.strip()]
    result = run(args.model, args.tokens, ways, targets, args.warmup, args.reps)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    return 0
