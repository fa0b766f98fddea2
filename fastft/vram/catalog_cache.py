"""The inventories of the embedded presets and the catalog models, built once on the meta device and shipped
as data.

Building a model on the meta device needs torch and transformers (seconds to import) and the build itself
(seconds more for a 70B model), so ``fastft estimate meta-llama/Llama-3.1-8B-Instruct`` took 12 s of which
the arithmetic is milliseconds. The inventories of every preset (`fastft.models.presets`) and catalog entry
(`fastft.models.catalog`) are therefore written to ``assets/catalog_inventories.json.gz`` by
``python -m fastft.vram.catalog_cache`` and read back here.

Each entry carries a fingerprint of its spec (model type and config), so an entry whose spec has changed
since is never used: the estimate then builds the model as before. `tests/tools/test_vram_cache.py` checks that
every preset and catalog entry has a current entry, and that rebuilt inventories equal the stored ones.
The file records the transformers version it was built with; the shapes of these architectures do not
change between versions, and a loaded model is always walked as it is.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from dataclasses import fields, replace
from pathlib import Path

from fastft.vram.inventory import LayerInfo, LinearInfo, ModelInventory

CACHE_FILE = Path(__file__).parent / "assets" / "catalog_inventories.json.gz"
_LINEAR_FIELDS = [f.name for f in fields(LinearInfo)]
_LAYER_FIELDS = [f.name for f in fields(LayerInfo) if f.name != "linears"]
_SCALAR_FIELDS = [f.name for f in fields(ModelInventory) if f.name not in ("linears", "layers", "loaded")]


def known_models() -> list[str]:
    """The names the cache holds: every preset, then every catalog architecture entry (a base or instruct
    variant is served from its entry's, `cached_inventory`)."""
    from fastft.models.catalog import architectures
    from fastft.models.presets import PRESETS

    return [*PRESETS, *(spec.hub_id for spec in architectures())]


def fingerprint(name: str) -> str:
    """A digest of the spec of preset or catalog model `name`: what its inventory is built from."""
    from fastft.models.catalog import CATALOG
    from fastft.models.presets import PRESETS

    if name in PRESETS:
        preset = PRESETS[name]
        spec = {"model_type": preset.model_type, "config": preset.config, "vocab": preset.vocab_size}
    else:
        spec = {"model_type": CATALOG[name].model_type, "config": CATALOG[name].config}
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def inventory_to_dict(inventory: ModelInventory) -> dict:
    """`inventory` as JSON-ready data; linears are rows of `LinearInfo`'s fields, stored once (a layer's
    linears are the rows with its index, in order, as `fastft.vram.inventory._layers` groups them)."""
    assert inventory.loaded is None, "only inventories built on the meta device are cached"
    return {
        **{name: getattr(inventory, name) for name in _SCALAR_FIELDS},
        "linears": [[getattr(linear, name) for name in _LINEAR_FIELDS] for linear in inventory.linears],
        "layers": [[getattr(layer, name) for name in _LAYER_FIELDS] for layer in inventory.layers],
    }


def inventory_from_dict(data: dict) -> ModelInventory:
    linears = tuple(LinearInfo(**dict(zip(_LINEAR_FIELDS, row, strict=True))) for row in data["linears"])
    by_layer: dict[int, list[LinearInfo]] = {}
    for linear in linears:
        if linear.layer is not None:
            by_layer.setdefault(linear.layer, []).append(linear)
    layers = []
    for row in data["layers"]:
        values = dict(zip(_LAYER_FIELDS, row, strict=True))
        layers.append(LayerInfo(linears=tuple(by_layer.get(values["index"], ())), **values))
    return ModelInventory(
        **{name: data[name] for name in _SCALAR_FIELDS}, linears=linears, layers=tuple(layers), loaded=None
    )


@functools.lru_cache(maxsize=1)
def _entries() -> dict:
    if not CACHE_FILE.exists():
        return {}
    with gzip.open(CACHE_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)["models"]


def cached_inventory(name: str) -> ModelInventory | None:
    """The stored inventory of preset or catalog model `name`, or None when there is none for its spec. A
    catalog variant gets its entry's, under its own name and stated context (`VARIANT_FIELDS`)."""
    from fastft.models.catalog import CATALOG

    variant = CATALOG[name] if name in CATALOG and CATALOG[name].variant_of else None
    stored = variant.variant_of if variant is not None else name
    entry = _entries().get(stored)
    if entry is None or entry["fingerprint"] != fingerprint(stored):
        return None
    inventory = inventory_from_dict(entry["inventory"])
    if variant is not None:
        positions = variant.config.get("max_position_embeddings", inventory.max_position_embeddings)
        inventory = replace(inventory, name=name, max_position_embeddings=positions)
    return inventory


def build_inventory(name: str) -> ModelInventory:
    """`name`'s inventory built on the meta device (what the cache stores; needs torch and transformers)."""
    from fastft.models.catalog import CATALOG
    from fastft.models.presets import PRESETS
    from fastft.vram.inventory import _inventory_of_config

    if name in PRESETS:
        return _inventory_of_config(PRESETS[name].make_config(PRESETS[name].vocab_size), name)
    return _inventory_of_config(CATALOG[name].to_config(), name)


def write_cache(path: Path = CACHE_FILE) -> None:
    """Rebuild every preset's and catalog model's inventory and write the cache (after editing either)."""
    import transformers

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


if __name__ == "__main__":
    write_cache()
    print(f"wrote {CACHE_FILE}")
