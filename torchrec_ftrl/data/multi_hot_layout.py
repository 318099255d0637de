"""TorchRec's materialised multi-hot Criteo layout (MLPerf DLRM-DCNv2's input): per prefix (``day_0``
.. ``day_23``) the one-hot layout's ``PREFIX_dense.npy`` and ``PREFIX_labels.npy`` (see
:mod:`.npy_layout`) and ``PREFIX_sparse_multi_hot.npz`` in place of ``PREFIX_sparse.npy``.

The layout is what ``torchrec_dlrm/scripts/materialize_synthetic_multihot_dataset.py`` of TorchRec's
DLRM example (github.com/facebookresearch/dlrm) writes from the one-hot days with
``--copy_labels_and_dense``, and what the example's ``MultiHotCriteoIterDataPipe``
(``torchrec_dlrm/data/multi_hot_criteo.py``; ``dlrm_main.py --synthetic_multi_hot_criteo_path``) reads:
the ``.npz`` (``np.savez``, members stored uncompressed) holds one member ``"{f}.npy"`` per feature
``f = 0, 1, ...``, int32 ``[n, multi_hot[f]]``: the bag of row ``i`` of feature ``f``, ids already in
``[0, num_embeddings[f])`` (column 0 is the one-hot id ``v % num_embeddings[f]``, the others its
multi-hot companions drawn at materialisation).

This module finds the triplets of a folder and checks them from the headers and file sizes only (no
data is read), as :mod:`.npy_layout` does for one-hot folders; each member's data offset in the
``.npz`` is found so that it can be memory-mapped (``np.load`` of an ``.npz`` reads whole members).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import zipfile
from typing import List, Tuple

import numpy as np

from .npy_layout import (BinaryLayoutError, NpyInfo, Triplet, array_path, check_agreement,
                         check_dense_labels, check_sparse, natural_key, read_header)

SPARSE_SUFFIX = "_sparse_multi_hot.npz"
_MULTI_HOT = re.compile(r"^(?P<prefix>.+)" + re.escape(SPARSE_SUFFIX) + r"$")
_ONE_HOT_SPARSE = re.compile(r"^.+_sparse\.npy$")
_LOCAL_HEADER = struct.Struct("<4s22xHH")   # signature, ..., file name length, extra field length


@dataclasses.dataclass(frozen=True)
class MultiHotTriplet(Triplet):
    """One checked triplet: ``prefix``, ``dense`` / ``labels`` (:class:`NpyInfo`), ``sparse``: one
    :class:`NpyInfo` per feature (its ``path`` the ``.npz``, its ``offset`` the member's data in it)."""

    sparse: Tuple[NpyInfo, ...]

    @property
    def num_sparse(self) -> int:
        return len(self.sparse)

    @property
    def multi_hot(self) -> Tuple[int, ...]:
        """Ids per bag of each feature."""
        return tuple(int(s.shape[1]) for s in self.sparse)

    def path_of(self, kind: str) -> str:
        """The file of ``kind`` (``"dense"``, ``"sparse"`` (the ``.npz``) or ``"labels"``)."""
        return self.sparse[0].path if kind == "sparse" else getattr(self, kind).path


def sparse_path(folder: str, prefix: str) -> str:
    """``folder/PREFIX_sparse_multi_hot.npz``."""
    return os.path.join(folder, prefix + SPARSE_SUFFIX)


def is_multi_hot(folder: str) -> bool:
    """Whether ``folder`` holds a ``PREFIX_sparse_multi_hot.npz`` (hidden files ignored)."""
    return bool(_names(folder, _MULTI_HOT))


def has_one_hot_sparse(folder: str) -> bool:
    """Whether ``folder`` holds a one-hot ``PREFIX_sparse.npy`` (a folder materialised in place)."""
    return bool(_names(folder, _ONE_HOT_SPARSE))


def _names(folder: str, pattern: re.Pattern) -> List[str]:
    if not os.path.isdir(folder):
        return []
    return [n for n in os.listdir(folder) if not n.startswith(".") and pattern.match(n)]


def read_members(path: str) -> Tuple[NpyInfo, ...]:
    """The headers of the members ``"0.npy"``, ``"1.npy"``, ... of the ``.npz`` ``path``, with each
    one's absolute data offset.

    Raises:
        BinaryLayoutError: not a zip file, a compressed member (``np.savez_compressed``: it cannot be
            memory-mapped), member names other than ``0.npy`` .. ``{F-1}.npy``, a member that is not
            a C-ordered ``.npy`` or whose size differs from its header's, naming the path.
    """
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise BinaryLayoutError(f"{path}: not a readable .npz file ({e})") from None
    with zf, open(path, "rb") as f:
        names = zf.namelist()
        want = [f"{i}.npy" for i in range(len(names))]
        if not names or sorted(names, key=natural_key) != want:
            raise BinaryLayoutError(f"{path}: members {sorted(names, key=natural_key)[:5]}..., "
                                    f"expected 0.npy .. {len(names) - 1}.npy (one per feature)")
        out = []
        for name in want:
            info = zf.getinfo(name)
            if info.compress_type != zipfile.ZIP_STORED:
                raise BinaryLayoutError(f"{path}: member {name} is compressed; expected np.savez's "
                                        f"stored members (np.savez_compressed cannot be memory-mapped)")
            f.seek(info.header_offset)
            sig, n_name, n_extra = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            if sig != b"PK\x03\x04":
                raise BinaryLayoutError(f"{path}: member {name}: bad zip local header")
            start = info.header_offset + _LOCAL_HEADER.size + n_name + n_extra
            f.seek(start)
            try:
                major, _ = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if major == 1
                        else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read(f)
            except (ValueError, OSError, EOFError, SyntaxError) as e:
                raise BinaryLayoutError(f"{path}: member {name} is not a readable .npy ({e})") from None
            offset = f.tell()
            if fortran:
                raise BinaryLayoutError(f"{path}: member {name} is Fortran-ordered; expected C order")
            data = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if offset - start + data != info.file_size:
                raise BinaryLayoutError(f"{path}: member {name} holds {info.file_size} bytes, expected "
                                        f"{offset - start + data} for {dtype} {tuple(shape)}")
            out.append(NpyInfo(path, tuple(int(x) for x in shape), dtype, offset))
    return tuple(out)


def check_triplet(folder: str, prefix: str) -> MultiHotTriplet:
    """Read and check the headers of ``prefix``'s dense, labels and multi-hot sparse files.

    Raises:
        FileNotFoundError: the dense or labels array is missing (the materialising script writes them
            with ``--copy_labels_and_dense``).
        BinaryLayoutError: see :func:`read_members` and :func:`.npy_layout.check_dense_labels`; a
            member whose dtype is not int32 / int64 / uint32 or whose shape is not ``[n, h]`` with
            ``h >= 1``; row counts that differ within the triplet.
    """
    paths = {k: array_path(folder, prefix, k) for k in ("dense", "labels")}
    for k, p in paths.items():
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: missing array of the multi-hot triplet {prefix!r} (the "
                                    f"materialising script writes it with --copy_labels_and_dense)")
    d, lab = (read_header(paths[k]) for k in ("dense", "labels"))
    check_dense_labels(d, lab)
    sparse = read_members(sparse_path(folder, prefix))
    for i, s in enumerate(sparse):
        check_sparse(s, f"[n, multi_hot] (member {i}.npy)", "id per bag")
    rows = {s.rows for s in sparse}
    if rows != {d.rows} or lab.rows != d.rows:
        raise BinaryLayoutError(f"{os.path.join(folder, prefix)}_*: row counts differ: dense "
                                f"{d.rows}, labels {lab.rows}, multi-hot sparse {sorted(rows)}")
    return MultiHotTriplet(prefix, d, sparse, lab)


def load_layout(folder: str) -> List[MultiHotTriplet]:
    """Every multi-hot triplet of ``folder`` (one per ``PREFIX_sparse_multi_hot.npz``), checked, in
    natural prefix order; all must agree on the dense columns and the multi-hot sizes.

    Raises:
        FileNotFoundError: ``folder`` is not a directory or holds no ``.npz``; see
            :func:`check_triplet`.
        BinaryLayoutError: see :func:`check_triplet`; dense columns or multi-hot sizes that differ
            between triplets (naming the first file that differs).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: binary data folder not found")
    prefixes = sorted((_MULTI_HOT.match(n).group("prefix") for n in _names(folder, _MULTI_HOT)),
                      key=natural_key)
    if not prefixes:
        raise FileNotFoundError(f"{folder}: no PREFIX{SPARSE_SUFFIX} file")
    triplets = [check_triplet(folder, p) for p in prefixes]
    check_agreement(triplets, lambda t: t.multi_hot,
                    lambda sizes: f"multi-hot sizes {','.join(map(str, sizes))}")
    return triplets
