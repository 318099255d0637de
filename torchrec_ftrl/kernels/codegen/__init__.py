"""Generates the kernels' FTRL rule from :mod:`torchrec_ftrl.rule_spec`: a C++ header and a Triton module.

``cpu/csrc/ftrl_rule_gen.h`` (from ``SHARED + IEEE``) is committed: the CPU kernel's build reads it.
``cuda/rule_gen.py`` (from ``SHARED + FAST``) is a build product, not in git: ``setup.py`` writes
it into the package when it is installed or its wheel built, and the Triton kernels' modules write it
at import (:func:`ensure_triton_module`) where it is missing or stale, e.g. in a source checkout.
``python -m torchrec_ftrl.kernels.codegen --write`` rewrites both; ``--check`` exits 1 when the
committed header differs from the output. The spec's statements are parsed with :mod:`ast` and
emitted operation for operation (:mod:`.spec_parse`), with the parentheses each language's
precedence needs and those the spec writes (:mod:`.cpp_source`, :mod:`.triton_source`). An
intrinsic a backend does not have (``fdiv`` in C++, ``copysign`` in Triton, ...) raises
``ValueError`` naming the function and the intrinsic.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from .cpp_source import generate_cpp
from .triton_source import generate_triton

KERNELS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_PATH = os.path.join(KERNELS, "cpu", "csrc", "ftrl_rule_gen.h")
TRITON_PATH = os.path.join(KERNELS, "cuda", "rule_gen.py")

COMMITTED = {CPP_PATH: generate_cpp}     # generated files kept in git (``--check`` reads them)


def _read(path: str) -> str | None:
    """The text of ``path``, or None where there is no such file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_if_changed(path: str, text: str) -> bool:
    """Write ``text`` to ``path`` unless the file holds it already; True when written. The file is
    replaced in one step (a temporary file renamed over it), so processes importing at once never
    read half a file."""
    if _read(path) == text:
        return False
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def ensure_triton_module() -> None:
    """Make ``cuda/rule_gen.py`` the generator's output for this :mod:`torchrec_ftrl.rule_spec` (written where
    missing or stale; an installed package already holds it). Called before the Triton kernels
    import it."""
    write_if_changed(TRITON_PATH, generate_triton())


def stale() -> list[str]:
    """Paths of the committed generated files whose text differs from the generator's output."""
    return [path for path, gen in COMMITTED.items() if _read(path) != gen()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated files")
    mode.add_argument("--check", action="store_true", help="exit 1 when a committed generated file is stale")
    args = ap.parse_args(argv)
    if args.write:
        for path, gen in COMMITTED.items():
            write_if_changed(path, gen())
        ensure_triton_module()
        return 0
    bad = stale()
    for path in bad:
        print(f"{path} is stale: run python -m torchrec_ftrl.kernels.codegen --write", file=sys.stderr)
    return 1 if bad else 0

