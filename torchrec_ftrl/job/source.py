"""Flags -> data source (file reader with a column spec, a binary folder, or the synthetic generator)."""

from __future__ import annotations

import argparse
import math
import os

from torchrec_ftrl.data import (BinarySource, CTRFileReader, FileSource, MultiHotBinarySource, Split,
                                SyntheticCTR, SyntheticSource, get_spec)
from .errors import JobConfigError
from .data_kind import reads_multi_hot
from .zch import RAW_ID_SPACE

DEFAULT_SYNTHETIC_TABLES = 26   # Criteo's categorical features


def make_source(args: argparse.Namespace, device=None):
    """Returns ``(source, description dict)``: no ``--data``: the synthetic generator (``--synthetic
    uniform`` / ``zipf``: :class:`DeviceSyntheticSource` on ``device``, default CPU); one folder:
    :class:`BinarySource` (TorchRec's binary Criteo layout, dense values per ``--binary-dense``;
    ``--data-format`` and ``--strict`` do not apply), or :class:`MultiHotBinarySource` for its
    materialised multi-hot layout (``data_kind.reads_multi_hot``); files: :class:`FileSource` over a
    :class:`CTRFileReader`. With ``--zch`` every source yields raw ids in ``[0, RAW_ID_SPACE)``
    (:mod:`.zch`) instead of ids modulo ``--num-embeddings``.

    Raises:
        FileNotFoundError: a ``--data`` path that does not exist, or a binary folder with no
            triplet or a triplet missing an array.
        ValueError: a bad column spec, split, or table-size list; a bad binary layout
            (``BinaryLayoutError``, naming the file); ``JobConfigError`` from
            :func:`_multi_hot_source`.
    """
    ne = args.num_embeddings_list
    # --zch: raw ids (the tables' slots are --num-embeddings; TorchRec's MC modules map ids to them).
    ne_arg = RAW_ID_SPACE if args.zch else ne[0] if len(ne) == 1 else ne
    if args.data is None and getattr(args, "synthetic", "criteo") != "criteo":
        return _device_source(args, device)
    if args.data is None:
        gen = SyntheticCTR(ne_arg, seed=args.seed, vocab=args.synthetic_vocab)
        return SyntheticSource(gen, val_batches=args.val_batches), {
            "kind": "synthetic", "seed": args.seed, "vocab": args.synthetic_vocab}
    split = Split.parse(args.split)
    if reads_multi_hot(args):
        return _multi_hot_source(args, ne_arg, split)
    if len(args.data) == 1 and os.path.isdir(args.data[0]):
        src = BinarySource(args.data[0], ne_arg, split, max_val_rows=args.max_val_rows,
                           dense=args.binary_dense)
        return src, {"kind": "binary", "path": args.data[0], "dense": args.binary_dense,
                     "prefixes": [t.prefix for t in src.triplets], "split": args.split}
    spec = get_spec(args.data_format)
    reader = CTRFileReader(args.data, spec, ne_arg, strict=args.strict)
    src = FileSource(reader, split, max_val_rows=args.max_val_rows)
    return src, {"kind": "file", "paths": list(args.data), "format": args.data_format, "split": args.split}


def _multi_hot_source(args: argparse.Namespace, ne_arg, split: Split):
    """:class:`MultiHotBinarySource` for a ``--data`` folder in TorchRec's materialised multi-hot
    layout, its multi-hot sizes checked against ``--multi-hot-sizes`` (or the preset's) when given.

    Raises:
        JobConfigError: ``--zch`` (the folder's ids are already taken modulo its tables' sizes, not
            raw), or multi-hot sizes that differ (naming both and where each comes from).
    """
    folder = args.data[0]
    if args.zch:
        raise JobConfigError(f"--zch needs raw ids, but --data {folder} holds materialised multi-hot "
                             f"ids, already taken modulo the table sizes they were made for")
    src = MultiHotBinarySource(folder, ne_arg, split, max_val_rows=args.max_val_rows,
                               dense=args.binary_dense)
    want = args.multi_hot_list
    if want is not None and tuple(want * src.triplets[0].num_sparse if len(want) == 1
                                  else want) != src.multi_hot:
        origin = getattr(args, "multi_hot_origin", "--multi-hot-sizes")
        given = "" if origin == "--multi-hot-sizes" else f" (from {origin})"
        raise JobConfigError(
            f"--data {folder} holds multi-hot sizes {','.join(map(str, src.multi_hot))} "
            f"({src.triplets[0].path_of('sparse')}), but --multi-hot-sizes is "
            f"{args.multi_hot_sizes}{given}")
    return src, {"kind": "binary-multi-hot", "path": folder, "dense": args.binary_dense,
                 "prefixes": [t.prefix for t in src.triplets], "split": args.split,
                 "multi_hot": list(src.multi_hot)}


def _device_source(args: argparse.Namespace, device):
    """:class:`DeviceSyntheticSource` for ``--synthetic uniform|zipf``: one table per entry of
    ``--num-embeddings`` / ``--multi-hot-sizes`` (a single value applies to every table; 26 tables
    when both are single values, as Criteo's)."""
    from torchrec_ftrl.data.device_synthetic import DeviceSyntheticSource

    rows, hot = list(args.num_embeddings_list), args.multi_hot_list or [1]
    n = max(len(rows), len(hot))
    n = DEFAULT_SYNTHETIC_TABLES if n == 1 else n
    rows, hot = (rows * n if len(rows) == 1 else rows), (hot * n if len(hot) == 1 else hot)
    src = DeviceSyntheticSource(rows, hot, args.synthetic, args.zipf_alpha, args.seed,
                                device or "cpu", args.val_batches)
    return src, {"kind": f"synthetic-{args.synthetic}", "seed": args.seed, "multi_hot": hot,
                 **({"zipf_alpha": args.zipf_alpha} if args.synthetic == "zipf" else {})}


def steps_for_epochs(src, epochs: float, world_size: int, batch_size: int) -> int:
    """Steps for ``epochs`` passes: ``ceil(epochs * n_train / (world_size * batch_size))`` (>= 1),
    ``n_train`` the training rows of one pass (a :class:`FileSource` counts them with one pass over
    its files; a :class:`BinarySource` knows them from its headers)."""
    if isinstance(src, BinarySource):
        n_train = src.num_train_rows()
    else:
        n = src.reader.count_valid()
        n_train = sum(1 for i in range(n) if not src.split.is_validation(i, n))
    return max(1, math.ceil(epochs * n_train / (world_size * batch_size)))
