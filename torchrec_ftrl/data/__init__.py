"""CTR data for the training job: raw Criteo TSV / any delimited log (column spec) and a synthetic default.

Modules: ``spec`` (column specs, presets), ``hashing`` (stable ids, log transform), ``reader``
(streaming parse, malformed-row handling), ``split`` (train/validation), ``batching`` (rows -> torchrec
``Batch``), ``synthetic`` (planted-signal generator), ``sources`` (rank-sharded batch streams).
"""

from .batching import make_batch
from .hashing import hex_id, log_transform, string_id
from .reader import CTRFileReader, MalformedRowError, NoUsableRowsError, ReadStats, Row
from .sources import FileSource, SyntheticSource
from .spec import AVAZU_SPEC, CRITEO_SPEC, PRESETS, ColumnSpec, get_spec
from .split import Split
from .synthetic import SyntheticCTR

__all__ = [
    "AVAZU_SPEC", "CRITEO_SPEC", "PRESETS", "CTRFileReader", "ColumnSpec", "FileSource",
    "MalformedRowError", "NoUsableRowsError", "ReadStats", "Row", "Split", "SyntheticCTR", "SyntheticSource", "get_spec",
    "hex_id", "log_transform", "make_batch", "string_id",
]
