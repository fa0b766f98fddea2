"""Shared test setup: offline by construction, small thread counts, GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

# Without a GPU, Triton kernels run through the interpreter: it must be on before any @triton.jit
# function is defined (kernel modules read it at import). `nvidia-smi` is the cheap probe here.
_INTERPRETER_SET_HERE = shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ
if _INTERPRETER_SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if _INTERPRETER_SET_HERE:
    # Triton decides interpreter or compiler when a @triton.jit function is defined: import every kernel
    # module now, while the variable is set, whichever test happens to import it first.
    import importlib

    for _name in (
        "rms_norm",
        "rope",
        "qk_norm_rope",
        "swiglu",
        "rounding",
        "fused_linear_ce",
        "nf4",
        "lora",
        "fp8",
        "grouped_gemm",
        "down_combine",
    ):
        importlib.import_module(f"fastft.kernels.{_name}")

torch.set_num_threads(min(2, os.cpu_count() or 1))

_real_connect = socket.socket.connect


def _loopback_only(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
        raise OSError(f"tests must not use the network (tried to connect to {host})")
    return _real_connect(self, address)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any test that tries to reach beyond loopback fails: nothing may be downloaded."""
    monkeypatch.setattr(socket.socket, "connect", _loopback_only)


@pytest.fixture(autouse=True)
def _interpreter_for_kernel_tests_only(request, monkeypatch):
    """Kernel and patching tests run the Triton kernels through the interpreter; every other CPU test
    takes the plain-PyTorch references, as a CPU user does (the interpreter is ~100x slower).
    `fastft.kernels.use_triton` reads the variable at each call, so unsetting it here is enough."""
    if not _INTERPRETER_SET_HERE:
        return
    module = request.module.__name__.rsplit(".", 1)[-1]
    if module.startswith("test_kernel_") or module == "test_patch":
        # set it again rather than trusting it is still there: tokenising with `datasets.map(num_proc=2)`
        # drops it from this process's environment after the test that ran it has been torn down
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True)
def _cpu_tests_load_on_the_cpu(request, monkeypatch):
    """On a GPU host the CPU tests still run on the CPU: `load_model`'s default device (None: the GPU when
    there is one) would put the model on CUDA while the test builds its batches on the CPU. Only the
    tests marked ``gpu`` get the GPU by default."""
    if torch.cuda.is_available() and "gpu" not in request.keywords:
        import fastft.models.loading as loading

        monkeypatch.setattr(loading, "default_device", lambda: torch.device("cpu"))


@pytest.fixture
def interpreted(monkeypatch):
    """Fused kernels on CPU tensors through the Triton interpreter (without it a CPU takes their PyTorch
    references). Triton picks interpreter or compiler when a kernel is defined: on a GPU host the kernels
    were compiled for CUDA at import, and setting the variable now would hand CPU tensors to them, so
    there the test is skipped (its CUDA twin, where one exists, is marked ``gpu``); on a CPU host it fails."""
    from triton.runtime.interpreter import InterpretedFunction

    import fastft.kernels.rms_norm as any_kernel_module

    if not isinstance(any_kernel_module._rms_norm_forward_kernel, InterpretedFunction):
        if not torch.cuda.is_available():  # a CPU host must run these: never let them skip quietly in CI
            pytest.fail(
                "fastft's kernels were not defined under TRITON_INTERPRET=1: set it before pytest starts"
            )
        pytest.skip(
            "fastft's kernels were compiled for the GPU at import: CPU interpreter tests run on CPU hosts"
        )
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TEST_HOST_MEMORY = 128 * 2**30  # the host every CPU test's estimate assumes: the H200 machines' 128 GiB


@pytest.fixture(autouse=True)
def _one_host_for_estimates(monkeypatch):
    """The VRAM estimator checks offloading against this machine's host memory ("auto"): CPU tests answer
    for one fixed host instead, so their numbers do not depend on the machine (or on what else runs on
    it). Tests of the host check pass `host_memory` themselves. GPU tests keep the real host."""
    if not torch.cuda.is_available():
        import fastft.runtime.host_budget as host_budget

        monkeypatch.setattr(host_budget, "host_memory_available", lambda: TEST_HOST_MEMORY)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
