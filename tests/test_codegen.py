"""The kernels' rule is generated from ``rule_spec.py`` (``kernels/codegen/__init__.py``): the committed
header is the generator's output, the Triton module is written where missing or stale, the generator refuses what a backend cannot compute, and
the CPU kernel's build digest covers the generated header. That the generated kernels compute the rule
bit for bit is checked against the independent torch transcription by the backend suites
(``test_layouts_cpp.py``, ``test_state_dtype.py``, ``test_tbe_triton.py``, ...)."""

from __future__ import annotations

import os

import pytest

from torchrec_ftrl.kernels import codegen
from torchrec_ftrl.kernels.cpu import build as cpu_build
from torchrec_ftrl.rule_spec import Fn


def test_committed_header_is_the_generators_output():
    assert codegen.stale() == [], "run: python -m torchrec_ftrl.kernels.codegen --write"


def test_importing_the_triton_kernels_writes_their_rule_module(tmp_path):
    """The Triton kernels' import is where the module gets written (a fresh checkout has none)."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    path = tmp_path / "triton_rule_gen.py"
    code = ("import sys; from torchrec_ftrl.kernels import codegen; codegen.TRITON_PATH = sys.argv[1]; "
            "import torchrec_ftrl.kernels.cuda.forward")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True)
    assert path.read_text() == codegen.generate_triton()


def test_a_spec_name_that_is_a_knob_is_refused():
    fn = Fn("f", "z, l1", "f32", doc="test", body="return z * l1\n")
    with pytest.raises(ValueError, match=r"^f: parameters or locals named like knobs \['l1'\]"):
        codegen.generate_triton((fn,))
    fn = Fn("g", "z", "f32", doc="test", body="beta = z * 2.0\nreturn beta\n")
    with pytest.raises(ValueError, match=r"^g: .*\['beta'\]"):
        codegen.generate_triton((fn,))


def test_the_triton_module_is_written_where_missing_or_stale_and_else_left_alone(tmp_path, monkeypatch):
    path = tmp_path / "triton_rule_gen.py"
    monkeypatch.setattr(codegen, "TRITON_PATH", str(path))
    codegen.ensure_triton_module()                            # missing: written
    assert path.read_text() == codegen.generate_triton()
    os.utime(path, (1, 1))
    codegen.ensure_triton_module()                            # current: not touched
    assert path.stat().st_mtime == 1
    path.write_text(codegen.generate_triton().replace("tl.sqrt", "tl.exp"))
    codegen.ensure_triton_module()                            # stale (an older spec): rewritten
    assert path.read_text() == codegen.generate_triton()
    assert [p.name for p in tmp_path.iterdir()] == ["triton_rule_gen.py"]   # no temporary left


def test_setup_writes_the_triton_module_without_torch(tmp_path):
    """setup.py generates the module with the generator alone (pip's isolated build has no torch):
    run in a Python whose imports of torch fail."""
    import shutil
    import subprocess
    import sys
    src = tmp_path / "src"
    package = os.path.dirname(codegen.KERNELS)
    shutil.copytree(package, src / "torchrec_ftrl",
                    ignore=shutil.ignore_patterns("rule_gen.py", "*.so", "__pycache__"))
    shutil.copy(os.path.join(os.path.dirname(package), "setup.py"), src)
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "torch.py").write_text("raise ImportError('no torch here')\n")
    code = ("import runpy, sys; sys.argv = ['setup.py', '--version'];"
            "runpy.run_path('setup.py')")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "blocker")}
    subprocess.run([sys.executable, "-c", code], cwd=src, env=env, check=True, capture_output=True)
    assert (src / "torchrec_ftrl" / "kernels" / "cuda" / "rule_gen.py").read_text() == codegen.generate_triton()


def test_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "ftrl_rule_gen.h"
    stale.write_text(codegen.generate_cpp() + "// edited by hand\n")
    monkeypatch.setattr(codegen, "COMMITTED", {str(stale): codegen.generate_cpp})
    monkeypatch.setattr(codegen, "TRITON_PATH", str(tmp_path / "triton_rule_gen.py"))
    assert codegen.main(["--check"]) == 1
    assert "ftrl_rule_gen.h is stale" in capsys.readouterr().err
    assert codegen.main(["--write"]) == 0
    assert codegen.main(["--check"]) == 0


def test_cpp_keeps_the_order_of_operations_as_written():
    fn = Fn("f", "a, b, c", "f32", doc="test", body="return (a + b) - c * (a - b) / (b + c)\n")
    assert "return (a + b) - c * (a - b) / (b + c);" in codegen.generate_cpp((fn,))
    # Python binds & and ^ tighter than >, C++ looser: the C++ text needs the parentheses.
    fn = Fn("h", "x: u32", "bool", doc="test", body="return x & 255 > 3 ^ x >> 1\n")
    assert "return (x & 255) > (3 ^ x >> 1);" in codegen.generate_cpp((fn,))


@pytest.mark.parametrize("generate, intrinsic", [(codegen.generate_cpp, "fdiv(a, b)"),
                                                 (codegen.generate_cpp, "per_row(a)"),
                                                 (codegen.generate_triton, "copysign(a, b)")])
def test_an_intrinsic_the_backend_lacks_is_refused(generate, intrinsic):
    fn = Fn("f", "a, b", "f32", doc="test", body=f"return {intrinsic}\n")
    with pytest.raises(ValueError, match=rf"^f: .*{intrinsic.split('(')[0]}"):
        generate((fn,))


def test_a_call_without_the_callees_flags_is_refused():
    callee = Fn("pw", "n", "f32", flags=("POW_HALF",), doc="test",
                body="if POW_HALF:\n    return sqrt(n)\nelse:\n    return n\n")
    caller = Fn("f", "n", "f32", doc="test", body="return pw(n)\n")
    with pytest.raises(ValueError, match=r"f calls pw without its flags \['POW_HALF'\]"):
        codegen.generate_cpp((callee, caller))


def test_the_build_digest_covers_the_generated_header(tmp_path, monkeypatch):
    assert os.path.samefile(cpu_build.INPUTS[1], os.path.join(os.path.dirname(codegen.CPP_PATH),
                                                              "ftrl_rule_gen.h"))
    source, header = tmp_path / "ftrl_tbe_cpu.cpp", tmp_path / "ftrl_rule_gen.h"
    source.write_text('#include "ftrl_rule_gen.h"\n')
    header.write_text("inline float f(float x) { return x; }\n")
    monkeypatch.setattr(cpu_build, "INPUTS", (str(source), str(header)))
    before = cpu_build.source_digest()
    header.write_text("inline float f(float x) { return -x; }\n")
    assert cpu_build.source_digest() != before
