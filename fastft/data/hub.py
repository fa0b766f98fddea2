"""Whether the Hugging Face hub can be reached, decided once per process and in about a second.

Without this, a hub id on an offline machine went through huggingface_hub's retries (about 30 s of
"Retrying in 8s" lines) before its error. `offline_reason` answers from ``HF_HUB_OFFLINE`` or one TCP
connection to the endpoint (to the proxy, where ``HTTPS_PROXY`` sends requests through one), and the loaders then read only the local cache (``local_files_only=True``), so
an offline hub id fails at once with `offline_fix`'s advice, and one already downloaded still loads.

It is asked only where a hub id is being resolved (a model, a config or a dataset the user named): ``import
fastft``, the presets, a local folder and saving open no socket (bitsandbytes' import is kept offline by
`hub_offline_while_importing`, without a check first).

Plain Python, no torch or transformers: the CLI's ``estimate`` calls it before importing either. The data
layer holds it because `fastft.data.loading` reads hub datasets too (an offline hub dataset loads from its
cached snapshot, or fails at once).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import sys
from urllib.parse import urlparse

from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

# Function-local imports: imported after the environment they read is set (environment variables, offline mode).

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 1.5
_TRUE = {"1", "true", "yes", "on"}


def declared_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) says so: the Hugging Face libraries then read
    their caches themselves, without retries."""
    return _env_offline()


def _env_offline() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _address(url: str, default_host: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return parsed.hostname or default_host, parsed.port or (80 if parsed.scheme == "http" else 443)


def _proxy_for(host: str) -> str | None:
    """The proxy an HTTPS request to `host` goes through (``HTTPS_PROXY`` / ``ALL_PROXY``, minus ``NO_PROXY``)."""
    env = {k.lower(): v for k, v in os.environ.items() if k.lower().endswith("_proxy") and v}
    bypass = [entry.strip().lstrip(".") for entry in env.get("no_proxy", "").split(",") if entry.strip()]
    if "*" in bypass or any(host == entry or host.endswith("." + entry) for entry in bypass):
        return None
    return env.get("https_proxy") or env.get("all_proxy")


@functools.lru_cache(maxsize=4)
def _unreachable(endpoint: str, proxy: str | None) -> str | None:
    """Why one TCP connection to the endpoint (or to the proxy that requests would go through) failed."""
    host, port = _address(proxy or endpoint, "huggingface.co")
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as error:
        return f"{host}:{port} cannot be reached ({type(error).__name__}: {error})"


def offline_reason() -> str | None:
    """None when the hub can be reached; otherwise why not. The network is tried once per process."""
    if _env_offline():
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    return _unreachable(endpoint, _proxy_for(_address(endpoint, "huggingface.co")[0]))


@contextlib.contextmanager
def hub_offline_while_importing(module: str):
    """Imports `module` (where it is installed and not yet imported) with huggingface_hub in offline mode, then
    runs the block. The caller names bitsandbytes: its CPU backend asks the hub for a kernel (the `kernels`
    package) when it is imported, a kernel fastft never calls (NF4 is dequantised by its own kernels): a
    connection nobody asked for and, where connections to the hub hang (a firewall that drops packets), a wait
    of a minute and more. peft up to 0.21 imported bitsandbytes with ``import peft``; peft 0.22 imports it
    inside `get_peft_model`, so the import is made here, not left to whichever library comes first. The switch
    is huggingface_hub's own, set only for the import and put back after; nothing is tried first, so no socket
    is opened (with the module already imported, or `kernels` absent, nothing changes). A module that fails to
    import is left for its first user to report (the failed import is not cached, so that user sees the
    error)."""
    if (
        module in sys.modules
        or importlib.util.find_spec(module) is None
        or importlib.util.find_spec("kernels") is None
        or _env_offline()
    ):
        yield
        return
    import huggingface_hub.constants as constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        with contextlib.suppress(Exception):  # reported by its first user, who imports it again
            importlib.import_module(module)
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def offline_fix(name: str, files: str = "", repo_type: str = "model") -> str:
    """What to do about a hub id that is not in the local cache while the hub is out of reach (`files`: the
    files the caller needs, e.g. "config.json"; empty for the whole repository)."""
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    download = f"hf download {name}{kind} {files}".rstrip()
    # "unset HF_HUB_OFFLINE" only where it is set: otherwise the network itself is out of reach
    unset = " (or unset HF_HUB_OFFLINE where there is network)" if _env_offline() else ""
    return (
        f"'{name}' is not in the local Hugging Face cache, and the hub is offline here ({offline_reason()}). "
        f"Fix: on a machine with network run `{download}`{unset} "
        "and pass the downloaded folder; embedded presets and catalog models (`fastft models`) need no download."
    )


def cached_dataset_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of hub dataset `repo_id` if the Hugging Face cache holds one, else None;
    reads the cache only (no network)."""

    try:
        return snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


__all__ = [
    "cached_dataset_snapshot",
    "declared_offline",
    "hub_offline_while_importing",
    "offline_fix",
    "offline_reason",
]
