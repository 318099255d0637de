"""Column specs: which field of a delimited CTR log is the label, a dense feature or a categorical one.

``CRITEO_SPEC`` describes the raw Criteo Display Advertising Challenge TSV (no header, TAB, 40 fields:
``label, I1..I13, C1..C26``; categorical values are 8-hex-digit 32-bit hashes; an empty field is a
missing value). ``AVAZU_SPEC`` describes the raw Avazu CSV (header, comma, ``click`` label, 22
categorical columns, no dense column). Any other log is described by a :class:`ColumnSpec` built from
a JSON object (``ColumnSpec.from_json``), so no code change is needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence, Union

Column = Union[int, str]  # 0-based field index, or a header name (needs header=True)

CATEGORICAL_ENCODINGS = ("hex", "string")
DENSE_TYPES = ("int", "float")
DENSE_TRANSFORMS = ("log", "none")


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """Layout of one delimited CTR log.

    Attributes:
        label: the 0/1 label column.
        dense: dense (numeric) columns, in model order; may be empty.
        categorical: categorical columns, one embedding table each, in model order; non-empty.
        delimiter: field separator (one or more characters), e.g. ``"\\t"`` or ``","``.
        header: whether the first line of every file is a header (names the columns).
        num_fields: expected field count per row; ``None`` = the header's count (header=True) or
            ``max(column index) + 1`` (header=False). A row with another count is malformed.
        categorical_encoding: ``"hex"`` (value must parse as base-16; id = int(value, 16)) or
            ``"string"`` (id = 64-bit BLAKE2b of the UTF-8 value).
        dense_type: ``"int"`` (Criteo: a non-integer value is malformed) or ``"float"``.
        dense_transform: ``"log"`` (x -> log(1 + max(x, 0)), natural log) or ``"none"``.
        dense_names / categorical_names: feature names; default: header names or ``"col{index}"``.

    Raises:
        ValueError: naming the field, for an empty categorical list, a bad encoding/type/transform,
            an empty delimiter, or a column name used without a header.
    """

    label: Column
    dense: tuple = ()
    categorical: tuple = ()
    delimiter: str = "\t"
    header: bool = False
    num_fields: Optional[int] = None
    categorical_encoding: str = "string"
    dense_type: str = "float"
    dense_transform: str = "log"
    dense_names: Optional[tuple] = None
    categorical_names: Optional[tuple] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense", tuple(self.dense))
        object.__setattr__(self, "categorical", tuple(self.categorical))
        if not self.categorical:
            raise ValueError("ColumnSpec.categorical must name at least one column, got []")
        if not isinstance(self.delimiter, str) or not self.delimiter:
            raise ValueError(f"ColumnSpec.delimiter must be a non-empty string, got {self.delimiter!r}")
        if self.categorical_encoding not in CATEGORICAL_ENCODINGS:
            raise ValueError(f"ColumnSpec.categorical_encoding must be one of {CATEGORICAL_ENCODINGS}, "
                             f"got {self.categorical_encoding!r}")
        if self.dense_type not in DENSE_TYPES:
            raise ValueError(f"ColumnSpec.dense_type must be one of {DENSE_TYPES}, got {self.dense_type!r}")
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"ColumnSpec.dense_transform must be one of {DENSE_TRANSFORMS}, "
                             f"got {self.dense_transform!r}")
        for c in (self.label, *self.dense, *self.categorical):
            if isinstance(c, bool) or not isinstance(c, (int, str)):
                raise ValueError(f"ColumnSpec column must be an int index or a header name, got {c!r}")
            if isinstance(c, int) and c < 0:
                raise ValueError(f"ColumnSpec column index must be >= 0, got {c}")
            if isinstance(c, str) and not self.header:
                raise ValueError(f"ColumnSpec column {c!r} is a name but header=False; use an index")
        if self.num_fields is not None and (not isinstance(self.num_fields, int) or self.num_fields < 1):
            raise ValueError(f"ColumnSpec.num_fields must be a positive int, got {self.num_fields!r}")
        for attr, cols in (("dense_names", self.dense), ("categorical_names", self.categorical)):
            names = getattr(self, attr)
            if names is not None:
                names = tuple(names)
                object.__setattr__(self, attr, names)
                if len(names) != len(cols):
                    raise ValueError(f"ColumnSpec.{attr} has {len(names)} names for {len(cols)} columns")

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_categorical(self) -> int:
        return len(self.categorical)

    def resolve(self, header_fields: Optional[Sequence[str]]) -> "ResolvedSpec":
        """Column indices and feature names, given the header fields (``None`` when header=False).

        Raises:
            ValueError: a column name missing from the header, or an index >= the field count.
        """
        def index(c: Column) -> int:
            if isinstance(c, int):
                return c
            assert header_fields is not None
            try:
                return list(header_fields).index(c)
            except ValueError:
                shown = ", ".join(repr(h[:20]) for h in header_fields[:8])
                more = ", ..." if len(header_fields) > 8 else ""
                raise ValueError(f"column {c!r} not in the header ({len(header_fields)} field(s) "
                                 f"split on {self.delimiter!r}: {shown}{more})") from None

        label = index(self.label)
        dense = tuple(index(c) for c in self.dense)
        cat = tuple(index(c) for c in self.categorical)
        if self.num_fields is not None:
            nf = self.num_fields
        elif header_fields is not None:
            nf = len(header_fields)
        else:
            nf = max((label, *dense, *cat)) + 1
        for i in (label, *dense, *cat):
            if i >= nf:
                raise ValueError(f"column index {i} is out of range for rows of {nf} fields")

        def name(c: Column, i: int) -> str:
            if isinstance(c, str):
                return c
            return header_fields[i] if header_fields is not None else f"col{i}"

        dn = self.dense_names or tuple(name(c, i) for c, i in zip(self.dense, dense))
        cn = self.categorical_names or tuple(name(c, i) for c, i in zip(self.categorical, cat))
        return ResolvedSpec(self, label, dense, cat, nf, tuple(dn), tuple(cn))

    @classmethod
    def from_json(cls, text_or_path: str) -> "ColumnSpec":
        """Build from a JSON object (inline text, or a path to a ``.json`` file) whose keys are the
        attribute names above, e.g. ``{"label": "click", "categorical": ["C1", "site_id"],
        "delimiter": ",", "header": true}``.

        Raises:
            ValueError: unparsable JSON, unknown keys, or any invalid value (see the class).
        """
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            if not os.path.isfile(text_or_path):
                raise ValueError(f"column spec {text_or_path!r} is neither a JSON object nor a file")
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        try:
            obj: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"column spec is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"column spec must be a JSON object, got {type(obj).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown column spec key(s) {unknown}; expected some of {sorted(known)}")
        if "label" not in obj:
            raise ValueError("column spec needs a 'label' key")
        return cls(**obj)


@dataclasses.dataclass(frozen=True)
class ResolvedSpec:
    """A :class:`ColumnSpec` with every column turned into a 0-based index (see ``ColumnSpec.resolve``)."""

    spec: ColumnSpec
    label: int
    dense: tuple
    categorical: tuple
    num_fields: int
    dense_names: tuple
    categorical_names: tuple


CRITEO_SPEC = ColumnSpec(
    label=0,
    dense=tuple(range(1, 14)),
    categorical=tuple(range(14, 40)),
    delimiter="\t",
    header=False,
    num_fields=40,
    categorical_encoding="hex",
    dense_type="int",
    dense_transform="log",
    dense_names=tuple(f"I{i}" for i in range(1, 14)),
    categorical_names=tuple(f"C{i}" for i in range(1, 27)),
)

AVAZU_SPEC = ColumnSpec(
    label="click",
    dense=(),
    categorical=("hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
                 "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
                 "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"),
    delimiter=",",
    header=True,
    categorical_encoding="string",
)

PRESETS = {"criteo": CRITEO_SPEC, "avazu": AVAZU_SPEC}


def get_spec(name_or_json: str) -> ColumnSpec:
    """A preset by name (``"criteo"``, ``"avazu"``) or a JSON spec (inline or file; see ``from_json``)."""
    if name_or_json in PRESETS:
        return PRESETS[name_or_json]
    return ColumnSpec.from_json(name_or_json)
