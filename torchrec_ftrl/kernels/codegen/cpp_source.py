"""The C++ backend of :mod:`torchrec_ftrl.kernels.codegen`: ``cpu/csrc/ftrl_rule_gen.h`` from the spec's
``SHARED + IEEE``."""

from __future__ import annotations

import ast

from ... import rule_spec
from .spec_parse import ATOM, HEADER, KNOB_NAMES, Emitter, Function, functions

CPP_TYPES = {"f32": "float", "u32": "uint32_t", "u64": "uint64_t", "i64": "int64_t", "u16": "uint16_t",
             "bool": "bool"}

_CPP_CALLS = {"sqrt": "std::sqrt", "pow": "std::pow", "abs": "std::fabs", "copysign": "std::copysign",
              "fma": "std::fma", "f32_bits": "f32_bits"}
_CPP_CASTS = {"u32": "uint32_t", "i64": "int64_t", "bf16_from_bits": "uint16_t"}


def _cpp_flag(flag: str) -> str:
    return "k" + "".join(part.capitalize() for part in flag.split("_"))


def _cpp_int(v: int) -> str:
    return f"0x{v:08X}u" if v >= 0x10000 else str(v)


class CppEmitter(Emitter):
    PREC = {"unary": 90, "*": 80, "/": 80, "+": 70, "-": 70, ">>": 60, "<<": 60, ">": 50, "<": 50,
            ">=": 50, "<=": 50, "==": 45, "!=": 45, "&": 40, "^": 35, "|": 30, "?": 10}

    def constant(self, value) -> str:
        return f"{value!r}f" if isinstance(value, float) else _cpp_int(value)

    def name(self, name: str) -> str:
        if name in KNOB_NAMES:
            return f"hp.{name}"
        if name in rule_spec.CONSTANTS:
            return _cpp_int(rule_spec.CONSTANTS[name])
        return name

    def call(self, name: str, args: list) -> tuple[str, int]:
        if name == "where":
            c, a, b = (self.operand(x, self.PREC["?"] + 1, False) for x in args)
            return f"{c} ? {a} : {b}", self.PREC["?"]
        if name == "div_rn":
            prec = self.PREC["/"]
            return f"{self.operand(args[0], prec, False)} / {self.operand(args[1], prec, True)}", prec
        if name in _CPP_CASTS:
            return f"static_cast<{_CPP_CASTS[name]}>({self.arg(args[0])})", ATOM
        if name in _CPP_CALLS:
            return f"{_CPP_CALLS[name]}({', '.join(self.arg(a) for a in args)})", ATOM
        return self.spec_call(name, args), ATOM

    def lower_spec_call(self, callee: Function, args: list[str]) -> str:
        targs = f"<{', '.join(_cpp_flag(f) for f in callee.flags)}>" if callee.flags else ""
        return f"{callee.name}{targs}({', '.join(args + (['hp'] if callee.knobs else []))})"


def _cpp_body(em: CppEmitter, stmts: list, declared: set, indent: str) -> list[str]:
    out = []
    for st in stmts:
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            target = st.targets[0] if isinstance(st, ast.Assign) else st.target
            typ = st.annotation.id if isinstance(st, ast.AnnAssign) else "f32"
            rhs = em.arg(st.value)
            if target.id in declared:
                out.append(f"{indent}{target.id} = {rhs};")
            else:
                declared.add(target.id)
                out.append(f"{indent}const {CPP_TYPES[typ]} {target.id} = {rhs};")
        elif isinstance(st, ast.If):
            out.append(f"{indent}if constexpr ({_cpp_flag(st.test.id)}) {{")
            out += _cpp_body(em, st.body, declared, indent + "  ")
            if st.orelse:
                out.append(f"{indent}}} else {{")
                out += _cpp_body(em, st.orelse, declared, indent + "  ")
            out.append(f"{indent}}}")
        elif isinstance(st, ast.Return) and not isinstance(st.value, ast.Tuple):
            out.append(f"{indent}return {em.arg(st.value)};")
        else:
            raise ValueError(f"{em.fn.name}: C++ cannot emit {ast.unparse(st)!r}")
    return out


def _cpp_function(fn: Function, known: dict[str, Function]) -> list[str]:
    lines = [f"// {line}" for line in fn.fn.doc.strip().splitlines()]
    if fn.flags:
        lines.append(f"template <{', '.join('bool ' + _cpp_flag(f) for f in fn.flags)}>")
    params = [f"{CPP_TYPES[p.type]}{'&' if p.inout else ''} {p.name}" for p in fn.params]
    if fn.knobs:
        params.append("const FtrlHp& hp")
    lines.append(f"inline {CPP_TYPES[fn.fn.returns]} {fn.name}({', '.join(params)}) {{")
    lines += _cpp_body(CppEmitter(fn, known), fn.body, {p.name for p in fn.params}, "  ")
    return lines + ["}", ""]


def generate_cpp(spec_fns: tuple = rule_spec.SHARED + rule_spec.IEEE) -> str:
    """The text of ``cpu/csrc/ftrl_rule_gen.h`` (of ``spec_fns``, :class:`~torchrec_ftrl.rule_spec.Fn` s)."""
    fns = functions(spec_fns, triton=False)
    known = {f.name: f for f in fns}
    knobs = [f"  float {k.name};  // {k.meaning}" for k in rule_spec.KNOBS]
    lines = [f"// {HEADER}.", "//",
             "// The FTRL-Proximal rule and the stochastic-rounding hash of the compiled CPU kernel",
             "// (ftrl_tbe_cpu.cpp): the SHARED and IEEE functions of torchrec_ftrl/rule_spec.py.",
             "#pragma once", "", "#include <cmath>", "#include <cstdint>", "#include <cstring>", "",
             "// Internal linkage, as for the kernel's own functions (one translation unit includes this), so",
             "// that the compiler inlines and vectorises them as it does those.",
             "namespace {", "",
             "// The knob scalars in fp32 (FTRLHyperparams.kernel_scalars(), rule_spec.KNOBS).",
             "struct FtrlHp {", *knobs, "};", "",
             "// The number of knobs: the ops' knob tensor holds them in FtrlHp's order (knobs.py).",
             f"constexpr int64_t kFtrlKnobs = {len(KNOB_NAMES)};", "",
             "// The bit pattern of an fp32 value.",
             "inline uint32_t f32_bits(float x) {", "  uint32_t u;", "  std::memcpy(&u, &x, sizeof(u));",
             "  return u;", "}", ""]
    for fn in fns:
        lines += _cpp_function(fn, known)
    return "\n".join(lines + ["}  // namespace", ""])
