"""TorchRec's binary Criteo layout: a folder of ``PREFIX_dense.npy`` / ``PREFIX_sparse.npy`` /
``PREFIX_labels.npy`` triplets, one per converted input file (e.g. ``day_0_*`` .. ``day_23_*``).

What ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` writes, per input file of ``n`` rows:

* ``PREFIX_dense.npy``: float32 ``[n, 13]``, ``log(x - m + 2)`` of the integer features ``x`` (a
  missing value is ``x = 0``; ``m`` is the smallest ``x`` of the whole file, all 13 columns);
* ``PREFIX_sparse.npy``: int64 ``[n, 26]``, ``int(hex, 16)`` of the categorical values (a missing
  value is 0);
* ``PREFIX_labels.npy``: int32 ``[n, 1]``, 0/1.

This module finds the triplets of a folder and checks them from their ``.npy`` headers and file sizes
only (no data is read): every array present, C order, the dtypes and shapes above (the column counts
may be other than 13 / 26 but must agree across files; sparse may also be int32 / uint32; labels any
integer dtype), equal row counts within a triplet, and file sizes that match the header (a truncated
or over-long file is refused).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .line_parser import MalformedRowError

ARRAYS = ("dense", "sparse", "labels")
DENSE_DTYPES = (np.dtype(np.float32),)
SPARSE_DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint32))
_SUFFIX = re.compile(r"^(?P<prefix>.+)_(?P<kind>dense|sparse|labels)\.npy$")


class BinaryLayoutError(MalformedRowError):
    """A binary layout that cannot be read: the message is ``"{path}: {what is wrong}"`` (a
    ValueError; the job prints it as one ``train_ctr: error:`` line and exits with status 2)."""


@dataclasses.dataclass(frozen=True)
class NpyInfo:
    """Header of one ``.npy`` file: ``shape``, ``dtype``, ``offset`` (bytes before the data)."""

    path: str
    shape: Tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def rows(self) -> int:
        return int(self.shape[0]) if self.shape else 0


@dataclasses.dataclass(frozen=True)
class Triplet:
    """One checked triplet: ``prefix``, the three paths, ``rows``, ``num_dense``, ``num_sparse``."""

    prefix: str
    dense: NpyInfo
    sparse: NpyInfo
    labels: NpyInfo

    @property
    def rows(self) -> int:
        return self.labels.rows

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def num_sparse(self) -> int:
        return int(self.sparse.shape[1])

    def path_of(self, kind: str) -> str:
        """The file of ``kind`` (``"dense"``, ``"sparse"`` or ``"labels"``)."""
        return getattr(self, kind).path


def array_path(folder: str, prefix: str, kind: str) -> str:
    """``folder/PREFIX_{dense,sparse,labels}.npy``."""
    return os.path.join(folder, f"{prefix}_{kind}.npy")


def read_header(path: str) -> NpyInfo:
    """The header of ``path``, checked against the file size.

    Raises:
        FileNotFoundError: no such file.
        BinaryLayoutError: not an ``.npy`` file, Fortran order, or a size other than
            ``offset + prod(shape) * itemsize`` bytes (truncated or over-long), naming the path.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: binary array not found")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            if major == 1:
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            offset = f.tell()
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise BinaryLayoutError(f"{path}: not a readable .npy file ({e})") from None
    if fortran:
        raise BinaryLayoutError(f"{path}: Fortran-ordered array; expected C order (as np.save writes)")
    want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != want:
        what = "truncated" if size < want else "longer than its header says"
        raise BinaryLayoutError(f"{path}: {what}: {size} bytes, expected {want} for "
                                f"{dtype} {tuple(shape)}")
    return NpyInfo(path, tuple(int(x) for x in shape), dtype, offset)


def find_prefixes(folder: str) -> List[str]:
    """Prefixes of the ``PREFIX_{dense,sparse,labels}.npy`` files in ``folder``, in natural order
    (``day_2`` before ``day_10``); hidden files (temporary outputs) are ignored.

    Raises:
        FileNotFoundError: ``folder`` is not a directory, or holds no such file.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: binary data folder not found")
    prefixes = {m.group("prefix") for name in os.listdir(folder)
                if not name.startswith(".") and (m := _SUFFIX.match(name))}
    if not prefixes:
        raise FileNotFoundError(f"{folder}: no PREFIX_dense.npy / PREFIX_sparse.npy / "
                                f"PREFIX_labels.npy files (empty binary data folder)")
    return sorted(prefixes, key=natural_key)


def natural_key(s: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p]


def check_triplet(folder: str, prefix: str) -> Triplet:
    """Read and check the three headers of ``prefix``.

    Raises:
        FileNotFoundError: one of the three arrays is missing (naming it and the ones present).
        BinaryLayoutError: a bad file (see :func:`read_header`), a wrong dtype or shape (dense float32
            ``[n, D]``, sparse int64/int32/uint32 ``[n, F]`` with ``F >= 1``, labels integer
            ``[n, 1]``), or row counts that differ within the triplet.
    """
    paths = {k: array_path(folder, prefix, k) for k in ARRAYS}
    missing = [k for k in ARRAYS if not os.path.isfile(paths[k])]
    if missing:
        present = [os.path.basename(paths[k]) for k in ARRAYS if k not in missing]
        raise FileNotFoundError(f"{paths[missing[0]]}: missing array of the triplet {prefix!r} "
                                f"(present: {', '.join(present) or 'none'})")
    info = {k: read_header(paths[k]) for k in ARRAYS}
    d, s, lab = info["dense"], info["sparse"], info["labels"]
    check_dense_labels(d, lab)
    check_sparse(s, "[n, num_sparse]", "categorical column")
    if not d.rows == s.rows == lab.rows:
        raise BinaryLayoutError(f"{os.path.join(folder, prefix)}_*.npy: row counts differ: dense "
                                f"{d.rows}, sparse {s.rows}, labels {lab.rows}")
    return Triplet(prefix, d, s, lab)


def check_dense_labels(d: NpyInfo, lab: NpyInfo) -> None:
    """The dtype and shape checks of a triplet's dense (float32 ``[n, D]``) and labels (integer
    ``[n, 1]``) arrays. Raises: BinaryLayoutError naming the file."""
    if d.dtype not in DENSE_DTYPES:
        raise BinaryLayoutError(f"{d.path}: dtype {d.dtype}, expected float32 (log-transformed "
                                f"dense features, as BinaryCriteoUtils.tsv_to_npys writes)")
    if not (np.issubdtype(lab.dtype, np.integer) or lab.dtype == np.bool_):
        raise BinaryLayoutError(f"{lab.path}: dtype {lab.dtype}, expected an integer dtype (int32) "
                                f"of 0/1 labels")
    for a, what in ((d, "[n, num_dense]"), (lab, "[n, 1]")):
        if len(a.shape) != 2:
            raise BinaryLayoutError(f"{a.path}: shape {a.shape}, expected 2-D {what}")
    if lab.shape[1] != 1:
        raise BinaryLayoutError(f"{lab.path}: shape {lab.shape}, expected [n, 1]")


def check_sparse(s: NpyInfo, shape: str, column: str) -> None:
    """The dtype (int64, int32 or uint32) and shape (2-D ``shape``, at least one ``column``) checks
    of a sparse array. Raises: BinaryLayoutError naming the file."""
    if s.dtype not in SPARSE_DTYPES:
        raise BinaryLayoutError(f"{s.path}: dtype {s.dtype}, expected int64 (or int32/uint32) "
                                f"categorical values")
    if len(s.shape) != 2:
        raise BinaryLayoutError(f"{s.path}: shape {s.shape}, expected 2-D {shape}")
    if s.shape[1] < 1:
        raise BinaryLayoutError(f"{s.path}: shape {s.shape}, expected at least one {column}")


def load_layout(folder: str) -> List[Triplet]:
    """Every triplet of ``folder``, checked, in natural prefix order; all must agree on the number of
    dense and of categorical columns.

    Raises:
        FileNotFoundError, BinaryLayoutError: see :func:`find_prefixes` and :func:`check_triplet`;
            also columns that differ between triplets (naming the first file that differs).
    """
    triplets = [check_triplet(folder, p) for p in find_prefixes(folder)]
    check_agreement(triplets, lambda t: t.num_sparse, lambda n: f"{n} categorical columns")
    return triplets


def check_agreement(triplets: Sequence[Triplet], sparse: Callable[[Triplet], object],
                    describe: Callable[[object], str]) -> None:
    """Every triplet has the first one's dense columns and ``sparse(t)``.

    Raises:
        BinaryLayoutError: naming the first file that differs, ``"{file}: {describe(its value)}, but
            {the first triplet's file} has {describe(its value)}"`` (dense: ``N dense columns``).
    """
    first = triplets[0]
    for t in triplets[1:]:
        for kind, key, what in (("dense", lambda u: u.num_dense, lambda n: f"{n} dense columns"),
                                ("sparse", sparse, describe)):
            if key(t) != key(first):
                raise BinaryLayoutError(f"{t.path_of(kind)}: {what(key(t))}, but "
                                        f"{first.path_of(kind)} has {what(key(first))}")


def complete_triplet(folder: str, prefix: str) -> Optional[Triplet]:
    """The triplet when all three arrays exist and pass :func:`check_triplet`, else ``None``."""
    try:
        return check_triplet(folder, prefix)
    except (FileNotFoundError, BinaryLayoutError):
        return None
