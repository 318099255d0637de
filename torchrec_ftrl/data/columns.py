"""Vectorised field decoders for the arrow parser: one pyarrow binary column in, numpy arrays out.

Every decoder returns ``(values, ok)``: ``ok`` (bool ``[n]``) marks the values it decoded exactly as
the per-line rules of :mod:`.reader` would (``hex_id``, ``string_id``, ``_parse_label``,
``_parse_int``, ``_parse_float``, ``log_transform``). A value outside the simple forms below (a sign
or whitespace, ``0x``/``_``, ``inf``, invalid UTF-8, more than 16 hex digits, ...) is *not ok*, valid
or not: the caller re-parses that row with the per-line code. Inputs are ``pa.BinaryArray`` with one
null per empty field (the CSV read maps ``""`` to null) and no other nulls.
"""

from __future__ import annotations

import hashlib
import math
from typing import Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble; 255 = not a hex digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
# two ASCII bytes (read as one native uint16) -> the byte their two hex digits spell; 256 = not hex
_hi, _lo = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
_pair = np.where((_HEX[_hi] < 16) & (_HEX[_lo] < 16), _HEX[_hi].astype(np.uint16) * 16 + _HEX[_lo], 256)
_HEX2 = np.zeros(65536, dtype=np.uint16)
_HEX2[np.frombuffer(np.stack([_hi, _lo], -1).astype(np.uint8).tobytes(), dtype=np.uint16)] = _pair.reshape(-1)
del _hi, _lo, _pair
_INT_BYTES = np.zeros(256, dtype=bool)  # bytes of a "-?[0-9]+" value
_INT_BYTES[list(b"0123456789-")] = True
_INT_RE = r"^-?[0-9]{1,18}$"
_FLOAT_RE = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$"
_LOG1P_INTS = 1 << 16
_MAX_TABLE = 1 << 62  # larger tables: ids are left to the per-line code (exact big-int arithmetic)
_log1p_table = None


def _parts(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets int64 [n+1], data uint8, present bool [n])`` of a binary array (offset-adjusted)."""
    _, ob, db = arr.buffers()
    off = np.frombuffer(ob, dtype=np.int32)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(db, dtype=np.uint8) if db is not None else np.zeros(0, dtype=np.uint8)
    present = np.diff(off) > 0  # the CSV read gives every null (empty field) length 0, and only those
    if int(len(arr) - present.sum()) != arr.null_count:
        present = arr.is_valid().to_numpy(zero_copy_only=False)
    return off, data, present


def decode_label(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """int64 ``[n]`` labels; ok where the field is exactly ``"0"`` or ``"1"``."""
    off, data, _ = _parts(arr)
    one_byte = np.diff(off) == 1
    first = data[np.minimum(off[:-1], max(len(data) - 1, 0))] if len(data) else np.zeros(len(arr), np.uint8)
    ok = one_byte & ((first == 48) | (first == 49))
    return np.where(ok, first.astype(np.int64) - 48, 0), ok


def decode_int(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """float64 ``[n]`` of ``float(int(v))`` (0.0 for an empty field); ok for ``-?[0-9]{1,18}``."""
    off, data, present = _parts(arr)
    n = len(arr)
    lens = np.diff(off)
    if not present.any():
        return np.zeros(n), np.ones(n, dtype=bool)
    if lens.max() <= 18 and _INT_BYTES[data[off[0]:off[-1]]].all():
        try:  # only digits and '-': arrow's integer parse agrees with int() wherever it succeeds
            x = pc.cast(arr, pa.int64()).fill_null(0).to_numpy()
            return x.astype(np.float64), np.ones(n, dtype=bool)
        except pa.ArrowInvalid:
            pass  # e.g. "1-2": find the simple values one by one below
    simple = pc.match_substring_regex(arr, _INT_RE).fill_null(False).to_numpy(zero_copy_only=False)
    x = pc.cast(arr.filter(pa.array(simple)), pa.int64()).to_numpy().astype(np.float64)
    out = np.zeros(n)
    out[simple] = x
    return out, simple | ~present


def decode_float(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """float64 ``[n]`` of ``float(v)`` (0.0 for an empty field); ok for plain decimal / exponent forms
    whose value is finite (``inf``, ``nan``, ``1e999`` are left to the per-line code)."""
    _, _, present = _parts(arr)
    n = len(arr)
    simple = pc.match_substring_regex(arr, _FLOAT_RE).fill_null(False).to_numpy(zero_copy_only=False)
    out = np.zeros(n)
    if simple.any():
        try:
            out[simple] = pc.cast(arr.filter(pa.array(simple)), pa.float64()).to_numpy()
        except pa.ArrowInvalid:
            simple = np.zeros(n, dtype=bool)
            out[:] = 0.0
    fin = np.isfinite(out)
    simple &= fin
    out[~fin] = 0.0
    return out, simple | ~present


def log1p_exact(x: np.ndarray) -> np.ndarray:
    """float64 ``log_transform`` of every element: ``math.log1p(x)`` where ``x > 0``, else 0.0.

    Computed by ``math.log1p`` itself (a table for the integers below 65536, one call per other
    distinct value), so the bits equal the per-line reader's on any machine (numpy's SIMD ``log1p``
    may differ in the last bit)."""
    global _log1p_table
    if _log1p_table is None:
        _log1p_table = np.array([math.log1p(float(k)) for k in range(_LOG1P_INTS)])
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.shape)
    pos = x > 0
    small = pos & (x < _LOG1P_INTS) & (x == np.floor(x))
    out[small] = _log1p_table[x[small].astype(np.int64)]
    rest = pos & ~small
    if rest.any():
        u, inv = np.unique(x[rest], return_inverse=True)
        out[rest] = np.array([math.log1p(v) for v in u.tolist()])[inv]
    return out


def decode_hex(arr: pa.Array, num_embeddings: int) -> Tuple[np.ndarray, np.ndarray]:
    """int64 ``[n]`` ids ``int(v, 16) % num_embeddings`` (-1 for an empty field); ok for 1..16 hex
    digits and nothing else."""
    off, data, present = _parts(arr)
    n = len(arr)
    lens = np.diff(off)
    ids = np.full(n, -1, dtype=np.int64)
    ok = ~present
    fits = present & (lens <= 16)
    m = int(fits.sum())
    if m == 0 or num_embeddings >= _MAX_TABLE:
        return ids, ok
    flen = lens[fits]
    widest = int(flen.max())
    width = 8 if widest <= 8 else 16  # nibbles per value after left zero-padding
    idx = np.flatnonzero(fits)
    if widest == width and int(flen.min()) == width and m == int(present.sum()):
        # every present value has `width` digits, back to back in data[off[0]:off[-1]]: look the
        # digit pairs up two bytes at a time
        pairs = _HEX2[data[off[0]:off[-1]].view(np.uint16)]
        if pairs.max() > 255:  # a non-hex byte: leave its row to the per-line parser
            good = (pairs.reshape(m, width // 2) <= 255).all(axis=1)
            pairs = np.where(pairs <= 255, pairs, 0)
        else:
            good = None
        packed = pairs.astype(np.uint8).reshape(m, width // 2)
    else:  # right-align each value's nibbles in its row (leading zeros)
        nib = np.zeros((m, width), dtype=np.uint8)
        starts = off[:-1][fits]
        src = _ranges(starts, flen)
        dst = src + np.repeat(np.arange(m, dtype=np.int64) * width + width - flen - starts, flen)
        nib.reshape(-1)[dst] = _HEX[data[src]]
        if (nib == 255).any():
            good = ~(nib == 255).any(axis=1)
            nib = np.where(good[:, None], nib, 0).astype(np.uint8)
        else:
            good = None
        packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])  # big-endian bytes
    if width == 8:
        val = packed.view(">u4").reshape(m).astype(np.int64) % num_embeddings
    else:
        val = (packed.view(">u8").reshape(m).astype(np.uint64) % np.uint64(num_embeddings)).astype(np.int64)
    if good is None:
        ids[idx] = val
        ok[idx] = True
    else:
        ids[idx[good]] = val[good]
        ok[idx[good]] = True
    return ids, ok


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + k)`` for each start ``s`` and length ``k`` (int64)."""
    total = int(lens.sum())
    step = np.ones(total, dtype=np.int64)
    heads = np.cumsum(lens)[:-1]
    step[0] = starts[0]
    step[heads] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
    return np.cumsum(step)


def decode_string(arr: pa.Array, num_embeddings: int) -> Tuple[np.ndarray, np.ndarray]:
    """int64 ``[n]`` ids ``string_id(v, num_embeddings)`` (-1 for an empty field), hashing each
    distinct value once; ok unless the value is not valid UTF-8 (the per-line reader hashes its
    U+FFFD-replaced text)."""
    n = len(arr)
    ids = np.full(n, -1, dtype=np.int64)
    ok = np.ones(n, dtype=bool)
    if num_embeddings >= _MAX_TABLE:
        return ids, ~_parts(arr)[2]
    enc = pc.dictionary_encode(arr)
    values = enc.dictionary.to_pylist()
    if not values:
        return ids, ok
    digests = [hashlib.blake2b(v, digest_size=8).digest() for v in values]
    h = np.frombuffer(b"".join(digests), dtype="<u8") % np.uint64(num_embeddings)
    try:
        enc.dictionary.cast(pa.string())
        bad_value = None
    except pa.ArrowInvalid:
        bad_value = np.array([not _is_utf8(v) for v in values])
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    present = codes >= 0
    ids[present] = h[codes[present]].astype(np.int64)
    if bad_value is not None:
        ok[present] = ~bad_value[codes[present]]
    return ids, ok


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
