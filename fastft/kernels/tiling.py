"""When the fused gated MLP runs over the sequence in tiles, how many rows a tile holds, and the fused
kernels' other memory switches (the untiled backward's ``dh`` slices, the adapters' compute copies).

Plain arithmetic, no torch: `fastft.kernels.lora` decides with it at each call, and the VRAM estimator
(`fastft.vram`) counts the same tiles, on machines without torch's CUDA build too.

A gated MLP's working set is ``[N, I]`` tensors: the gate and up outputs it saves, ``act(g) * u``, and in
backward ``dh``. At long context they are the largest tensors of a step: Llama-3.1-8B at 88,064 tokens
holds three of 2.5 GB each while one layer runs its backward, more than the whole offloaded residual
stream's device buffers. Every MLP op is per token, so tiling the rows is exact: the tiled function
(`fastft.kernels.lora.LoraTiledMLPFunction`) saves only its input and recomputes each tile's gate and up
outputs in backward, which under activation checkpointing is no extra work (the recompute that would have
computed them is skipped; see its docstring).

Short sequences are untouched: a call tiles only when one ``[N, I]`` tensor would exceed
``TILE_FROM_BYTES`` (256 MiB: Llama-3.1-8B from 9,363 tokens on; 2 x 2,048 tokens are 117 MB). A tile's
``[rows, I]`` tensors take at most ``TILE_BYTES`` (256 MiB) each, balanced over the tiles (same-sized tiles
reuse the same allocator blocks) and a multiple of 64 rows.

Tiling starts where a tile would be as large as the untiled tensor: larger ``[N, I]`` blocks are what PyTorch's
default caching allocator could not place in step 1 of a fresh process. Under a cap it held free memory
as fragments smaller than the MLP's next ``[N, I]`` request (BENCHMARKS.md, "Long context under a cap";
docs/journal.md, "Design history", "The allocator").
"""

from __future__ import annotations

# Whether `fastft.patch` keeps 16-bit compute copies of the adapters (`fastft.kernels.lora.AdapterComputeCopies`,
# read when a model is patched): one multi-tensor cast of every adapter per step instead of about 28 small
# casts per decoder layer, for 2 bytes per adapter parameter held through the step. Off by default: the
# copies buy a fraction of a percent of a graphed step for more peak memory than the bf16 `fastft bench sft`
# row has to spare (`fastft bench sft --adapter-copies on|off` is the A/B; the readings: docs/journal.md, "Measurements once quoted in code comments").
# Here, not in `fastft.models.patch`, so that the VRAM estimator reads it without torch.
ADAPTER_COMPUTE_COPIES = False
TILE_BYTES = 256 << 20
TILE_FROM_BYTES = TILE_BYTES
TILE_ROW_MULTIPLE = 64
# The untiled MLP's backward makes its ``dh`` (``[N, I]``, the gradient at the activation's output) in row
# slices of at most this many bytes: each slice is consumed at once by the activation's backward, which
# writes ``dg``/``du`` over the saved ``g``/``u``. The untiled backward then holds two ``[N, I]`` tensors
# where it held three. Its price in speed is within the noise between processes (BENCHMARKS.md, "No
# regression on uniform tokens"; the runs before it in docs/journal.md). `fastft bench step|sft
# --dh-slice-mib N` (0: whole) is the A/B, and `benchmarks/scripts/step_ab.py` the way to read a percent.
DH_SLICE_BYTES = 32 << 20


def mlp_tile_rows(rows: int, intermediate: int, element_size: int) -> int | None:
    """Rows per tile for a gated MLP over `rows` tokens with `intermediate` columns of `element_size` bytes;
    None when the call runs untiled."""
    if rows * intermediate * element_size <= TILE_FROM_BYTES:
        return None
    most = max(TILE_ROW_MULTIPLE, TILE_BYTES // (intermediate * element_size))
    tiles = -(-rows // most)
    per_tile = -(-rows // tiles)
    return -(-per_tile // TILE_ROW_MULTIPLE) * TILE_ROW_MULTIPLE


def dh_slice_rows(rows: int, intermediate: int, element_size: int) -> int:
    """Rows per slice of the untiled backward's ``dh`` (`DH_SLICE_BYTES`, balanced, a multiple of 64 rows;
    all `rows` when one slice holds them)."""
    most = max(TILE_ROW_MULTIPLE, DH_SLICE_BYTES // (intermediate * element_size))
    if rows <= most:
        return rows
    slices = -(-rows // most)
    per_slice = -(-rows // slices)
    return -(-per_slice // TILE_ROW_MULTIPLE) * TILE_ROW_MULTIPLE


def mlp_tile_bytes(rows: int, intermediate: int, element_size: int) -> int:
    """Bytes of the ``[tile, I]`` working set a tiled MLP holds at once (three tensors: gate and up outputs,
    and ``dh`` in backward or ``act(g) * u`` in the forward); 0 when untiled."""
    tile = mlp_tile_rows(rows, intermediate, element_size)
    return 0 if tile is None else 3 * tile * intermediate * element_size


__all__ = [
    "DH_SLICE_BYTES",
    "TILE_BYTES",
    "TILE_FROM_BYTES",
    "dh_slice_rows",
    "mlp_tile_bytes",
    "mlp_tile_rows",
]
