"""The studio's view of `fastft.models.facts`: a model's facts as HTML, and the texts the model panel shows."""

from __future__ import annotations

import html

from fastft.models.catalog import close_names
from fastft.models.facts import ModelFacts, model_choices
from fastft.studio.notices import (
    facts_table,
    status_html,
)


def parameter_count_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}".replace(".00 ", " ")
    return str(n)


def facts_html(facts: ModelFacts) -> str:
    name = html.escape(facts.name or "(nothing)")
    if facts.source == "unknown":
        return status_html(unknown_model_hint(facts.name), "warn")
    if facts.source == "hub":
        return status_html(
            f"<b>{name}</b>: a hub id not in the catalog. Its config and weights are read when you click "
            "Load model (nothing is downloaded before).",
            raw=True,
        )
    source = {
        "preset": "embedded preset (no download)",
        "catalog": "catalog model (downloads its weights on Load)",
        "local": "local folder",
    }[facts.source]
    rows = [("source", source)]
    if facts.description:
        rows.append(("about", facts.description))
    if facts.model_type:
        rows.append(("architecture", facts.model_type))
    parameters = parameter_count_text(facts.parameters)
    if facts.active_parameters:
        parameters += f" ({parameter_count_text(facts.active_parameters)} active per token)"
    if facts.source == "catalog" and facts.parameters:
        parameters += f"; about {facts.parameters * 2 / 1e9:.1f} GB to download in 16-bit"
    rows.append(("parameters", parameters))
    shape = (
        f"{facts.layers or '?'} layers, hidden {facts.hidden_size or '?'}, vocab {facts.vocab_size or '?'}"
    )
    if facts.experts:
        shape += f", {facts.experts} experts"
    if facts.context:
        shape += f", context {facts.context:,}"
    rows.append(("shape", shape))
    rows.append(("fused kernels", fusion_text(facts.fused, facts.not_fused)))
    if facts.gated:
        rows.append(
            ("licence", "gated: accept its licence on the hub and log in (hf auth login) before Load")
        )
    return facts_table(rows)


def fusion_text(fused: list[str], not_fused: list[str]) -> str:
    if fused and not not_fused:
        return "✓ every part: " + ", ".join(fused)
    text = ("fused: " + ", ".join(fused) + "; ") if fused else ""
    return text + "✗ not fused: " + "; ".join(not_fused)


def unknown_model_hint(name: str) -> str:
    if not name:
        return "Pick a preset or a catalog model, or type a hub id (org/name) or a local folder."
    close = close_names(name, model_choices())
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return f"'{name}' is not a preset, a catalog model, an existing folder or a hub id (org/name).{hint}"
