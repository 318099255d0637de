"""How the compiled CPU kernel (``csrc/ftrl_tbe_cpu.cpp``) is built: source, flags, ISA variants and
the library's file name. Read by ``setup.py`` (which builds every variant when the package is
installed or its wheel built) and by :mod:`torchrec_ftrl.kernels.cpp_backend` (which loads the variant
for this CPU, or builds it at first use in a source checkout). Imports nothing.

One library per vector ISA, as ATen's ``CPU_CAPABILITY`` dispatch does: the build machine's flags
never leak into a wheel, and the loader picks the variant by
``torch.backends.cpu.get_cpu_capability()`` (which also honours ``ATEN_CPU_CAPABILITY``).
"""

from __future__ import annotations

import hashlib
import os
import re

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "ftrl_tbe_cpu.cpp")

# -fno-math-errno / -fno-trapping-math let the FTRL loop over D vectorise (sqrt, the |z| > l1 select);
# they change no result. -ffp-contract=off keeps the rule's roundings (no FMA contraction).
BASE_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
              "-ffp-contract=off"]
# -s: no symbol table in the library (12 MB -> 1.4 MB per variant); what loading needs stays.
LINK_FLAGS = ["-fopenmp", "-s"]
# ISA variant -> its flags; "default" is baseline x86-64 (any CPU torch runs on).
ISA_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
}


def isa_variant(cpu_capability: str) -> str:
    """The variant for ATen's CPU capability string (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...):
    itself when built, else ``"default"``."""
    name = re.sub(r"[^a-z0-9]", "", cpu_capability.lower())
    return name if name in ISA_FLAGS else "default"


def source_digest() -> str:
    """10 hex digits of the SHA-1 of :data:`SOURCE`."""
    with open(SOURCE, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:10]


def library_name(isa: str, torch_version: str) -> str:
    """Module name of a prebuilt variant, e.g. ``_ftrl_tbe_cpu_avx2_3f2a9c01de_torch2_13_0_cpu``: the
    source's digest (an edited source never loads an older build) and the torch version it was built
    against (a build loads only into that torch)."""
    return f"_ftrl_tbe_cpu_{isa}_{source_digest()}_torch{re.sub(r'[^A-Za-z0-9]', '_', torch_version)}"
