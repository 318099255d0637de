"""Writes the Triton kernels' rule module (generated from rule_spec.py, not in git) into the
package, and builds the compiled CPU kernel of the FTRL TBE, one library per ISA variant
(torchrec_ftrl/kernels/cpu/build.py), when torch is importable at build time (``pip install
--no-build-isolation``, ``pip wheel --no-build-isolation``); metadata is in pyproject.toml.

Without torch at build time (pip's default isolated build) the package installs without the CPU
libraries and builds the variant it needs at first use. ``TORCHREC_FTRL_BUILD_CPU=0`` skips that
build.
"""

import importlib
import os
import runpy
import sys
import types

from setuptools import setup


def generate_triton_rules():
    """Write the Triton kernels' rule module (torchrec_ftrl/kernels/cuda/rule_gen.py, not in git)
    from torchrec_ftrl/rule_spec.py, so the package and its wheel carry it. The generator is pure Python: it is
    loaded as a package of its own, without torchrec_ftrl's imports (torch)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrec_ftrl")
    for name, path in (("_torchrec_ftrl_codegen", root), ("_torchrec_ftrl_codegen.kernels",
                                                          os.path.join(root, "kernels"))):
        pkg = types.ModuleType(name)   # a package without its __init__ (which imports torch)
        pkg.__path__ = [path]
        sys.modules[name] = pkg
    importlib.import_module("_torchrec_ftrl_codegen.kernels.codegen").ensure_triton_module()


def cpu_kernel_build():
    if os.environ.get("TORCHREC_FTRL_BUILD_CPU", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return {}
    spec = runpy.run_path(os.path.join("torchrec_ftrl", "kernels", "cpu", "build.py"))
    source = os.path.relpath(spec["SOURCE"])
    extensions = [
        CppExtension(name="torchrec_ftrl.kernels.cpu." + spec["library_name"](isa, torch.__version__),
                     sources=[source], extra_compile_args=spec["BASE_FLAGS"] + flags,
                     extra_link_args=spec["LINK_FLAGS"])
        for isa, flags in spec["ISA_FLAGS"].items()]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": BuildExtension}}


generate_triton_rules()
setup(**cpu_kernel_build())
