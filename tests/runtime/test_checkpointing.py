"""`Checkpointing`: one vocabulary for add_lora, the offloader, the estimator, the CLI and the studio."""

from __future__ import annotations

import pytest

from fastft.runtime.activation_checkpointing import BY_MEMORY, KINDS, Checkpointing, CheckpointingError
from fastft.runtime.model_state import model_state


@pytest.mark.parametrize(
    "value, kind",
    [
        (True, "recompute"),
        (False, "none"),
        (None, "none"),
        ("unsloth", "offload"),
        ("off", "none"),
        ("Offload", "offload"),
        (" recompute ", "recompute"),
        ("true", "recompute"),
        ("false", "none"),
        ("auto", "auto"),
        (Checkpointing("offload"), "offload"),
    ],
)
def test_parse_accepts_every_spelling_a_user_types(value, kind):
    assert Checkpointing.parse(value).kind == kind


@pytest.mark.parametrize("value", ["offlaod", "offload-single", 3, "full-ish"])
def test_unknown_values_name_the_accepted_ones(value):
    with pytest.raises(
        CheckpointingError, match="not a mode: use one of 'auto', 'offload', 'recompute', 'none'"
    ):
        Checkpointing.parse(value)
    assert issubclass(CheckpointingError, ValueError)


def test_auto_resolves_by_device_and_nothing_else_does():
    assert Checkpointing("auto").resolved(cuda=True) == Checkpointing("offload")
    assert Checkpointing("auto").resolved(cuda=False) == Checkpointing("recompute")
    for kind in KINDS[1:]:
        assert Checkpointing(kind).resolved(cuda=True) == Checkpointing(kind)
        assert Checkpointing(kind).resolved(cuda=False) == Checkpointing(kind)
    assert [Checkpointing(k).checkpoints for k in BY_MEMORY] == [False, True, True]
    assert [Checkpointing(k).offloads for k in BY_MEMORY] == [False, False, True]


def test_the_estimator_and_add_lora_read_one_value_alike():
    """The estimate answers for a GPU, so its "auto" is what add_lora picks there: "offload"."""
    import fastft

    for value in (True, False, "unsloth", "auto", "recompute", "none", "offload"):
        estimate = fastft.estimate_vram("tiny-llama", 64, checkpointing=value, gpu=None)
        assert estimate.settings.checkpointing == Checkpointing.parse(value).resolved(cuda=True).kind
    model, _ = fastft.load_model("tiny-llama")
    lora = fastft.add_lora(model, r=4, gradient_checkpointing="unsloth")
    assert model_state(lora).lora.gradient_checkpointing == Checkpointing("offload")
