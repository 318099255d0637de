"""The direct launcher of compiled Triton kernels (:mod:`torchrec_ftrl.kernels.cuda.launch`), on CPU with a
stand-in kernel: what separates two launches, when it falls back to ``JITFunction.run``, and the
argument list its compiled launcher gets. The real kernels run through it in the CUDA tests."""

from __future__ import annotations

import types

import pytest
import torch

launch = pytest.importorskip("torchrec_ftrl.kernels.cuda.launch")


class _Compiled:
    """Stands in for a ``CompiledKernel``: records each launch ``compiled[grid](*args)``."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Kernel:
    """Stands in for a ``JITFunction``: ``params`` as Triton lists them; ``kernel[grid](...)``
    compiles (a new :class:`_Compiled` per call) and launches once."""

    def __init__(self):
        P = types.SimpleNamespace
        self.params = [P(name="x", do_not_specialize=False, do_not_specialize_on_alignment=False, default=None),
                       P(name="n", do_not_specialize=True, do_not_specialize_on_alignment=False, default=None),
                       P(name="m", do_not_specialize=False, do_not_specialize_on_alignment=False, default=None),
                       P(name="f", do_not_specialize=False, do_not_specialize_on_alignment=False, default=None),
                       P(name="BLOCK", do_not_specialize=False, do_not_specialize_on_alignment=False, default=None),
                       P(name="FLAG", do_not_specialize=False, do_not_specialize_on_alignment=False, default=7)]
        self.jit_calls = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            c = _Compiled()
            self.jit_calls.append((grid, args, meta, c))
            return c
        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    k = _Kernel()
    return k, launch.DirectLauncher(k)


def test_second_launch_of_a_specialisation_skips_the_jit_and_passes_every_argument(launcher):
    k, dl = launcher
    x = torch.zeros(8)
    dl[(3,)](x, 100, 32, 0.5, BLOCK=64)
    assert len(k.jit_calls) == 1
    dl[(5, 2)](x, 117, 48, 1.5, BLOCK=64)       # n is not specialised; m stays % 16 == 0, != 1
    assert len(k.jit_calls) == 1
    compiled = k.jit_calls[0][3]
    # Triton's public launch of the compiled kernel: the grid padded to 3-D, then the arguments in
    # signature order with the constexpr tail (keywords, then defaults)
    assert compiled.launches == [((5, 2, 1), (x, 117, 48, 1.5, 64, 7))]


@pytest.mark.parametrize("change", ["dtype", "unaligned", "int_one", "int_not_16", "int_wide", "meta",
                                    "none_for_tensor"])
def test_what_triton_specialises_on_compiles_again(launcher, change):
    k, dl = launcher
    base = torch.zeros(16)
    dl[(1,)](base, 5, 32, 0.5, BLOCK=64)
    args, meta = [base, 5, 32, 0.5], dict(BLOCK=64)
    if change == "dtype":
        args[0] = torch.zeros(16, dtype=torch.float64)
    elif change == "unaligned":
        args[0] = base[1:]                     # 4 bytes past a 16-byte boundary
    elif change == "int_one":
        args[2] = 1
    elif change == "int_not_16":
        args[2] = 33
    elif change == "int_wide":
        args[1] = 2 ** 40                      # not specialised on value, but on width
    elif change == "meta":
        meta["BLOCK"] = 128
    else:
        args[0] = None
    dl[(1,)](*args, **meta)
    assert len(k.jit_calls) == 2


def test_unkeyed_argument_kinds_and_callable_grids_always_take_the_jit(launcher):
    k, dl = launcher
    for _ in range(2):
        dl[(1,)](torch.zeros(4), 5, 32, "not a kernel argument kind", BLOCK=64)
        dl[lambda meta: (1,)](torch.zeros(4), 5, 32, 0.5, BLOCK=64)
    assert len(k.jit_calls) == 4


def test_disabled_or_interpreted_kernels_are_returned_unchanged(monkeypatch):
    from torchrec_ftrl.kernels.cuda.cache import state_cache_fill_kernel
    k = _Kernel()
    assert launch.direct(k) is k                           # not a JITFunction
    monkeypatch.setattr(launch, "ENABLED", False)
    assert launch.direct(state_cache_fill_kernel) is state_cache_fill_kernel
