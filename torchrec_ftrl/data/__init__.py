"""CTR data for the training job: raw Criteo TSV / any delimited log (column spec) and a synthetic default.

Modules: ``spec`` (column specs, presets), ``hashing`` (stable ids, log transform), ``reader``
(streaming parse, malformed-row handling; the per-line parser), ``arrow_reader`` (the same rows
through pyarrow's CSV parser), ``line_chunks`` (line-aligned byte chunks and their line index),
``columns`` (vectorised field decoders), ``split`` (train/validation), ``batching`` (rows -> torchrec
``Batch``), ``synthetic`` (planted-signal generator), ``sources`` (rank-sharded batch streams), ``loader`` (those batches from DataLoader workers);
TorchRec's binary Criteo layout: ``npy_layout`` (triplets and their checks), ``binary_source``
(rank-sharded batches from it), ``npy_convert`` (one raw file -> one triplet), ``preprocess`` (the
``python -m torchrec_ftrl.data.preprocess`` command); its materialised multi-hot layout:
``multi_hot_layout`` (triplets with a ``.npz`` of multi-hot ids), ``multi_hot_source`` (their batches).
"""

from .batching import make_batch
from .binary_source import BinarySource, BinaryStats
from .hashing import hex_id, log_transform, string_id
from .loader import train_loader
from .multi_hot_source import MultiHotBinarySource
from .npy_layout import BinaryLayoutError
from .reader import CTRFileReader, MalformedRowError, NoUsableRowsError, ReadStats, Row, RowChunk
from .sources import FileSource, SyntheticSource
from .spec import AVAZU_SPEC, CRITEO_SPEC, PRESETS, ColumnSpec, get_spec
from .split import Split
from .synthetic import SyntheticCTR

__all__ = [
    "AVAZU_SPEC", "BinaryLayoutError", "BinarySource", "BinaryStats", "CRITEO_SPEC", "PRESETS",
    "CTRFileReader", "ColumnSpec", "FileSource", "MalformedRowError", "MultiHotBinarySource",
    "NoUsableRowsError", "ReadStats", "Row", "RowChunk", "Split", "SyntheticCTR", "SyntheticSource",
    "get_spec", "hex_id", "log_transform", "make_batch", "string_id", "train_loader",
]
