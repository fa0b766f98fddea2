"""Which compiled variant each Triton launch would need on a GPU, recorded on the CPU (under the interpreter).

On a GPU, `triton.jit` compiles one kernel per *specialisation key*: the values of its ``tl.constexpr``
arguments, plus, for every other integer argument, whether it is 1 and whether it is a multiple of 16 (and
32- or 64-bit), and for every tensor argument whether its address is 16-byte aligned (arguments named in
``do_not_specialize`` are exempt). A key seen for the first time costs a compile (about a second per kernel
on an H100 host). `SpecialisationKeys` records the key of each launch the way the GPU launcher computes it
(`triton.runtime.jit`'s ``native_specialize_impl`` with the base backend), so a test can ask whether a
kernel's key changes with, say, a padded length.
"""

from __future__ import annotations

import collections
import inspect

from triton.backends.compiler import BaseBackend
from triton.runtime import interpreter
from triton.runtime.jit import native_specialize_impl


def _constexprs(fn) -> set[str]:
    return {
        name
        for name, annotation in inspect.get_annotations(fn).items()
        if "constexpr" in str(getattr(annotation, "__name__", annotation))
    }


def specialisation_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key `kernel` (an interpreted ``@triton.jit`` function) compiles under for these arguments."""
    fn = kernel.fn
    bound = inspect.signature(fn).bind_partial(
        *args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names}
    )
    constexprs = _constexprs(fn)
    exempt = set(kernel.kwargs.get("do_not_specialize") or ())
    unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    key = []
    for index, name in enumerate(kernel.arg_names):
        if name not in bound.arguments:
            continue
        value = bound.arguments[name]
        if name in constexprs:
            key.append((name, "constexpr", value))
            continue
        specialise = name not in exempt and index not in exempt
        align = name not in unaligned and index not in unaligned
        key.append((name, *native_specialize_impl(BaseBackend, value, False, specialise, align)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names))
    return tuple(key) + options


class SpecialisationKeys:
    """Context manager: ``keys[kernel_name]`` is the set of specialisation keys launched inside it.
    ``run=False`` records without running the kernels (their outputs stay unwritten): for tests that ask
    only about the keys, at the sizes where they matter."""

    def __init__(self, run: bool = True):
        self.keys: dict[str, set[tuple]] = collections.defaultdict(set)
        self.run = run

    def __enter__(self):
        self._run = interpreter.InterpretedFunction.run
        keys = self.keys
        run = self._run

        def recording_run(kernel, *args, grid, warmup, **kwargs):
            keys[kernel.fn.__name__].add(specialisation_key(kernel, args, kwargs))
            if self.run:
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        interpreter.InterpretedFunction.run = recording_run
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run
        return False


def differing(first: dict[str, set[tuple]], second: dict[str, set[tuple]]) -> dict[str, list[str]]:
    """Kernels whose keys differ between two recordings, with the arguments whose specialisation differs."""
    out = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name, set()), second.get(name, set())
        if a != b:
            entries = set().union(*a, *b) - set.intersection(*(set(key) for key in a | b))
            out[name] = sorted({entry[0] for entry in entries if isinstance(entry, tuple)})
    return out
