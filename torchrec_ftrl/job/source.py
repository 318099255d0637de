"""Flags -> data source (file reader with a column spec, or the synthetic generator)."""

from __future__ import annotations

import argparse
import math

from torchrec_ftrl.data import (CTRFileReader, FileSource, Split, SyntheticCTR, SyntheticSource,
                                get_spec)


def make_source(args: argparse.Namespace):
    """Returns ``(source, description dict)``.

    Raises:
        FileNotFoundError: a ``--data`` path that does not exist.
        ValueError: a bad column spec, split, or table-size list.
    """
    ne = args.num_embeddings_list
    if args.data is None:
        gen = SyntheticCTR(ne[0] if len(ne) == 1 else ne, seed=args.seed, vocab=args.synthetic_vocab)
        return SyntheticSource(gen, val_batches=args.val_batches), {
            "kind": "synthetic", "seed": args.seed, "vocab": args.synthetic_vocab}
    spec = get_spec(args.data_format)
    reader = CTRFileReader(args.data, spec, ne[0] if len(ne) == 1 else ne, strict=args.strict)
    src = FileSource(reader, Split.parse(args.split), max_val_rows=args.max_val_rows)
    return src, {"kind": "file", "paths": list(args.data), "format": args.data_format, "split": args.split}


def steps_for_epochs(src: FileSource, epochs: float, world_size: int, batch_size: int) -> int:
    """Steps for ``epochs`` passes: ``ceil(epochs * n_train / (world_size * batch_size))`` (>= 1)."""
    n = src.reader.count_valid()
    n_train = sum(1 for i in range(n) if not src.split.is_validation(i, n))
    return max(1, math.ceil(epochs * n_train / (world_size * batch_size)))
