"""Datasets: formats, loading, tokenisation with response-only labels, packing, `PackedBatch`."""
