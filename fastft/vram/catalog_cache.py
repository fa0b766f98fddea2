"""The inventories of the embedded presets and the catalog models, built once on the meta device and shipped
as data.

Building a model on the meta device needs torch and transformers (seconds to import) and the build itself
(seconds more for a 70B model), so ``fastft estimate meta-llama/Llama-3.1-8B-Instruct`` took 12 s of which
the arithmetic is milliseconds. The inventories of every preset (`fastft.models.presets`) and catalog entry
(`fastft.models.catalog`) are therefore written to ``assets/catalog_inventories.json.gz`` by
``python -m fastft.vram.catalog_cache`` and read back by `fastft.vram.inventory.cached_inventory`.

Each entry carries a fingerprint of its spec (model type and config), so an entry whose spec has changed
since is never used: the estimate then builds the model as before. `tests/tools/test_vram_cache.py` checks that
every preset and catalog entry has a current entry, and that rebuilt inventories equal the stored ones.
The file records the transformers version it was built with; the shapes of these architectures do not
change between versions, and a loaded model is always walked as it is.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import transformers

from fastft.models.catalog import CATALOG, architectures
from fastft.models.presets import PRESETS
from fastft.vram.inventory import (
    CACHE_FILE,
    ModelInventory,
    _entries,
    _inventory_of_config,
    cached_inventory,
    fingerprint,
    inventory_from_dict,
    inventory_to_dict,
)


def known_models() -> list[str]:
    """The names the cache holds: every preset, then every catalog architecture entry (a base or instruct
    variant is served from its entry's, `cached_inventory`)."""

    return [*PRESETS, *(spec.hub_id for spec in architectures())]


def build_inventory(name: str) -> ModelInventory:
    """`name`'s inventory built on the meta device (what the cache stores; needs torch and transformers)."""

    if name in PRESETS:
        return _inventory_of_config(PRESETS[name].make_config(PRESETS[name].vocab_size), name)
    return _inventory_of_config(CATALOG[name].to_config(), name)


def write_cache(path: Path = CACHE_FILE) -> None:
    """Rebuild every preset's and catalog model's inventory and write the cache (after editing either)."""

    models = {
        name: {"fingerprint": fingerprint(name), "inventory": inventory_to_dict(build_inventory(name))}
        for name in known_models()
    }
    data = {"transformers": transformers.__version__, "models": models}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(gzip.compress(text.encode(), mtime=0))  # mtime=0: the same catalog, the same bytes
    temporary.replace(path)
    _entries.cache_clear()


__all__ = [
    "build_inventory",
    "cached_inventory",
    "inventory_from_dict",
    "inventory_to_dict",
    "known_models",
    "write_cache",
]

if __name__ == "__main__":
    write_cache()
    print(f"wrote {CACHE_FILE}")
