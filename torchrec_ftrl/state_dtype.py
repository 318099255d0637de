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
bitwise reproducible on its backend and nothing in the kernels draws from a global RNG. Non-finite
values are truncated (an Inf stays Inf, a NaN stays NaN). Source of the method: M. Höhfeld and
S. E. Fahlman, "Probabilistic rounding in neural network learning with limited precision",
Neurocomputing 1992; Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from .fbgemm_enums import SparseType

STATE_NAMES = ("accum", "linear")
_SUPPORTED = {SparseType.FP32: torch.float32, SparseType.BF16: torch.bfloat16}
_BY_TORCH = {v: k for k, v in _SUPPORTED.items()}

# Constants of the (row, column, step, state) hash; lowbias32 by C. Wellons (public domain).
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B
HASH_GOLDEN = 0x9E3779B9
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
        raise ValueError(f"{where}[{state!r}] must be SparseType.FP32 or SparseType.BF16 (fp16 is refused: "
                         f"accum overflows its range), got {got}")
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


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & _M32
    return x ^ (x >> 16)


def sr_bits(row_key: torch.Tensor, col: torch.Tensor, step: int | torch.Tensor, state: int) -> torch.Tensor:
    """The 16 random bits (int64 in ``[0, 65536)``) that round element ``col`` of row ``row_key``
    (the TBE's global row key, int64) at optimizer step ``step`` of state ``state`` (0 accum,
    1 linear). Broadcasts ``row_key`` against ``col``. The kernels compute the same function in
    uint32 arithmetic::

        h = lowbias32(step * 0x9E3779B9 + state)
        h = lowbias32(h ^ (row_key mod 2^32) ^ (row_key >> 32))
        bits = lowbias32(h ^ col) >> 16
    """
    step = torch.as_tensor(step, dtype=torch.int64, device=row_key.device)
    h = _lowbias32(step * HASH_GOLDEN + state)
    rk = row_key.to(torch.int64)
    h = _lowbias32(h ^ (rk & _M32) ^ ((rk >> 32) & _M32))
    h = _lowbias32(h ^ col.to(torch.int64))
    return h >> 16


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 with the random ``bits`` (int64 ``[0, 65536)``, broadcastable):
    add ``bits`` to the fp32 bit pattern's low half and truncate; non-finite values are truncated."""
    x = x.to(torch.float32)
    u = x.view(torch.int32).to(torch.int64) & _M32
    finite = torch.isfinite(x)
    u = torch.where(finite, u + bits, u) & 0xFFFF0000
    u = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)
    return u.view(torch.float32).to(torch.bfloat16)


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
