"""Direct launches of compiled Triton kernels, for the eager training step's host budget.

``kernel[grid](*args, **meta)`` on a ``triton.JITFunction`` binds the arguments, specialises each
one, renders the launch options to a string for its cache key, checks the kernel's globals and reads
the current device, on every call. :class:`DirectLauncher` does that work once per specialisation:
it keys the compiled kernel (the ``CompiledKernel`` that ``JITFunction.run`` returns) by the facts
Triton specialises on (each tensor's dtype and 16-byte alignment, each integer's value class, the
constexpr and option keyword values, the device) and launches it with Triton's public launch of a
compiled kernel, ``compiled[grid](*args)`` (which passes Triton's launch hooks and the current
stream as ``JITFunction.run`` does). A key never seen, a callable grid and an argument of another
kind go through ``JITFunction.run`` itself, which compiles, caches and launches as usual.

Triton's specialisation rules (``triton.runtime.jit.create_function_from_signature``, Triton 3.x):
a tensor is specialised on its dtype and on ``data_ptr() % 16 == 0`` (not with
``do_not_specialize_on_alignment``); an int on being 1 and on ``% 16 == 0`` (not with
``do_not_specialize``) and on its integer width; floats and bools on their type only; a constexpr
on its value. The key here separates at least what Triton separates, so two launches that share a
key run the same compiled kernel under Triton's own rules.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from triton.runtime.jit import JITFunction

_I32 = 2 ** 31
_U64 = 2 ** 63


def _int_class(v: int, specialize: bool) -> tuple:
    width = 0 if -_I32 <= v < _I32 else (1 if -_U64 <= v < _U64 else 2)
    if not specialize:
        return ("i", width)
    return ("i", width, v == 1, v % 16 == 0)


class DirectLauncher:
    """``launcher[grid](*args, **meta)``: the launch of ``kernel[grid](*args, **meta)``, with the
    per-call host work of ``JITFunction.run`` done once per specialisation (see the module).

    Args:
        kernel: a ``triton.JITFunction`` whose runtime arguments are passed positionally and whose
            constexprs and launch options (``num_warps``, ``maxnreg``, ...) by keyword.
    """

    __slots__ = ("kernel", "_params", "_compiled")

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self._params = [(p.name, p.do_not_specialize, p.do_not_specialize_on_alignment,
                         p.default) for p in kernel.params]
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _key(self, device: int, args: tuple, meta: dict):
        """The specialisation key of a launch, or None for an argument kind not keyed here."""
        key = [device, tuple(meta.items())]
        params = self._params
        for i, a in enumerate(args):
            t = type(a)
            if t is torch.Tensor or isinstance(a, torch.Tensor):
                key.append((a.dtype, params[i][2] or a.data_ptr() % 16 == 0))
            elif t is int:
                key.append(_int_class(a, not params[i][1]))
            elif t is float or t is bool or a is None:
                key.append(t)
            else:
                return None
        return tuple(key)

    def _launch(self, grid, args: tuple, meta: dict) -> None:
        device = torch.cuda.current_device()
        key = None if callable(grid) else self._key(device, args, meta)
        entry = self._compiled.get(key) if key is not None else None
        if entry is None:
            compiled = self.kernel[grid](*args, **meta)
            if key is not None and compiled is not None:
                if hasattr(compiled, "result"):     # an asynchronous compile
                    compiled = compiled.result()
                tail = [meta[name] if name in meta else default
                        for name, _, _, default in self._params[len(args):]]
                self._compiled[key] = (compiled, tail)
            records = getattr(_recording, "records", None)
            if records is not None:
                records.append((self.kernel, compiled if key is not None else None, args, device))
            return
        compiled, tail = entry
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
        records = getattr(_recording, "records", None)
        if records is not None:
            records.append((self.kernel, compiled, args, device))


_launchers: dict = {}
_recording = threading.local()   # .records: this thread's list while recording()
ENABLED = True   # False: every launch goes through JITFunction.run (benchmarks compare the two)


def variant_count() -> int:
    """The compiled kernel variants the direct launchers hold: one per specialisation launched so
    far in this process (each was found or compiled by ``JITFunction.run``), so a count that grows
    between two steps of one configuration means a launch met a specialisation new to it."""
    return sum(len(launcher._compiled) for launcher in _launchers.values())


def direct(kernel: Any) -> Any:
    """The :class:`DirectLauncher` of a ``JITFunction`` (one per kernel); anything else (an
    interpreted kernel) unchanged, and every kernel unchanged while
    :data:`ENABLED` is False."""
    if not ENABLED or not isinstance(kernel, JITFunction):
        return kernel
    launcher = _launchers.get(kernel)
    if launcher is None:
        launcher = _launchers[kernel] = DirectLauncher(kernel)
    return launcher


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Within the block, each launch through a :class:`DirectLauncher` on this thread appends
    ``(kernel, compiled kernel or None, positional arguments, device index)`` to the yielded list
    (how :mod:`.host` learns which compiled kernels a step launched)."""
    outer = getattr(_recording, "records", None)
    _recording.records = []
    try:
        yield _recording.records
    finally:
        _recording.records = outer
