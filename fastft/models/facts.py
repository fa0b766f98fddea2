"""What is known of a model before it is loaded: `ModelFacts` of a preset, a catalog entry or a local folder
(shapes, parameters, what the fusion plan fuses) and the names to offer, read offline. The studio shows them
(`fastft.studio.facts_html`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastft.models.catalog import CATALOG, ModelSpec
from fastft.models.fusion import plan
from fastft.models.presets import PRESETS

__all__ = ["ModelFacts", "model_choices", "model_facts"]


@dataclass
class ModelFacts:
    """What the picker knows about a model before loading it (nothing downloaded)."""

    name: str
    source: str  # "preset", "catalog", "local", "hub" or "unknown"
    model_type: str | None = None
    description: str = ""
    parameters: int | None = None
    active_parameters: int | None = None
    layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    experts: int = 0
    context: int | None = None
    gated: bool = False
    fused: list[str] = field(default_factory=list)
    not_fused: list[str] = field(default_factory=list)

    @property
    def all_fused(self) -> bool:
        """Whether every part of the model gets fastft's fused kernels."""
        return bool(self.fused) and not self.not_fused


def model_choices() -> list[str]:
    """Embedded presets first, then the catalog's hub ids: what the picker suggests."""

    return [*PRESETS, *CATALOG]


def model_facts(name: str) -> ModelFacts:
    """Describe `name` (a preset, a catalog hub id, a local folder or another hub id) offline."""

    name = name.strip()
    if name in PRESETS:
        preset = PRESETS[name]
        config = dict(preset.config, vocab_size=preset.vocab_size, max_position_embeddings=4096)
        spec = ModelSpec(name, preset.model_type, preset.model_type, config, gated=False)
        return _facts_from_spec(spec, "preset", preset.description)
    if name in CATALOG:
        spec = CATALOG[name]
        return _facts_from_spec(spec, "catalog", spec.notes)
    path = Path(name).expanduser()
    if name and path.is_dir():
        return _facts_from_folder(name, path)
    if _looks_like_hub_id(name):
        return ModelFacts(name, "hub", description="a Hugging Face hub id not in the catalog")
    return ModelFacts(name, "unknown")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _facts_from_spec(spec, source: str, description: str) -> ModelFacts:
    config = spec.config
    facts = ModelFacts(
        spec.hub_id,
        source,
        spec.model_type,
        description,
        parameters=spec.parameter_count(),
        active_parameters=spec.active_parameter_count() if spec.is_moe else None,
        layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        experts=spec.num_experts,
        context=config.get("max_position_embeddings"),
        gated=spec.gated,
    )
    facts.fused, facts.not_fused = _fusion({**config, "model_type": spec.model_type})
    return facts


def _facts_from_folder(name: str, path: Path) -> ModelFacts:
    facts = ModelFacts(name, "local", description="a local folder")
    try:
        from transformers import AutoConfig

        from fastft.models.remote_code import from_pretrained

        config = from_pretrained(AutoConfig, str(path), name).to_dict()  # never the folder's own code
    except Exception as error:  # noqa: BLE001 - shown as a note; Load reports the real error
        facts.description = f"a local folder whose config could not be read ({type(error).__name__})"
        return facts

    facts.model_type = config.get("model_type")
    facts.layers = config.get("num_hidden_layers")
    facts.hidden_size = config.get("hidden_size")
    facts.vocab_size = config.get("vocab_size")
    facts.context = config.get("max_position_embeddings")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    facts.experts = experts
    try:
        facts.parameters = ModelSpec(name, "", facts.model_type, config, gated=False).parameter_count()
    except (KeyError, TypeError, ValueError):
        facts.parameters = None  # an architecture the catalog's formula does not cover: counted on Load
    facts.fused, facts.not_fused = _fusion(config)
    return facts


def _fusion(config: dict) -> tuple[list[str], list[str]]:
    """(parts on fused kernels, parts left on transformers' modules): the config's fusion plan, which
    `fastft.patch` follows."""

    fusion = plan(config)
    return list(fusion.fused), list(fusion.not_fused)
