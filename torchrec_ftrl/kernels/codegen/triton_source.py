"""The Triton backend of :mod:`torchrec_ftrl.kernels.codegen`: ``cuda/rule_gen.py`` from the spec's
``SHARED + FAST``."""

from __future__ import annotations

import ast
import textwrap

from ... import rule_spec
from .spec_parse import ATOM, HEADER, KNOB_NAMES, POW_FLAG, Emitter, Function, functions

_TRITON_CALLS = {"sqrt": "tl.sqrt", "abs": "tl.abs", "where": "tl.where", "fma": "tl.fma",
                 "fdiv": "tl.fdiv", "div_rn": "tl.div_rn"}
# Intrinsics whose bare-knob operands are broadcast to a tensor operand's shape (tl.fma and tl.div_rn
# take no scalar operands).
_TRITON_BROADCAST = ("fma", "div_rn")


class TritonEmitter(Emitter):
    PREC = {"unary": 90, "*": 80, "/": 80, "+": 70, "-": 70, ">>": 60, "<<": 60, "&": 50, "^": 45,
            "|": 40, ">": 30, "<": 30, ">=": 30, "<=": 30, "==": 30, "!=": 30}

    def constant(self, value) -> str:
        return f"0x{value:08X}" if isinstance(value, int) and value >= 0x10000 else repr(value)

    def name(self, name: str) -> str:
        if name in rule_spec.CONSTANTS:
            return f"tl.full([], 0x{rule_spec.CONSTANTS[name]:08X}, tl.uint32)"
        return 'float("inf")' if name == "INF" else name

    def call(self, name: str, args: list) -> tuple[str, int]:
        texts = [self.arg(a) for a in args]
        if name in _TRITON_BROADCAST:
            shape = next(n.id for a in args for n in ast.walk(a)
                         if isinstance(n, ast.Name) and n.id not in KNOB_NAMES)
            texts = [f"tl.broadcast_to({t}, {shape}.shape)" if isinstance(a, ast.Name) and a.id in KNOB_NAMES
                     else t for a, t in zip(args, texts)]
        if name in _TRITON_CALLS:
            return f"{_TRITON_CALLS[name]}({', '.join(texts)})", ATOM
        if name == "pow":
            return f"pow_({', '.join(texts + [POW_FLAG])})", ATOM
        if name in ("u32", "i64"):
            dtype = "tl.uint32" if name == "u32" else "tl.int64"
            if isinstance(args[0], ast.Name) and args[0].id in {p.name for p in self.fn.params if p.const}:
                return f"tl.full([], {texts[0]}, {dtype})", ATOM
            return f"{self.operand(args[0], ATOM, False)}.to({dtype})", ATOM
        if name == "f32_bits":
            return f"{self.operand(args[0], ATOM, False)}.to(tl.uint32, bitcast=True)", ATOM
        if name == "bf16_from_bits":
            return f"{self.operand(args[0], ATOM, False)}.to(tl.uint16).to(tl.bfloat16, bitcast=True)", ATOM
        if name == "row_sum":
            return f"tl.sum(tl.where({texts[1]}, {texts[0]}, 0.0), axis=1)", ATOM
        if name == "per_row":
            return f"{self.operand(args[0], ATOM, False)}[:, None]", ATOM
        return self.spec_call(name, args), ATOM

    def lower_spec_call(self, callee: Function, args: list[str]) -> str:
        knobs = ["knobs"] if callee.knobs else []
        return f"{callee.name}({', '.join(args + knobs + list(callee.flags + callee.backend_flags))})"


def _triton_body(em: TritonEmitter, stmts: list, indent: str) -> list[str]:
    out = []
    for st in stmts:
        if isinstance(st, (ast.Assign, ast.AnnAssign)):
            target = st.targets[0] if isinstance(st, ast.Assign) else st.target
            out.append(f"{indent}{target.id} = {em.arg(st.value)}")
        elif isinstance(st, ast.If):
            out.append(f"{indent}if {st.test.id}:")
            out += _triton_body(em, st.body, indent + "    ")
            orelse = st.orelse
            while len(orelse) == 1 and isinstance(orelse[0], ast.If):
                out.append(f"{indent}elif {orelse[0].test.id}:")
                out += _triton_body(em, orelse[0].body, indent + "    ")
                orelse = orelse[0].orelse
            if orelse:
                out.append(f"{indent}else:")
                out += _triton_body(em, orelse, indent + "    ")
        elif isinstance(st, ast.Return):
            values = st.value.elts if isinstance(st.value, ast.Tuple) else [st.value]
            out.append(f"{indent}return {', '.join(em.arg(v) for v in values)}")
        else:
            raise ValueError(f"{em.fn.name}: Triton cannot emit {ast.unparse(st)!r}")
    return out


def _own_knobs(fn: Function) -> list[str]:
    """The knobs ``fn``'s own statements name (its callees take the tuple whole).

    Raises:
        ValueError: a parameter or local of ``fn`` named like a knob (the unpacked knob would
            overwrite it).
    """
    nodes = [n for st in fn.body for n in ast.walk(st)]
    bound = {p.name for p in fn.params} | {n.id for n in nodes
                                           if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    clash = sorted(bound & set(KNOB_NAMES))
    if clash:
        raise ValueError(f"{fn.name}: parameters or locals named like knobs {clash}")
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    return [k for k in KNOB_NAMES if k in names]


def _triton_function(fn: Function, known: dict[str, Function]) -> list[str]:
    params = [p.name + (": tl.constexpr" if p.const else "") for p in fn.params]
    params += (["knobs"] if fn.knobs else []) + [f"{f}: tl.constexpr" for f in fn.flags + fn.backend_flags]
    signature = [f"def {fn.name}("]
    for i, p in enumerate(params):
        piece = p + ("):" if i == len(params) - 1 else ", ")
        if len(signature[-1] + piece.rstrip()) > 100:
            signature[-1] = signature[-1].rstrip()
            signature.append(" " * 8)
        signature[-1] += piece
    doc = textwrap.fill(" ".join(fn.fn.doc.split()), 100, initial_indent='    """',
                        subsequent_indent="    ", break_on_hyphens=False) + '"""'
    unpack = [f"    {k} = knobs[{KNOB_NAMES.index(k)}]" for k in _own_knobs(fn)]
    return ["", "", "@triton.jit", *signature, doc, *unpack,
            *_triton_body(TritonEmitter(fn, known), fn.body, "    ")]


def _knobs_loader() -> list[str]:
    """``ftrl_knobs(knobs_ptr)``: the kernels' one knob argument, read into the tuple the rule
    functions take."""
    loads = "".join(f"tl.load(knobs_ptr + {i}), " for i in range(len(KNOB_NAMES)))[:-2]
    loads += "," if len(KNOB_NAMES) == 1 else ""     # a tuple of one
    names = ", ".join(KNOB_NAMES)
    return ["", "", "@triton.jit", "def ftrl_knobs(knobs_ptr):",
            *textwrap.wrap(f'"""The knobs ({names}: rule_spec.KNOBS) from the fp32 tensor '
                           f'[{len(KNOB_NAMES)}] at knobs_ptr, as the tuple every rule function here '
                           'takes as its knobs argument."""', 96, initial_indent="    ",
                           subsequent_indent="    "),
            *textwrap.wrap(f"return ({loads})", 96, initial_indent="    ",
                           subsequent_indent="            ")]


_TRITON_PRELUDE = '''"""{header}.

The FTRL-Proximal rule and the stochastic-rounding hash of the Triton kernels: the SHARED and FAST
functions of torchrec_ftrl/rule_spec.py. The knobs are one tuple of fp32 scalars in
rule_spec.KNOBS order, read by ftrl_knobs from the kernels' one knob tensor.
"""

import triton
import triton.language as tl

from ..cuda.pow import pow_'''


def generate_triton(spec_fns: tuple = rule_spec.SHARED + rule_spec.FAST) -> str:
    """The text of ``cuda/rule_gen.py`` (of ``spec_fns``, :class:`~torchrec_ftrl.rule_spec.Fn` s)."""
    fns = functions(spec_fns, triton=True)
    known = {f.name: f for f in fns}
    lines = [_TRITON_PRELUDE.format(header=HEADER), *_knobs_loader()]
    for fn in fns:
        lines += _triton_function(fn, known)
    return "\n".join(lines) + "\n"
