"""The package's layers, read from its source with ``ast`` (nothing here imports the modules it checks,
except a child process that imports the library, and the constants of the last test).

The import graph holds every import of a ``torchrec_ftrl`` module by another, at module level and inside
functions, relative and absolute; ``from P import name`` counts as an import of the module ``P.name``
when that is a module, else of ``P``. A package's own ``__init__`` running before its submodules is
Python's doing, not an edge.

* no cycles;
* ``optim_type`` (FTRL's identity) imports nothing from the package;
* no core module (the rule, optimizer, TBE, kernels, checkpoint, ...) reaches ``integration`` (the
  TorchRec glue) or ``job`` (the CTR job), not even through other modules;
* only the job itself imports ``job`` (the torchx component names it as a string only), and importing
  the library loads no job module;
* the TBE reaches its kernels only through the ops' calls (``kernels.calls``; no backend's module);
* the modules of the package's root that the rest builds on (the rule's spec, knobs, state dtype, row
  layout, rule) import none of its sub-packages: no import runs back up;
* the embedding module lives in ``tbe/`` (no ``tbe_*.py`` in the package's root);
* no function of ``torchrec_ftrl/`` or ``benchmarks/`` is over 80 lines, and README.md is at most 250;
* the pooling-mode numbers agree in ``kernels/batch.py``, FBGEMM and the C++ kernel.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = "torchrec_ftrl"
ROOT = os.path.join(REPO, PACKAGE)
CORE = ("hyperparams", "rule", "optim", "tbe", "optim_type", "fbgemm_enums", "checkpoint", "kernels")
OUTER = ("integration", "job")


def _modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (source path, is a package)."""
    found = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), REPO)[:-3].split(os.sep)
            is_pkg = rel[-1] == "__init__"
            name = ".".join(rel[:-1] if is_pkg else rel)
            found[name] = (os.path.join(dirpath, f), is_pkg)
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The longest package module that ``name`` (a dotted name) is or lies inside."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The package modules ``module`` imports (anywhere in its source)."""
    path, is_pkg = MODULES[module]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(_owner(a.name) for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                assert node.level - 1 < len(parts), f"{module}: relative import above the package"
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else _owner(base))
    out.discard(None)
    out.discard(module)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in GRAPH[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _in(module: str, part: str) -> bool:
    name = f"{PACKAGE}.{part}"
    return module == name or module.startswith(name + ".")


def test_the_graph_is_read():
    # a few edges known from the source, so a broken parser cannot pass the checks below vacuously
    assert {"torchrec_ftrl.tbe", "torchrec_ftrl.kernels.backend", "torchrec_ftrl.optim_type",
            "torchrec_ftrl.integration.patches", "torchrec_ftrl.job.train"} <= set(MODULES)
    assert "torchrec_ftrl.kernels.backend" in GRAPH["torchrec_ftrl.tbe.args"]
    assert "torchrec_ftrl.optim_type" in GRAPH["torchrec_ftrl.integration.patches"]   # from .. import x
    assert "torchrec_ftrl.rule" in GRAPH["torchrec_ftrl.kernels.pytorch.rows"]        # from ..rule import
    assert "torchrec_ftrl" in GRAPH["torchrec_ftrl.job.train"]                        # in a function
    assert "torchrec_ftrl.job.faults" in GRAPH["torchrec_ftrl.job.atomic_checkpoint"]   # from . import x


def test_no_import_cycles():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):                                  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == [], cycles


def test_optim_type_is_a_leaf():
    assert GRAPH["torchrec_ftrl.optim_type"] == set()


@pytest.mark.parametrize("core", CORE)
def test_core_never_reaches_integration_or_job(core):
    modules = [m for m in MODULES if _in(m, core)]
    assert modules
    for m in modules:
        bad = sorted(n for n in _reach(m) if any(_in(n, outer) for outer in OUTER))
        assert bad == [], f"{m} reaches {bad}"


def test_library_never_imports_the_job():
    """The job depends on the library, never the reverse: no module of torchrec_ftrl outside
    torchrec_ftrl/job (the torchx component names it only as a string) imports torchrec_ftrl.job."""
    library = [m for m in MODULES if not _in(m, "job")]
    assert len(library) >= 5 and "torchrec_ftrl.components" in library
    bad = sorted((m, n) for m in library for n in GRAPH[m] if _in(n, "job"))
    assert bad == [], bad
    # and at run time: importing the library (and the torchx component) loads no job module
    p = subprocess.run([sys.executable, "-c", "import sys, torchrec_ftrl, torchrec_ftrl.components; "
                        "print(sorted(m for m in sys.modules if m.startswith('torchrec_ftrl.job')))"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_tbe_reaches_kernels_only_through_the_ops_calls():
    reached = _reach("torchrec_ftrl.tbe")
    assert {"torchrec_ftrl.kernels.calls", "torchrec_ftrl.kernels.backend"} <= reached
    backends = [n for n in MODULES if n.startswith("torchrec_ftrl.kernels.") and n.endswith(".backend")
                and n != "torchrec_ftrl.kernels.backend"]
    assert len(backends) == 2   # kernels.cpu.backend, kernels.cuda.backend
    assert sorted(n for n in reached if n in backends or n.endswith(".composite")) == []


# The root modules every layer reads; each imports only others of them (and fbgemm_enums).
FOUNDATION = ("rule_spec", "fbgemm_enums", "optim_type", "hyperparams", "state_dtype", "row_layout", "rule")


@pytest.mark.parametrize("name", FOUNDATION)
def test_foundation_imports_no_sub_package(name):
    module = f"{PACKAGE}.{name}"
    assert module in MODULES
    allowed = {f"{PACKAGE}.{n}" for n in FOUNDATION}
    assert sorted(n for n in _reach(module) if n not in allowed) == []


def test_no_tbe_module_in_the_package_root():
    assert sorted(f for f in os.listdir(ROOT) if f.startswith("tbe_") and f.endswith(".py")) == []
    assert os.path.isfile(os.path.join(ROOT, "tbe", "module.py"))


def test_no_function_over_80_lines():
    long = []
    for top in (ROOT, os.path.join(REPO, "benchmarks")):
        for dirpath, _, files in os.walk(top):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read())
                long += [f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name} "
                         f"({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and node.end_lineno - node.lineno + 1 > 80]
    assert long == []


def test_pooling_mode_numbers_agree():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    from torchrec_ftrl.kernels import batch
    ours = {"Sum": batch.POOL_SUM, "Mean": batch.POOL_MEAN, "None": batch.POOL_NONE}
    assert ours == {"Sum": int(PoolingMode.SUM), "Mean": int(PoolingMode.MEAN),
                    "None": int(PoolingMode.NONE)}
    with open(os.path.join(ROOT, "kernels", "cpu", "csrc", "ftrl_tbe_cpu.cpp")) as f:
        cpp = {name: int(v) for name, v in re.findall(r"constexpr\s+int\s+kPool(\w+)\s*=\s*(\d+)\s*;",
                                                       f.read())}
    assert cpp == ours


def test_readme_is_at_most_250_lines():
    """README.md is the user's document (quick start, usage, what is supported, links); the package's
    rooms are in docs/architecture.md."""
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(f.read().splitlines()) <= 250
