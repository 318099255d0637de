"""Builds the compiled CPU kernel of the FTRL TBE, one library per ISA variant
(torchrec_ftrl/kernels/cpu_build.py), when torch is importable at build time (``pip install
--no-build-isolation``, ``pip wheel --no-build-isolation``); metadata is in pyproject.toml.

Without torch at build time (pip's default isolated build) the package installs without them and
builds the variant it needs at first use. ``TORCHREC_FTRL_BUILD_CPU=0`` skips the build.
"""

import os
import runpy

from setuptools import setup


def cpu_kernel_build():
    if os.environ.get("TORCHREC_FTRL_BUILD_CPU", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return {}
    spec = runpy.run_path(os.path.join("torchrec_ftrl", "kernels", "cpu_build.py"))
    source = os.path.relpath(spec["SOURCE"])
    extensions = [
        CppExtension(name="torchrec_ftrl.kernels." + spec["library_name"](isa, torch.__version__),
                     sources=[source], extra_compile_args=spec["BASE_FLAGS"] + flags,
                     extra_link_args=spec["LINK_FLAGS"])
        for isa, flags in spec["ISA_FLAGS"].items()]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": BuildExtension}}


setup(**cpu_kernel_build())
