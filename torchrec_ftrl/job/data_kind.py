"""Which kind of input a job reads: the synthetic generator, a binary folder (one-hot, or TorchRec's
materialised multi-hot layout) or text files. Read by the flag checks, the presets and the source
factory; imports nothing of the job's.
"""

from __future__ import annotations

import argparse
import os

# Data sources: no --data (the synthetic generator), one folder (binary layout), text files.
SYNTHETIC, BINARY, TEXT = "synthetic", "binary folder", "text files"


def data_kind(args: argparse.Namespace) -> str:
    """``SYNTHETIC`` (no ``--data``), ``BINARY`` (one folder) or ``TEXT`` (files)."""
    if args.data is None:
        return SYNTHETIC
    return BINARY if len(args.data) == 1 and os.path.isdir(args.data[0]) else TEXT


def multi_hot_folder(args: argparse.Namespace) -> bool:
    """Whether ``--data`` is one folder holding TorchRec's materialised multi-hot layout
    (``PREFIX_sparse_multi_hot.npz``, :mod:`torchrec_ftrl.data.multi_hot_layout`)."""
    from torchrec_ftrl.data.multi_hot_layout import is_multi_hot

    return data_kind(args) == BINARY and is_multi_hot(args.data[0])


def reads_multi_hot(args: argparse.Namespace) -> bool:
    """Whether the job reads ``--data``'s multi-hot layout: a multi-hot folder, unless it also holds
    the one-hot ``PREFIX_sparse.npy`` (materialised in place) and no multi-hot sizes are asked for
    (``--multi-hot-sizes`` or a preset's): then the one-hot layout, as for any binary folder."""
    from torchrec_ftrl.data.multi_hot_layout import has_one_hot_sparse

    return multi_hot_folder(args) and (getattr(args, "multi_hot_sizes", None) is not None
                                       or not has_one_hot_sparse(args.data[0]))
