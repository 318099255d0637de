"""Convert one raw Criteo file to a binary triplet (the arrays ``BinaryCriteoUtils.tsv_to_npys``
writes; see :mod:`.npy_layout`), streaming in bounded memory, without leaving a partial array under
its final name.

Input formats (:data:`FORMATS`); plain or gzip-compressed (``.gz``):

* ``tsv``: the raw Criteo TSV, 40 TAB-separated fields ``label, I1..I13, C1..C26``, no header (the
  1TB Click Logs days ``day_0`` .. ``day_23`` and the Kaggle ``train.txt``).
* ``kaggle-csv``: the Kaggle CSV, header ``Id,Label,I1,..,I13,C1,..,C26`` and 41 comma-separated
  fields (CRLF line ends are accepted).

A row is valid under the rules of :class:`CTRFileReader` (label 0/1, integer dense values, hex
categorical values without sign or blanks, an empty field is missing), and also needs dense values
within int32 and categorical values below 2**63 (the stored dtypes). Blank lines are ignored;
malformed rows are skipped and counted (``strict``: the first one raises).

Output, for ``n`` valid rows: ``PREFIX_dense.npy`` float32 ``[n, 13]`` = ``log(x - m + 2)`` (``x`` the
integer value, 0 when missing; ``m`` the smallest ``x`` in the file), ``PREFIX_sparse.npy`` int64
``[n, 26]`` = ``int(hex, 16)`` (0 when missing), ``PREFIX_labels.npy`` int32 ``[n, 1]``: byte for
byte what ``tsv_to_npys`` writes for the same valid rows. Memory: one chunk of rows as Python
lists (about 25 MB) plus one dense chunk while transforming.

Each array is written to ``.PREFIX_KIND.npy.tmp`` in the output folder (a hidden name that readers
ignore): pass 1 appends the rows (dense as raw int32), pass 2 turns the dense block into float32 in
place, the headers are rewritten with the final row count, and then each file is renamed with
``os.replace`` (dense, sparse, then labels).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
from typing import Callable, List, Optional

import numpy as np

from .hashing import hex_id
from .npy_layout import array_path, complete_triplet
from .line_parser import MalformedRowError, ReadStats, _Bad, _parse_int, _parse_label, record_bad

NUM_DENSE, NUM_SPARSE = 13, 26
CHUNK_ROWS = 16384
_I32 = (-(2 ** 31), 2 ** 31 - 1)
_I64_MAX = 2 ** 63 - 1
_DTYPES = {"dense": np.dtype("<f4"), "sparse": np.dtype("<i8"), "labels": np.dtype("<i4")}
_COLUMNS = {"dense": NUM_DENSE, "sparse": NUM_SPARSE, "labels": 1}


class ConvertError(ValueError):
    """An input that cannot be converted; the message is one line naming the file."""


@dataclasses.dataclass(frozen=True)
class Format:
    """Field layout of one input format: ``delimiter``, ``num_fields``, ``label`` (index), ``dense``
    (first dense field index; 13 follow, then the 26 categorical fields), ``header`` (the expected
    first line, or ``None`` for no header)."""

    delimiter: str
    num_fields: int
    label: int
    dense: int
    header: Optional[str] = None


FORMATS = {
    "tsv": Format("\t", 40, label=0, dense=1),
    "kaggle-csv": Format(",", 41, label=1, dense=2, header=",".join(
        ["Id", "Label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)])),
}


@dataclasses.dataclass
class ConvertResult:
    """``prefix``, valid ``rows`` written, the :class:`ReadStats` of the pass."""

    prefix: str
    rows: int
    stats: ReadStats


def temp_path(out_dir: str, prefix: str, kind: str) -> str:
    """The temporary name of one array while it is written: ``out_dir/.PREFIX_KIND.npy.tmp``."""
    return os.path.join(out_dir, f".{prefix}_{kind}.npy.tmp")


def open_text(path: str):
    """``(text file, binary file)`` of ``path`` (gzip-decoded when it ends with ``.gz``); the binary
    file's ``tell()`` is the position in the file on disk (for progress)."""
    raw = open(path, "rb")
    stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    return io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=""), raw


def _parse_fast(fields: List[str], fmt: Format):
    """``(label, dense list, sparse list)`` of a row without odd characters, or ``None``."""
    lab = fields[fmt.label]
    if lab != "0" and lab != "1":
        return None
    d0 = fmt.dense
    try:
        dense = [int(v) if v else 0 for v in fields[d0:d0 + NUM_DENSE]]
        sparse = [int(v, 16) if v else 0 for v in fields[d0 + NUM_DENSE:d0 + NUM_DENSE + NUM_SPARSE]]
    except ValueError:
        return None
    if min(dense) < _I32[0] or max(dense) > _I32[1] or min(sparse) < 0 or max(sparse) > _I64_MAX:
        return None
    return int(lab), dense, sparse


def _parse_checked(fields: List[str], fmt: Format):
    """``(label, dense, sparse)`` under the exact rules of the text reader, or raise ``_Bad``."""
    label = _parse_label(fields[fmt.label])
    d0 = fmt.dense
    dense = []
    for i in range(d0, d0 + NUM_DENSE):
        v = fields[i]
        x = int(_parse_int(v, i)) if v else 0
        if not _I32[0] <= x <= _I32[1]:
            raise _Bad("dense", f"field {i}: {v!r} is outside int32")
        dense.append(x)
    sparse = []
    for i in range(d0 + NUM_DENSE, d0 + NUM_DENSE + NUM_SPARSE):
        v = fields[i]
        if not v:
            sparse.append(0)
            continue
        try:
            x = hex_id(v, _I64_MAX + 1)
        except ValueError:
            raise _Bad("categorical", f"field {i}: not a hex value: {v!r}") from None
        if int(v, 16) > _I64_MAX:
            raise _Bad("categorical", f"field {i}: {v!r} is not below 2**63")
        sparse.append(x)
    return label, dense, sparse


def parse_line(line: str, fmt: Format):
    """``(label, dense [13] ints, sparse [26] ints)`` of one line (line end stripped).

    Raises:
        _Bad: a malformed row (kind and detail, as the text reader names them).
    """
    fields = line.split(fmt.delimiter)
    if len(fields) != fmt.num_fields:
        raise _Bad("field_count", f"expected {fmt.num_fields} fields, got {len(fields)}")
    if "_" not in line and " " not in line and "+" not in line:
        row = _parse_fast(fields, fmt)
        if row is not None:
            return row
    return _parse_checked(fields, fmt)


class _ArrayWriter:
    """Appends C-order rows to ``.npy`` file ``path`` whose header is rewritten at ``close``."""

    def __init__(self, path: str, dtype: np.dtype, columns: int) -> None:
        self.path, self.dtype, self.columns, self.rows = path, np.dtype(dtype), columns, 0
        self.f = open(path, "wb")
        self.offset = self._header(0)

    def _header(self, rows: int, dtype: Optional[np.dtype] = None) -> int:
        np.lib.format.write_array_header_1_0(self.f, {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype or self.dtype)),
            "fortran_order": False, "shape": (rows, self.columns)})
        return self.f.tell()

    def append(self, block: np.ndarray) -> None:
        write_block(self.f, np.ascontiguousarray(block, dtype=self.dtype))
        self.rows += block.shape[0]

    def finish(self, dtype: Optional[np.dtype] = None) -> None:
        """Rewrite the header for the rows written (and ``dtype`` when given), flush, close.

        Raises:
            RuntimeError: the new header has another length (numpy pads headers so that the row
                count can grow in place; a numpy without that padding is refused).
        """
        self.f.flush()
        self.f.seek(0)
        if self._header(self.rows, dtype) != self.offset:
            raise RuntimeError(f"{self.path}: npy header length changed; cannot finish in place")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        self.f.close()


def write_block(f, block: np.ndarray) -> None:
    """Append the bytes of ``block`` to the open file ``f`` (one call per chunk)."""
    f.write(block.tobytes())


def _dense_to_log(path: str, offset: int, rows: int, m: int) -> None:
    """In place: raw int32 ``x`` -> float32 ``log(x - m + 2)`` (``tsv_to_npys``'s arithmetic: an
    int32 subtraction, then ``np.log(..., dtype=float32)``)."""
    if rows == 0:
        return
    ints = np.memmap(path, dtype="<i4", mode="r+", offset=offset, shape=(rows, NUM_DENSE))
    floats = np.memmap(path, dtype="<f4", mode="r+", offset=offset, shape=(rows, NUM_DENSE))
    shift = np.int32(m - 2)
    for a in range(0, rows, 1 << 18):
        b = min(rows, a + (1 << 18))
        floats[a:b] = np.log(ints[a:b] - shift, dtype=np.float32)
    floats.flush()
    del ints, floats


def convert_file(in_path: str, out_dir: str, prefix: str, fmt: str = "tsv", strict: bool = False,
                 progress: Optional[Callable[[int], None]] = None) -> ConvertResult:
    """Convert ``in_path`` to ``out_dir/PREFIX_{dense,sparse,labels}.npy``.

    Args:
        fmt: a key of :data:`FORMATS`.
        strict: raise at the first malformed row instead of skipping it.
        progress: called with the number of input bytes (on disk) consumed since the last call.

    Raises:
        ConvertError: a header other than the format's, a malformed row under ``strict`` (naming
            file and line), or no valid row (naming the first malformed ones). The temporary
            files are removed; no final file of ``prefix`` is created.
    """
    layout = FORMATS[fmt]
    stats = ReadStats()
    temps = {k: temp_path(out_dir, prefix, k) for k in _DTYPES}
    writers = {"dense": _ArrayWriter(temps["dense"], np.dtype("<i4"), NUM_DENSE),
               "sparse": _ArrayWriter(temps["sparse"], _DTYPES["sparse"], NUM_SPARSE),
               "labels": _ArrayWriter(temps["labels"], _DTYPES["labels"], 1)}
    ok = False
    try:
        m = _write_rows(in_path, layout, strict, stats, writers, progress)
        if stats.valid == 0:
            raise ConvertError(f"{in_path}: no valid row for --format {fmt} ({stats.summary()})")
        w = writers["dense"]
        w.f.flush()
        _dense_to_log(w.path, w.offset, w.rows, m)
        w.finish(_DTYPES["dense"])
        writers["sparse"].finish()
        writers["labels"].finish()
        for kind in ("dense", "sparse", "labels"):  # labels last: the triplet is complete after it
            os.replace(temps[kind], array_path(out_dir, prefix, kind))
        ok = True
    finally:
        if not ok:
            for w in writers.values():
                w.abort()
            for p in temps.values():
                if os.path.exists(p):
                    os.remove(p)
    return ConvertResult(prefix, stats.valid, stats)


def _write_rows(in_path, layout: Format, strict, stats: ReadStats, writers, progress) -> int:
    """Pass 1: parse and append every valid row; returns the smallest dense value (0 when none)."""
    text, raw = open_text(in_path)
    m = None
    labels: list = []
    dense: list = []
    sparse: list = []
    reported = 0

    def flush() -> None:
        nonlocal m, reported
        if labels:
            d = np.array(dense, dtype=np.int32)
            lo = int(d.min())
            m = lo if m is None else min(m, lo)
            writers["dense"].append(d)
            writers["sparse"].append(np.array(sparse, dtype=np.int64))
            writers["labels"].append(np.array(labels, dtype=np.int32).reshape(-1, 1))
            labels.clear(), dense.clear(), sparse.clear()
        if progress is not None:
            pos = raw.tell()
            progress(pos - reported)
            reported = pos

    with text:
        for lineno, line in enumerate(text, start=1):
            line = line.rstrip("\r\n")
            if lineno == 1 and layout.header is not None:
                if line != layout.header:
                    raise ConvertError(f"{in_path}:1: header {line[:80]!r}... is not "
                                       f"{layout.header[:40]!r}... (an unlabeled test file has no "
                                       f"Label column and cannot be converted)")
                continue
            if not line:
                stats.blank += 1
                continue
            stats.lines += 1
            try:
                lab, d, s = parse_line(line, layout)
            except _Bad as bad:
                try:
                    record_bad(stats, strict, in_path, lineno, bad)
                except MalformedRowError as e:   # strict: the same message, as this module's error
                    raise ConvertError(str(e)) from None
                continue
            stats.valid += 1
            labels.append(lab)
            dense.append(d)
            sparse.append(s)
            if len(labels) == CHUNK_ROWS:
                flush()
        flush()
    return 0 if m is None else m


def convert_file_torchrec(in_path: str, out_dir: str, prefix: str) -> ConvertResult:
    """Convert a plain ``tsv`` file with TorchRec's own ``BinaryCriteoUtils.tsv_to_npys`` (written
    to the temporary names, then renamed like :func:`convert_file`). It holds the whole file in
    memory as Python lists (a peak of about 1.5 KB per row) and stops with TorchRec's exception at a malformed
    or blank line, so it serves small files; :func:`convert_file` writes the same bytes.

    Raises:
        ConvertError: TorchRec's converter failed (its exception, in one line).
    """
    from torchrec.datasets.criteo import BinaryCriteoUtils

    temps = {k: temp_path(out_dir, prefix, k) for k in _DTYPES}
    ok = False
    try:
        try:
            BinaryCriteoUtils.tsv_to_npys(in_path, temps["dense"], temps["sparse"], temps["labels"])
        except Exception as e:  # TorchRec raises IndexError/ValueError/OverflowError on bad rows
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConvertError(f"{in_path}: BinaryCriteoUtils.tsv_to_npys failed: "
                               f"{type(e).__name__}: {first}") from None
        rows = int(np.load(temps["labels"], mmap_mode="r").shape[0])
        for kind in ("dense", "sparse", "labels"):
            os.replace(temps[kind], array_path(out_dir, prefix, kind))
        ok = True
    finally:
        if not ok:
            for p in temps.values():
                if os.path.exists(p):
                    os.remove(p)
    stats = ReadStats(lines=rows, valid=rows)
    return ConvertResult(prefix, rows, stats)


def is_converted(out_dir: str, prefix: str) -> bool:
    """Whether ``out_dir`` holds a complete triplet of ``prefix`` as :func:`convert_file` writes it:
    all three files, sizes matching their headers, equal row counts, and the dtypes and column
    counts above."""
    t = complete_triplet(out_dir, prefix)
    if t is None:
        return False
    return all(getattr(t, k).dtype == _DTYPES[k] and getattr(t, k).shape[1] == _COLUMNS[k]
               for k in _DTYPES)
