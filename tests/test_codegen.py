"""The kernels' rule is generated from ``kernels/rule_spec.py`` (``kernels/codegen.py``): the committed
generated files are the generator's output, the generator refuses what a backend cannot compute, and
the CPU kernel's build digest covers the generated header. That the generated kernels compute the rule
bit for bit is checked against the independent torch transcription by the backend suites
(``test_layouts_cpp.py``, ``test_state_dtype.py``, ``test_tbe_triton.py``, ...)."""

from __future__ import annotations

import os

import pytest

from torchrec_ftrl.kernels import codegen, cpu_build
from torchrec_ftrl.kernels.rule_spec import Fn


def test_committed_generated_files_are_the_generators_output():
    assert codegen.stale() == [], "run: python -m torchrec_ftrl.kernels.codegen --write"


def test_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "ftrl_rule_gen.h"
    stale.write_text(codegen.generate_cpp() + "// edited by hand\n")
    monkeypatch.setattr(codegen, "GENERATED", {str(stale): codegen.generate_cpp})
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
