"""Compact FTRL optimizer state: which dtype ``accum`` and ``linear`` are stored in, and how they are rounded.

FTRL keeps two element-wise states per weight element (``docs/ftrl.md``). By default both are fp32.
``optimizer_state_dtypes`` (FBGEMM's TBE keyword, with FTRL's state names) stores either or both in
bf16, halving its bytes; the math stays fp32 in registers: load (exact upcast), update in fp32, then
store with **stochastic rounding**, so the stored value is unbiased (its expectation is the fp32
value) and small increments of a large ``accum`` are not lost on average, as they would be under
round-to-nearest.

Accepted spellings, everywhere a state dtype is taken:

* FBGEMM's dict ``{"accum": SparseType.BF16, "linear": SparseType.BF16}`` (values may also be the
  ``torch.dtype`` or ``SparseType``'s int / string forms);
* the hashable form that TorchRec's ``fused_params`` need (TorchRec groups tables by hashing their
  ``fused_params``): a ``frozenset`` or ``tuple`` of ``(state, SparseType.as_int())`` pairs, which
  :func:`hashable_state_dtypes` returns (as TorchRec's own ``optimizer_state_dtypes_for_st``);
* ``None`` or an empty mapping: fp32 for both.

Only fp32 and bf16 are accepted: fp16 is refused because ``accum`` grows without bound and overflows
fp16's range (65504), and a half-precision ``linear`` beside an fp32 ``accum`` saves no more than bf16.

Stochastic rounding (fp32 -> bf16): the 16 bits that bf16 drops are compared with 16 random bits; the
value is rounded away from zero when they are larger (the classic integer-add form: add the random
bits to the fp32 bit pattern, then truncate). The random bits are a hash of (row key, column, step,
state), :func:`sr_bits`, the same integer function in every backend (Triton, C++, torch), so a run is
bitwise reproducible on its backend (and the same bits on every backend for the same fp32 value)
and nothing in the kernels draws from a global RNG. Non-finite values are not rounded: an Inf stays
Inf, a NaN stays a NaN (its quiet bit set, then truncated). Source of the method: M. Höhfeld and
S. E. Fahlman, "Probabilistic rounding in neural network learning with limited precision",
Neurocomputing 1992; Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from .fbgemm_enums import SparseType
from .rule_spec import CONSTANTS

STATE_NAMES = ("accum", "linear")
_SUPPORTED = {SparseType.FP32: torch.float32, SparseType.BF16: torch.bfloat16}
_BY_TORCH = {v: k for k, v in _SUPPORTED.items()}

# Constants of the (row, column, step, state) hash; lowbias32 by C. Wellons (public domain).
HASH_MUL1, HASH_MUL2, HASH_GOLDEN = (CONSTANTS[k] for k in ("HASH_MUL1", "HASH_MUL2", "HASH_GOLDEN"))
_M32 = 0xFFFFFFFF


def _as_sparse_type(where: str, state: str, value: Any) -> SparseType:
    if isinstance(value, torch.dtype):
        st = _BY_TORCH.get(value)
    elif isinstance(value, SparseType):
        st = value
    elif isinstance(value, bool):
        st = None
    elif isinstance(value, int):
        st = next((s for s in SparseType if s.as_int() == value), None)
    elif isinstance(value, str):
        st = next((s for s in SparseType if s.value == value.lower() or s.name == value.upper()), None)
    else:
        st = None
    if st is None or st not in _SUPPORTED:
        got = st.name if st is not None else repr(value)
        why = " (fp16 is refused: accum grows without bound and overflows its range)" \
            if st == SparseType.FP16 else ""
        raise ValueError(f"{where}[{state!r}] must be SparseType.FP32 or SparseType.BF16{why}, got {got}")
    return st


def parse_state_dtypes(value: Any, where: str = "optimizer_state_dtypes") -> dict[str, torch.dtype]:
    """``{"accum": dtype, "linear": dtype}`` (torch dtypes, fp32 where not given) from any accepted form.

    Raises:
        ValueError: not a mapping or an iterable of ``(state, dtype)`` pairs, a state name other than
            ``accum`` / ``linear`` (or one given twice), or a dtype other than fp32 / bf16; the message
            names ``where``, the key and the value.
    """
    out = {name: torch.float32 for name in STATE_NAMES}
    if value is None:
        return out
    if isinstance(value, Mapping):
        pairs: Iterable = value.items()
    elif isinstance(value, (frozenset, set, tuple, list)):
        pairs = value
    else:
        raise ValueError(f"{where} must be a dict {{state: SparseType}} or a frozenset of (state, "
                         f"SparseType.as_int()) pairs, got {value!r}")
    seen = set()
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"{where} must hold (state, dtype) pairs, got {pair!r}")
        state, dt = pair
        if state not in STATE_NAMES:
            raise ValueError(f"{where} keys must be FTRL's state names {STATE_NAMES}, got {state!r}")
        if state in seen:
            raise ValueError(f"{where} names state {state!r} twice")
        seen.add(state)
        out[state] = _SUPPORTED[_as_sparse_type(where, state, dt)]
    return out


# The options keys of FTRL's state dtype. ``optimizer_state_dtypes``: FBGEMM's keyword, per state (any
# form :func:`parse_state_dtypes` takes; in TorchRec's fused_params the hashable form). ``state_dtype``:
# one dtype for both states, the dense FTRL's keyword, which reaches fused_params from
# apply_optimizer_in_backward(torchrec.optim.FTRL, ..., {"state_dtype": ...}).
OPTIMIZER_STATE_DTYPES = "optimizer_state_dtypes"
STATE_DTYPE = "state_dtype"
# The dense FTRL's names of the state dtypes.
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def parse_one_state_dtype(value: Any, where: str = STATE_DTYPE) -> str:
    """``"fp32"`` or ``"bf16"``: one dtype for both states (the dense FTRL's ``state_dtype``), from
    ``None`` (fp32), ``torch.float32`` / ``torch.bfloat16``, ``SparseType.FP32`` / ``SparseType.BF16``
    (or their ``as_int()``), or the strings ``"fp32"`` / ``"bf16"`` (any case).

    Raises:
        ValueError: anything else (fp16 among them: ``accum`` overflows its range), naming ``where``
            and the value.
    """
    if value is None:
        return "fp32"
    try:
        dtype = parse_state_dtypes({"accum": value}, where)["accum"]
    except ValueError:
        raise ValueError(f"{where} must be fp32 or bf16 (torch.float32 / torch.bfloat16, SparseType.FP32 / "
                         f"SparseType.BF16, or 'fp32' / 'bf16'; fp16 is refused: accum overflows its "
                         f"range), got {value!r}") from None
    return DTYPE_NAMES[dtype]


def state_dtypes_from_options(options: Optional[Mapping[str, Any]],
                              where: str = "options") -> dict[str, torch.dtype]:
    """``{"accum": dtype, "linear": dtype}`` from an options mapping (TBE keywords, ``fused_params``):
    ``state_dtype`` (both states) when given and not None, else ``optimizer_state_dtypes`` (any form
    :func:`parse_state_dtypes` takes), else fp32.

    ``state_dtype`` wins because in a table's fused_params it can only come from the table's own
    in-backward optimizer kwargs (the sharders turn a sharder's ``state_dtype`` into
    ``optimizer_state_dtypes``), which TorchRec lets override the sharder's fused_params.

    Raises:
        ValueError: an invalid value, naming ``where``, the key and the value.
    """
    options = options or {}
    if options.get(STATE_DTYPE) is not None:
        name = parse_one_state_dtype(options[STATE_DTYPE], f"{where} {STATE_DTYPE}")
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        return {state: dtype for state in STATE_NAMES}
    return parse_state_dtypes(options.get(OPTIMIZER_STATE_DTYPES), f"{where} {OPTIMIZER_STATE_DTYPES}")


def hashable_state_dtypes(value: Any, where: str = "optimizer_state_dtypes") -> frozenset:
    """The ``fused_params`` form: ``frozenset`` of ``(state, SparseType.as_int())`` for the compact
    states only (fp32 states are left out, so fp32 everywhere is the empty set).

    Raises:
        ValueError: as :func:`parse_state_dtypes`.
    """
    parsed = parse_state_dtypes(value, where)
    return frozenset((s, _BY_TORCH[d].as_int()) for s, d in parsed.items() if d != torch.float32)


def state_sparse_types(dtypes: Mapping[str, torch.dtype]) -> dict[str, SparseType]:
    """``{"accum": SparseType, "linear": SparseType}`` of parsed dtypes (FBGEMM's spelling)."""
    return {s: _BY_TORCH[d] for s, d in dtypes.items()}


def state_bytes_per_element(dtypes: Mapping[str, torch.dtype]) -> int:
    """Bytes of ``accum`` + ``linear`` per weight element (8 for fp32 state, 4 for bf16 state)."""
    return sum(torch.empty(0, dtype=dtypes[s]).element_size() for s in STATE_NAMES)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)``, without int64 overflow (the product is
    split at 16 bits of ``c``: each partial product stays below 2^48)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_MUL2)
    return x ^ (x >> 16)


def sr_bits(row_key: torch.Tensor, col: torch.Tensor, step: int | torch.Tensor, state: int) -> torch.Tensor:
    """The 16 random bits (int64 in ``[0, 65536)``) that round element ``col`` of row ``row_key``
    (the TBE's global row key ``row_base[table] + row``, int64 >= 0) at optimizer step ``step``
    (the TBE's ``iter`` before the step's increment; int or int64 tensor, taken mod 2^32) of state
    ``state`` (0 accum, 1 linear). Broadcasts ``row_key``, ``col`` and a tensor ``step``. Every
    product is reduced mod 2^32, so this is exactly the uint32 arithmetic of the kernels
    (``sr_seed``, ``sr_row`` and ``sr_bits`` of ``rule_spec.py``, generated into both)::

        lowbias32(x) = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
        h = lowbias32(step * 0x9E3779B9 + state)
        h = lowbias32(h ^ (row_key mod 2^32) ^ (row_key >> 32))
        bits = (h + col * 0x9E3779B9) >> 16

    The row's hash ``h`` is uniform, so each element's bits are uniform and its rounding unbiased;
    across a row's columns the bits step by the golden ratio (a Weyl sequence), so the columns of one
    row round with stratified, not independent, bits. Per element this is one add and one shift: the
    kernels hash once per row and state, not once per element.
    """
    if not isinstance(step, torch.Tensor):
        step = torch.as_tensor(int(step), dtype=torch.int64)
    step = step.to(device=row_key.device, dtype=torch.int64) & _M32
    h = _lowbias32(_mul32(step, HASH_GOLDEN) + int(state))
    rk = row_key.to(torch.int64)
    h = _lowbias32(h ^ (rk & _M32) ^ ((rk >> 32) & _M32))
    return ((h + _mul32(col.to(torch.int64) & _M32, HASH_GOLDEN)) & _M32) >> 16


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with the random ``bits`` (int64 ``[0, 65536)``, broadcastable):
    add ``bits`` to the fp32 bit pattern and keep the high 16 bits (so the value rounds away from
    zero with probability ``dropped / 2^16``: unbiased). Non-finite values are not rounded: an Inf
    is truncated (stays Inf), a NaN gets its quiet bit set, then truncated (stays a NaN; a plain
    truncation could turn a NaN whose payload sits in the low 16 bits into an Inf). The bf16 result
    is formed from the bits directly (no float conversion), so every backend gives the same bits.
    Returns bf16 of the broadcast shape."""
    x = x.to(torch.float32)
    u = x.view(torch.int32).to(torch.int64) & _M32
    finite = (u & 0x7F800000) != 0x7F800000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    u = torch.where(finite, u + bits, torch.where(nan, u | 0x00400000, u))
    hi = (u >> 16) & 0xFFFF
    hi = torch.where(hi >= 2**15, hi - 2**16, hi).to(torch.int16)
    return hi.view(torch.bfloat16)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """float64 spacing of bf16 values at ``|x|``: ``2^(e - 7)`` for ``2^e <= |x| < 2^(e+1)``
    (bf16 keeps 8 significand bits), the subnormal spacing ``2^-133`` below ``2^-126``. Stochastic
    rounding moves a value by less than this (to one of its two bf16 neighbours)."""
    a = x.double().abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    e = torch.clamp(e, min=-126.0)
    return torch.exp2(e - 7.0)


def store_state(x: torch.Tensor, dtype: torch.dtype, row_key: torch.Tensor, col: torch.Tensor,
                step: int | torch.Tensor, state: int) -> torch.Tensor:
    """fp32 ``x`` in the storage ``dtype``: itself for fp32, stochastically rounded for bf16."""
    if dtype == torch.float32:
        return x
    return round_bf16_stochastic(x, sr_bits(row_key, col, step, state))


def describe(dtypes: Optional[Mapping[str, torch.dtype]]) -> str:
    """``"accum=fp32, linear=bf16"``, for messages and ``extra_repr``."""
    dtypes = dtypes or parse_state_dtypes(None)
    return ", ".join(f"{s}={_BY_TORCH[dtypes[s]].value}" for s in STATE_NAMES)
