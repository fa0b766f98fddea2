"""One rule for a model's own Python code: fastft never runs it, and never lets transformers ask whether to,
unless the user passed ``trust_remote_code=True``.

A folder or hub repository whose config.json (or tokenizer_config.json) has ``auto_map`` names Python files
that transformers imports to build it. Given ``trust_remote_code=None`` (the default of every Auto class),
transformers asks "Do you wish to run the custom code? [y/N]" on stdin when it needs those files, so the
folder's code was one keypress away. Every ``from_pretrained`` of an Auto class in fastft goes through
`from_pretrained` here: ``trust_remote_code`` is always passed as an explicit bool (False unless the user
said True), and where transformers then refuses, `RemoteCodeError` names the folder, the files and the fix.
A config whose ``model_type`` transformers knows loads with transformers' own classes, its code unrun.
"""

from __future__ import annotations

import os

from fastft.checks import SettingError
from fastft.models.errors import RemoteCodeError

# Function-local imports: the CLI's parser and light commands read this module without torch or transformers
# (tests/faces/test_cli.py).


def consent(trust_remote_code) -> bool:
    """`trust_remote_code` as the bool transformers gets: only True and False are answers (None would make
    transformers ask on stdin)."""
    if not isinstance(trust_remote_code, bool):
        raise SettingError(
            f"trust_remote_code must be True or False, got {trust_remote_code!r}. Pass True only for a model "
            "whose own Python code you have read and trust; False (the default) never runs it."
        )
    return trust_remote_code


def from_pretrained(auto_class, source, name: str | None = None, trust_remote_code: bool = False, **kwargs):
    """``auto_class.from_pretrained(source, **kwargs)`` (AutoConfig, AutoTokenizer, AutoModelForCausalLM)
    with an explicit ``trust_remote_code``; `RemoteCodeError` where `source` needs its own code and the
    user did not pass ``trust_remote_code=True``. `name` is what the user gave (the error names it)."""
    trust = consent(trust_remote_code)
    try:
        return auto_class.from_pretrained(source, trust_remote_code=trust, **kwargs)
    except ValueError as error:
        code = (
            {} if trust else custom_code(source, kwargs.get("token"), kwargs.get("local_files_only", False))
        )
        if code:
            raise RemoteCodeError(refusal(name or os.fspath(source), code)) from error
        raise


def custom_code(source, token=None, local_files_only: bool = False) -> dict[str, str]:
    """The ``auto_map`` entries of `source`'s config.json and tokenizer_config.json (a folder, or a hub id's
    files, from the cache where they are), as {"AutoModelForCausalLM": "modeling_x.XModel", …}; empty
    when it ships no code of its own. Reads JSON only: nothing is imported."""
    from transformers import PretrainedConfig
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    found: dict[str, str] = {}
    readers = (
        lambda: PretrainedConfig.get_config_dict(
            os.fspath(source), token=token, local_files_only=local_files_only
        )[0],
        lambda: get_tokenizer_config(os.fspath(source), token=token, local_files_only=local_files_only),
    )
    for read in readers:
        try:
            auto_map = read().get("auto_map") or {}
        except (OSError, ValueError):
            continue
        if isinstance(auto_map, (list, tuple)):  # old tokenizer configs: [slow class, fast class]
            auto_map = {"AutoTokenizer": ", ".join(str(entry) for entry in auto_map if entry)}
        if isinstance(auto_map, dict):
            for key, value in auto_map.items():
                found.setdefault(
                    str(key), ", ".join(map(str, value)) if isinstance(value, list) else str(value)
                )
    return found


def refusal(name: str, code: dict[str, str]) -> str:
    """The message of `RemoteCodeError` for `name`, whose ``auto_map`` is `code`."""
    entries = ", ".join(f"{key}: {value}" for key, value in sorted(code.items()))
    return (
        f"'{name}' needs its own Python code to load (auto_map in its config: {entries}), and fastft never "
        "runs a model's code unless asked. Fix: read those files, and only if you trust their author pass "
        "trust_remote_code=True (fastft estimate: --trust-remote-code)."
    )


__all__ = ["consent", "custom_code", "from_pretrained", "refusal"]
