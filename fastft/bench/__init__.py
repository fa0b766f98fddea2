"""Benchmarks behind `fastft bench NAME`: fastft beside its baselines in one process, as ratios."""

BENCHMARKS = {
    "packing": "fastft.bench.packing",
    "step": "fastft.bench.step",
    "sft": "fastft.bench.sft",
    "dpo": "fastft.bench.dpo",
    "offload": "fastft.bench.offload",
    "kernels": "fastft.bench.kernels",
    "vram": "fastft.bench.vram",
    "convergence": "fastft.bench.convergence",
    "profiler": "fastft.bench.profiler",
    "moe": "fastft.bench.moe",
    "attention": "fastft.bench.attention",
    "export_rss": "fastft.bench.export_rss",
    "long-context": "fastft.bench.long_context",
    "ddp": "fastft.bench.ddp",
    "grpo": "fastft.bench.grpo",
    "fp8-error": "fastft.bench.fp8_error",
    "fp8-quality": "fastft.bench.fp8_quality",
}
