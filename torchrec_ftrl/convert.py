"""TensorFlow FTRL checkpoints <-> torchrec_ftrl export files, both ways.

::

    python -m torchrec_ftrl.convert from-tensorflow CKPT --table NAME=TF_VARIABLE [...] --out FILE
    python -m torchrec_ftrl.convert to-tensorflow FILE --table NAME=TF_VARIABLE [...] --out CKPT_PREFIX
                                    [--template CKPT] [--flavour keras|v1]

``FILE`` is the export format of :mod:`torchrec_ftrl.checkpoint` (``{table}``, ``{table}/accum``,
``{table}/linear``, fp32 ``[rows, D]``, ``.npz`` or ``.safetensors``), which
``import_ftrl_tables`` loads into a sharded model of any plan and ``export_ftrl_tables`` writes.

Two TensorFlow flavours (``docs/convert.md``):

* ``keras``: an object-based checkpoint written by ``tf.train.Checkpoint`` holding a
  ``keras.optimizers.Ftrl`` (Keras 3; slots ``accumulator`` and ``linear``, linked to their variable
  through the optimizer's tracked lists; the learning rate is stored). Optimizers that record
  ``slot_variables`` in the object graph (``tf.compat.v1.train.FtrlOptimizer`` or legacy tf.keras
  under ``tf.train.Checkpoint``) are read the same way.
* ``v1``: a name-based checkpoint written by ``tf.compat.v1.train.Saver`` with
  ``tf.compat.v1.train.FtrlOptimizer`` (slots ``{var}/Ftrl`` = accum, ``{var}/Ftrl_1`` = linear;
  no hyperparameter is stored).

Tables are mapped by name, never by position. Everything is checked before anything is written
(missing variable, slot or export-file table, non-2-D or mismatched shapes: ``ValueError`` naming
the table), and files are written atomically. TensorFlow is optional
(``pip install torchrec-ftrl[tensorflow]``) and imported only when a conversion runs; TensorFlow's
own reader (``tf.train.load_checkpoint``, the object-graph proto) reads checkpoints and its
``SaveV2`` op writes them.

TensorFlow's FTRL (``ApplyFtrl``/``ApplyFtrlV2`` and their sparse kernels, Keras 3's ``Ftrl``) is
this package's rule with ``ftrl_l2_convention="tensorflow"``: both TF optimizers fold ``beta`` into
l2 as ``l2 + beta / (2 lr)``, which enters the denominator as ``2 l2 + beta / lr``, i.e.
``(beta + n^-p) / lr + 2 l2``; ``l2_shrinkage`` adds ``2 s w`` to the gradient of ``linear`` only,
``accum`` takes the raw gradient. The hyperparameters map one to one (:data:`HYPERPARAMETERS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from .checkpoint import SLOTS, _check_suffix, _read, _write
from .hyperparams import FTRLHyperparams, parse_options

__all__ = ["FLAVOURS", "HYPERPARAMETERS", "Conversion", "TableMap", "TensorFlowNotInstalled",
           "from_tensorflow", "to_tensorflow", "main"]

FLAVOURS = ("keras", "v1")
FLAVOUR_TEXT = {
    "keras": "object-based checkpoint (tf.train.Checkpoint), keras.optimizers.Ftrl",
    "v1": "name-based checkpoint (tf.compat.v1.train.Saver), tf.compat.v1.train.FtrlOptimizer",
}
# How an object-based checkpoint ties the slots to their variable.
LAYOUT_TEXT = {
    "keras3": "Keras 3 Ftrl: optimizer lists _trainable_variables / _accumulators / _linears",
    "slot_variables": "slot_variables accum|accumulator, linear (tf.compat.v1 FtrlOptimizer or legacy tf.keras "
                      "Ftrl under tf.train.Checkpoint)",
    "names": "slots {var}/ACCUM, {var}/LINEAR",
}
INSTALL_HINT = "pip install 'torchrec-ftrl[tensorflow]' (or: pip install -r requirements-tensorflow.txt)"
DEFAULT_V1_SLOTS = ("Ftrl", "Ftrl_1")

# TensorFlow argument name -> (torchrec_ftrl knob, TensorFlow default). Both keras.optimizers.Ftrl and
# tf.compat.v1.train.FtrlOptimizer use these names and defaults, except the learning rate: Keras
# stores it in the checkpoint, TF1 has no default and stores nothing, so it has no default here.
HYPERPARAMETERS: dict[str, tuple[str, Optional[float]]] = {
    "learning_rate": ("learning_rate", None),
    "learning_rate_power": ("ftrl_learning_rate_power", -0.5),
    "initial_accumulator_value": ("ftrl_initial_accumulator_value", 0.1),
    "l1_regularization_strength": ("ftrl_l1_reg", 0.0),
    "l2_regularization_strength": ("ftrl_l2_reg", 0.0),
    "l2_shrinkage_regularization_strength": ("ftrl_l2_shrinkage", 0.0),
    "beta": ("ftrl_beta", 0.0),
}

_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# Slot names in object graphs: Keras 3 tracks lists, legacy tf.keras / tf.compat.v1 record slot_variables.
_KERAS_LISTS = {"accum": "_accumulators", "linear": "_linears"}
_SLOT_NAMES = {"accum": ("accumulator", "accum"), "linear": ("linear",)}
_LR_CHILDREN = ("_learning_rate", "learning_rate")
_STEP_CHILDREN = ("_iterations", "iter")


class TensorFlowNotInstalled(ImportError):
    """TensorFlow is needed for a conversion and cannot be imported."""


def _import_tf():
    try:
        import tensorflow as tf
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "tensorflow":
            raise TensorFlowNotInstalled(f"TensorFlow is not installed; {INSTALL_HINT}") from e
        raise TensorFlowNotInstalled(f"TensorFlow failed to import ({type(e).__name__}: {e}); "
                                     f"{INSTALL_HINT}") from e
    return tf


# ------------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class TableMap:
    """One converted table: its export-file name, the TensorFlow variable, its shape and where the
    three tensors live in the TensorFlow checkpoint (checkpoint keys)."""

    name: str
    tf_variable: str
    shape: tuple[int, int]
    weight_key: str
    accum_key: str
    linear_key: str
    layout: str = "names"  # a LAYOUT_TEXT key


@dataclasses.dataclass
class Conversion:
    """What a conversion did: direction, flavour, tables, hyperparameters and their sources."""

    direction: str  # "from-tensorflow" or "to-tensorflow"
    flavour: str
    source: str
    out: str
    tables: list[TableMap]
    hyperparams: FTRLHyperparams
    sources: dict[str, str]  # TensorFlow argument name -> where its value came from
    notes: list[str]
    iterations: Optional[int] = None

    def fused_params(self) -> dict[str, Any]:
        """``fused_params`` for ``torchrec_ftrl.sharders``: ``optimizer`` and every FTRL knob."""
        from .optim_type import emb_optim_type
        return {"optimizer": emb_optim_type(), **self.hyperparams.to_options()}

    def fused_params_text(self) -> str:
        """:meth:`fused_params` as Python text to paste (``EmbOptimType.FTRL`` spelled out)."""
        items = ['"optimizer": EmbOptimType.FTRL']
        items += [f"{json.dumps(k)}: {_py(v)}" for k, v in self.hyperparams.to_options().items()]
        return "{" + ", ".join(items) + "}"

    def tensorflow_optimizer_text(self) -> str:
        """The TensorFlow optimizer with these hyperparameters, as Python text."""
        cls = "keras.optimizers.Ftrl" if self.flavour == "keras" else "tf.compat.v1.train.FtrlOptimizer"
        opts = self.hyperparams.to_options()
        args = [f"{tf_name}={_py(opts[knob])}" for tf_name, (knob, _) in HYPERPARAMETERS.items()]
        return f"{cls}({', '.join(args)})"

    def report(self) -> str:
        lines = [f"{self.direction}: {self.source} -> {self.out} ({len(self.tables)} table(s), flavour "
                 f"{self.flavour}: {FLAVOUR_TEXT[self.flavour]})"]
        if self.iterations is not None:
            where = "checkpoint" if self.direction == "from-tensorflow" else "template (kept)"
            lines.append(f"optimizer iterations in the {where}: {self.iterations}")
        for t in self.tables:
            lines.append(f"  table {t.name!r} <-> {t.tf_variable!r} {list(t.shape)}: weight {t.weight_key!r}, "
                         f"accum {t.accum_key!r}, linear {t.linear_key!r} ({LAYOUT_TEXT[t.layout]})")
        lines.append("hyperparameters (TensorFlow name = value, source -> torchrec_ftrl knob):")
        opts = self.hyperparams.to_options()
        for tf_name, (knob, _) in HYPERPARAMETERS.items():
            lines.append(f"  {tf_name} = {_py(opts[knob])}  ({self.sources[tf_name]}) -> {knob}")
        lines.append('  ftrl_l2_convention = "tensorflow"  (TensorFlow\'s rule: 2*l2 in the denominator)')
        lines.extend(f"note: {n}" for n in self.notes)
        if self.direction == "from-tensorflow":
            lines.append("from fbgemm_gpu.split_embedding_configs import EmbOptimType  # after import torchrec_ftrl")
            lines.append(f"fused_params = {self.fused_params_text()}")
        else:
            lines.append(f"optimizer = {self.tensorflow_optimizer_text()}")
        return "\n".join(lines)


def _py(v: Any) -> str:
    return json.dumps(v) if isinstance(v, str) else repr(v)


# ------------------------------------------------------------------------------ argument helpers


def _table_pairs(tables: Union[Mapping[str, str], Iterable[Union[str, Sequence[str]]]]) -> list[tuple[str, str]]:
    """``{NAME: TF_VARIABLE}``, ``[(NAME, TF_VARIABLE)]`` or ``["NAME=TF_VARIABLE"]`` as checked pairs."""
    items = tables.items() if isinstance(tables, Mapping) else tables
    pairs = []
    for item in items:
        if isinstance(item, str):
            name, sep, var = item.partition("=")
            if not sep:
                raise ValueError(f"--table {item!r}: expected NAME=TF_VARIABLE")
        else:
            name, var = item
        name, var = str(name).strip(), str(var).strip()
        if not name or not var:
            raise ValueError(f"--table {name}={var}: both NAME and TF_VARIABLE must be non-empty")
        if "/" in name:
            raise ValueError(f"table name {name!r} contains '/', which the export format uses to name slots")
        pairs.append((name, var))
    if not pairs:
        raise ValueError("no tables given (--table NAME=TF_VARIABLE)")
    for what, idx in (("table name", 0), ("TensorFlow variable", 1)):
        seen = [p[idx] for p in pairs]
        dup = sorted({x for x in seen if seen.count(x) > 1})
        if dup:
            raise ValueError(f"{what}(s) {dup} given more than once in --table")
    return pairs


def _check_flavour(flavour: Optional[str]) -> None:
    if flavour is not None and flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")


def _v1_slots(v1_slots: Union[str, Sequence[str]]) -> tuple[str, str]:
    parts = v1_slots.split(",") if isinstance(v1_slots, str) else list(v1_slots)
    parts = [p.strip() for p in parts]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"v1 slot names must be two names ACCUM,LINEAR (default Ftrl,Ftrl_1), got {v1_slots!r}")
    return parts[0], parts[1]


def _resolve_hyperparams(given: Optional[Mapping[str, Optional[float]]], stored: Mapping[str, tuple[float, str]],
                         flavour: str) -> tuple[FTRLHyperparams, dict[str, str]]:
    """Flags over stored values over TensorFlow defaults; validated by ``parse_options``."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = sorted(set(given) - set(HYPERPARAMETERS))
    if unknown:
        raise ValueError(f"unknown TensorFlow FTRL hyperparameter(s) {unknown}; expected some of "
                         f"{list(HYPERPARAMETERS)}")
    options: dict[str, Any] = {"ftrl_l2_convention": "tensorflow"}
    sources: dict[str, str] = {}
    for tf_name, (knob, default) in HYPERPARAMETERS.items():
        flag = "--" + tf_name.replace("_", "-")
        if tf_name in given:
            value = given[tf_name]
            sources[tf_name] = flag
            if tf_name in stored and float(stored[tf_name][0]) != float(value):
                sources[tf_name] += f", overriding {stored[tf_name][0]!r} stored in {stored[tf_name][1]}"
        elif tf_name in stored:
            value, where = stored[tf_name]
            sources[tf_name] = f"stored in {where}"
        elif default is not None:
            value = default
            sources[tf_name] = "TensorFlow default"
        else:
            why = ("tf.compat.v1.train.FtrlOptimizer has no default learning rate and its checkpoints do "
                   "not store it" if flavour == "v1" else
                   "the checkpoint stores no learning-rate variable (a LearningRateSchedule?)")
            raise ValueError(f"{flag} is required: {why}")
        options[knob] = value
    hp = parse_options(options, strict=True, where="TensorFlow hyperparameters")
    return hp, sources


def _float32_text(value) -> float:
    """A stored fp32 scalar as the shortest decimal that rounds to it (0.1, not 0.10000000149)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


# --------------------------------------------------------------------------- reading TF checkpoints


def _checkpoint_prefix(tf, checkpoint: Union[str, os.PathLike], what: str) -> str:
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"{what} {path!r} is a directory without a 'checkpoint' state file; pass a "
                             "checkpoint prefix (e.g. dir/ckpt-3)")
        path = latest
    return path


def _load_reader(tf, path: str, what: str):
    try:
        return tf.train.load_checkpoint(path)
    except Exception as e:  # NotFoundError / DataLossError / ValueError from TF's reader
        raise ValueError(f"{what} {path!r} is not a readable TensorFlow checkpoint "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e


@dataclasses.dataclass
class _Slots:
    weight_key: str
    accum_key: str
    linear_key: str
    layout: str = "names"
    optimizer: Optional[int] = None  # object-graph node of the optimizer (object-based checkpoints)


class _ObjectGraph:
    """The object graph of an object-based checkpoint, read with TensorFlow's proto class."""

    def __init__(self, reader):
        from tensorflow.core.protobuf import trackable_object_graph_pb2
        self.proto = trackable_object_graph_pb2.TrackableObjectGraph()
        self.proto.ParseFromString(reader.get_tensor(_OBJECT_GRAPH_KEY))
        self.nodes = self.proto.nodes
        self.paths: dict[int, list[str]] = {}
        queue = [(0, "")]
        seen = {0}
        while queue:  # breadth first: shortest paths first
            node, path = queue.pop(0)
            for child in self.nodes[node].children:
                p = f"{path}/{child.local_name}" if path else child.local_name
                self.paths.setdefault(child.node_id, []).append(p)
                if child.node_id not in seen:
                    seen.add(child.node_id)
                    queue.append((child.node_id, p))

    def children(self, node: int) -> dict[str, int]:
        return {c.local_name: c.node_id for c in self.nodes[node].children}

    def value_key(self, node: int) -> Optional[str]:
        for a in self.nodes[node].attributes:
            if a.name == "VARIABLE_VALUE":
                return a.checkpoint_key
        return None

    def full_name(self, node: int) -> Optional[str]:
        for a in self.nodes[node].attributes:
            if a.name == "VARIABLE_VALUE":
                return a.full_name
        return None

    def variables(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.value_key(i) is not None]

    def describe(self, node: int) -> str:
        return (self.paths.get(node) or [f"node {node}"])[0]

    def find_variable(self, spec: str, table: str) -> int:
        key = spec[: -len(_VALUE_SUFFIX)] if spec.endswith(_VALUE_SUFFIX) else spec
        by_path = [n for n in self.variables() if key in self.paths.get(n, [])]
        if by_path:
            return by_path[0]
        name = key[:-2] if key.endswith(":0") else key
        by_name = [n for n in self.variables() if self.full_name(n) == name]
        if len(by_name) == 1:
            return by_name[0]
        if len(by_name) > 1:
            raise ValueError(f"table {table!r}: variable name {spec!r} is ambiguous in the checkpoint "
                             f"(objects {[self.describe(n) for n in by_name]}); give its object path")
        known = sorted(f"{self.describe(n)} ({self.full_name(n)})" for n in self.variables())
        raise ValueError(f"table {table!r}: the checkpoint has no variable {spec!r} (object path or "
                         f"variable name); it holds {known[:12]}{' ...' if len(known) > 12 else ''}")

    def ftrl_slots(self, var: int, spec: str, table: str) -> _Slots:
        found: list[tuple[int, dict[str, int], str]] = []
        partial: list[str] = []
        for opt in range(len(self.nodes)):
            ch = self.children(opt)
            # Keras 3: optimizer._trainable_variables[i] <-> _accumulators[i], _linears[i].
            if "_trainable_variables" in ch:
                tv = self.children(ch["_trainable_variables"])
                index = [i for i, n in tv.items() if n == var]
                if index:
                    slots = {}
                    for slot, lst in _KERAS_LISTS.items():
                        if lst in ch and index[0] in self.children(ch[lst]):
                            slots[slot] = self.children(ch[lst])[index[0]]
                    if len(slots) == 2:
                        found.append((opt, slots, "keras3"))
                    else:
                        partial.append(f"optimizer {self.describe(opt)!r} tracks it but has no "
                                       f"{[_KERAS_LISTS[s] for s in SLOTS if s not in slots]} (not Ftrl?)")
            # slot_variables (tf.compat.v1 optimizers, legacy tf.keras): linked by node id and name.
            slots = {}
            for sv in self.nodes[opt].slot_variables:
                if sv.original_variable_node_id == var:
                    for slot, names in _SLOT_NAMES.items():
                        if sv.slot_name in names:
                            slots[slot] = sv.slot_variable_node_id
            if len(slots) == 2:
                found.append((opt, slots, "slot_variables"))
            elif slots:
                partial.append(f"optimizer {self.describe(opt)!r} has only slot(s) {sorted(slots)}")
        if not found:
            why = "; ".join(partial) if partial else "no optimizer in the checkpoint holds slots for it"
            raise ValueError(f"table {table!r}: variable {spec!r} has no FTRL slots (accumulator and "
                             f"linear): {why}")
        if len(found) > 1:
            raise ValueError(f"table {table!r}: variable {spec!r} has FTRL slots in several optimizers "
                             f"{[self.describe(o) for o, _, _ in found]}")
        opt, slots, layout = found[0]
        return _Slots(self.value_key(var), self.value_key(slots["accum"]), self.value_key(slots["linear"]),
                      layout, opt)

    def optimizer_scalar(self, opt: int, names: Sequence[str]) -> Optional[tuple[str, str]]:
        """(checkpoint key, object path) of the optimizer's scalar variable under one of ``names``."""
        ch = self.children(opt)
        for name in names:
            if name in ch and self.value_key(ch[name]) is not None:
                return self.value_key(ch[name]), self.describe(ch[name])
        return None


class _Checkpoint:
    """A TensorFlow checkpoint opened with ``tf.train.load_checkpoint``: flavour, keys, shapes."""

    def __init__(self, tf, checkpoint, what: str, flavour: Optional[str]):
        self.path = _checkpoint_prefix(tf, checkpoint, what)
        self.reader = _load_reader(tf, self.path, what)
        self.shapes = self.reader.get_variable_to_shape_map()
        self.dtypes = self.reader.get_variable_to_dtype_map()
        self.flavour = "keras" if _OBJECT_GRAPH_KEY in self.shapes else "v1"
        if flavour is not None and flavour != self.flavour:
            raise ValueError(f"{what} {self.path!r} is a {self.flavour} checkpoint "
                             f"({FLAVOUR_TEXT[self.flavour]}), not {flavour} ({FLAVOUR_TEXT[flavour]})")
        self.graph = _ObjectGraph(self.reader) if self.flavour == "keras" else None

    def locate(self, table: str, spec: str, v1_slots: tuple[str, str]) -> _Slots:
        if self.graph is not None:
            var = self.graph.find_variable(spec, table)
            return self.graph.ftrl_slots(var, spec, table)
        name = spec[:-2] if spec.endswith(":0") else spec
        if name not in self.shapes:
            known = sorted(k for k in self.shapes if not k.endswith(tuple("/" + s for s in v1_slots)))
            raise ValueError(f"table {table!r}: the checkpoint has no variable {spec!r}; it holds "
                             f"{known[:12]}{' ...' if len(known) > 12 else ''}")
        keys = [f"{name}/{s}" for s in v1_slots]
        for slot, key in zip(SLOTS, keys):
            if key not in self.shapes:
                raise ValueError(f"table {table!r}: variable {spec!r} has no FTRL slot {key!r} ({slot}); is it "
                                 f"trained by tf.compat.v1.train.FtrlOptimizer (slots {name}/{v1_slots[0]}, "
                                 f"{name}/{v1_slots[1]}; see --v1-slots)?")
        return _Slots(name, keys[0], keys[1])

    def check_shapes(self, table: str, spec: str, slots: _Slots, expected=None) -> tuple[int, int]:
        shape = tuple(self.shapes[slots.weight_key])
        if len(shape) != 2:
            raise ValueError(f"table {table!r}: variable {spec!r} has shape {list(shape)}; FTRL tables are "
                             "2-D [rows, dim]")
        for slot, key in (("accum", slots.accum_key), ("linear", slots.linear_key)):
            if tuple(self.shapes[key]) != shape:
                raise ValueError(f"table {table!r}: slot {key!r} ({slot}) has shape {list(self.shapes[key])} "
                                 f"!= variable shape {list(shape)}")
        for key in (slots.weight_key, slots.accum_key, slots.linear_key):
            if not self.dtypes[key].is_floating:
                raise ValueError(f"table {table!r}: {key!r} has dtype {self.dtypes[key].name}, not floating point")
        if expected is not None and tuple(expected) != shape:
            raise ValueError(f"table {table!r}: export-file shape {list(expected)} != shape {list(shape)} of "
                             f"{spec!r} in the TensorFlow checkpoint")
        return shape

    def scalar(self, key: str):
        return self.reader.get_tensor(key)


def _keras_stored(ck: _Checkpoint, located: Sequence[tuple[str, _Slots]],
                  label: str = "the checkpoint") -> tuple[dict, Optional[int], dict]:
    """Learning rate and iterations stored by the optimizer(s) of the tables (object-based)."""
    stored: dict[str, tuple[float, str]] = {}
    iterations: Optional[int] = None
    lr_keys: dict[str, Optional[str]] = {}
    if ck.graph is None:
        return stored, None, lr_keys
    lrs = {}
    for table, s in located:
        lr = ck.graph.optimizer_scalar(s.optimizer, _LR_CHILDREN)
        lr_keys[table] = lr[0] if lr else None
        if lr is not None:
            lrs[table] = (_float32_text(ck.scalar(lr[0])), lr[1])
        step = ck.graph.optimizer_scalar(s.optimizer, _STEP_CHILDREN)
        if step is not None:
            iterations = int(ck.scalar(step[0]))
    values = {v for v, _ in lrs.values()}
    if len(values) > 1:
        raise ValueError(f"the tables' optimizers store different learning rates "
                         f"{ {t: v for t, (v, _) in lrs.items()} }; convert them separately")
    if lrs:
        value, where = next(iter(lrs.values()))
        stored["learning_rate"] = (value, f"{label} ({where})")
    return stored, iterations, lr_keys


def _notes(maps: Sequence[TableMap], hp: FTRLHyperparams) -> list[str]:
    """Where continued training differs from the TensorFlow side (the state itself converts exactly)."""
    if not any(t.layout == "keras3" for t in maps):
        return []
    notes = ["keras.optimizers.Ftrl (Keras 3) squares each occurrence of an id repeated in an IndexedSlices "
             "gradient separately (accum += sum of g_i^2), while torchrec_ftrl, like tf.compat.v1, sums the "
             "occurrences first (accum += (sum of g_i)^2): steps agree exactly when a batch holds each id at "
             "most once (docs/convert.md)"]
    if hp.l2_shrinkage > 0:
        notes.append("keras.optimizers.Ftrl applies sparse gradients to every row, so with "
                     "l2_shrinkage_regularization_strength > 0 the rows a batch does not touch shrink in Keras; "
                     "torchrec_ftrl's fused tables (like tf.compat.v1's sparse FTRL) leave them unchanged; "
                     "torchrec_ftrl.FTRL(..., skip_zero_grad_rows=False) with dense gradients matches Keras")
    return notes


# ----------------------------------------------------------------------------------- conversions


def from_tensorflow(checkpoint: Union[str, os.PathLike], tables, out: Union[str, os.PathLike], *,
                    flavour: Optional[str] = None, hyperparams: Optional[Mapping[str, Optional[float]]] = None,
                    v1_slots: Union[str, Sequence[str]] = DEFAULT_V1_SLOTS) -> Conversion:
    """Read FTRL tables from a TensorFlow checkpoint into an export file (``.npz``/``.safetensors``).

    Args:
        checkpoint: checkpoint prefix (``dir/ckpt-3``) or a directory with a ``checkpoint`` file.
        tables: ``{NAME: TF_VARIABLE}`` (or ``["NAME=TF_VARIABLE"]``). TF_VARIABLE is, for ``keras``,
            the object path (``model/emb``, as in ``tf.train.list_variables`` without
            ``/.ATTRIBUTES/VARIABLE_VALUE``) or the variable's name; for ``v1`` the variable name.
        out: the export file to write (atomically).
        flavour: ``"keras"`` or ``"v1"``; default: detected (object-based -> keras, name-based -> v1).
        hyperparams: TensorFlow-named hyperparameters (:data:`HYPERPARAMETERS`); ``None`` entries
            are not given. Given > stored in the checkpoint (Keras' learning rate) > TF default.
        v1_slots: the v1 slot suffixes for accum and linear (``FtrlOptimizer(name=...)`` /
            ``accum_name`` / ``linear_name``), default ``("Ftrl", "Ftrl_1")``.

    Returns: a :class:`Conversion` (``.fused_params()``, ``.report()``).

    Raises:
        TensorFlowNotInstalled: TensorFlow cannot be imported.
        ValueError: naming the table, for a missing variable or slot, a non-2-D or mismatched shape,
            an invalid hyperparameter, an unreadable checkpoint or a bad ``out`` suffix. Nothing is
            written then.
    """
    out = os.fspath(out)
    _check_flavour(flavour)
    pairs = _table_pairs(tables)
    slots_v1 = _v1_slots(v1_slots)
    _check_suffix(out)
    _check_out_dir(out)
    tf = _import_tf()
    ck = _Checkpoint(tf, checkpoint, "checkpoint", flavour)
    located = [(name, ck.locate(name, spec, slots_v1)) for name, spec in pairs]
    shapes = [ck.check_shapes(name, spec, s) for (name, spec), (_, s) in zip(pairs, located)]
    stored, iterations, _ = _keras_stored(ck, located)
    hp, sources = _resolve_hyperparams(hyperparams, stored, ck.flavour)
    arrays: dict[str, np.ndarray] = {}
    maps = []
    for (name, spec), (_, s), shape in zip(pairs, located, shapes):
        for suffix, key in (("", s.weight_key), ("/accum", s.accum_key), ("/linear", s.linear_key)):
            arrays[name + suffix] = np.ascontiguousarray(ck.reader.get_tensor(key), dtype=np.float32)
        maps.append(TableMap(name, spec, shape, s.weight_key, s.accum_key, s.linear_key, s.layout))
    _write(out, arrays)
    return Conversion("from-tensorflow", ck.flavour, ck.path, out, maps, hp, sources, _notes(maps, hp),
                      iterations)


def to_tensorflow(path: Union[str, os.PathLike], tables, out_prefix: Union[str, os.PathLike], *,
                  flavour: Optional[str] = None, template: Optional[Union[str, os.PathLike]] = None,
                  hyperparams: Optional[Mapping[str, Optional[float]]] = None,
                  v1_slots: Union[str, Sequence[str]] = DEFAULT_V1_SLOTS) -> Conversion:
    """Write FTRL tables of an export file as a TensorFlow checkpoint that TF restores and trains on.

    Args:
        path: the export file (``.npz``/``.safetensors``).
        tables: ``{NAME: TF_VARIABLE}`` as in :func:`from_tensorflow`.
        out_prefix: the checkpoint prefix to write (``out_prefix.index``, ``.data-00000-of-00001``).
        flavour: ``"keras"`` or ``"v1"``; default: the template's, else ``"keras"``.
        template: a checkpoint written by the TensorFlow program that will restore the result (for
            ``keras`` required: Keras 3 ties slots to variables through the optimizer's build order,
            which only that program's checkpoint records). Every tensor of the template is copied and
            the tables' variable, accumulator and linear are replaced (shapes must match). Without a
            template (``v1`` only) the checkpoint holds just ``{var}``, ``{var}/Ftrl``,
            ``{var}/Ftrl_1`` per table.
        hyperparams: TensorFlow-named hyperparameters; ``learning_rate`` is also written into a Keras
            template's learning-rate variable. They are validated and printed as the TF optimizer.

    Raises:
        TensorFlowNotInstalled, ValueError (naming the table: missing in the export file or the
        template, slot missing, shape mismatch); nothing is written then.
    """
    path, out_prefix = os.fspath(path), os.fspath(out_prefix)
    _check_flavour(flavour)
    pairs = _table_pairs(tables)
    slots_v1 = _v1_slots(v1_slots)
    arrays = _read_export(path, [name for name, _ in pairs])
    _check_out_dir(out_prefix)
    tf = _import_tf()
    tensors: dict[str, tuple[Any, Any]] = {}  # checkpoint key -> (value, tf dtype)
    maps, stored, iterations = [], {}, None
    if template is not None:
        ck = _Checkpoint(tf, template, "template", flavour)
        flavour = ck.flavour
        located = [(name, ck.locate(name, spec, slots_v1)) for name, spec in pairs]
        for (name, spec), (_, s) in zip(pairs, located):
            ck.check_shapes(name, spec, s, expected=arrays[name].shape)
        stored, iterations, lr_keys = _keras_stored(ck, located, "the template")
        for key, dtype in ck.dtypes.items():
            tensors[key] = (ck.reader.get_tensor(key), dtype)
        for (name, spec), (_, s) in zip(pairs, located):
            for suffix, key in (("", s.weight_key), ("/accum", s.accum_key), ("/linear", s.linear_key)):
                tensors[key] = (arrays[name + suffix], ck.dtypes[key])
            maps.append(TableMap(name, spec, tuple(arrays[name].shape), s.weight_key, s.accum_key, s.linear_key,
                                 s.layout))
        hp, sources = _resolve_hyperparams(hyperparams, stored, flavour)
        given_lr = (hyperparams or {}).get("learning_rate")
        if given_lr is not None:
            for key in {k for k in lr_keys.values() if k is not None}:
                tensors[key] = (np.asarray(hp.learning_rate), ck.dtypes[key])
        source = f"{path} (template {ck.path})"
    else:
        flavour = flavour or "keras"
        if flavour == "keras":
            raise ValueError("--flavour keras needs --template CKPT: a checkpoint written by the TensorFlow "
                             "program that will restore this one (Keras 3 links optimizer slots to variables "
                             "by the optimizer's build order, which only that program's checkpoint records)")
        for name, spec in pairs:
            var = spec[:-2] if spec.endswith(":0") else spec
            keys = (var, f"{var}/{slots_v1[0]}", f"{var}/{slots_v1[1]}")
            for suffix, key in zip(("", "/accum", "/linear"), keys):
                if key in tensors:
                    raise ValueError(f"table {name!r}: checkpoint key {key!r} is used twice")
                tensors[key] = (arrays[name + suffix], tf.float32)
            maps.append(TableMap(name, var, tuple(arrays[name].shape), *keys))
        hp, sources = _resolve_hyperparams(hyperparams, stored, flavour)
        source = path
    _save_v2(tf, out_prefix, tensors)
    return Conversion("to-tensorflow", flavour, source, out_prefix, maps, hp, sources, _notes(maps, hp),
                      iterations)


# ---------------------------------------------------------------------------------------- files


def _check_out_dir(out: str) -> None:
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise ValueError(f"output directory {directory!r} does not exist")


def _read_export(path: str, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The named tables' arrays from an export file, checked (present, 2-D, slots of one shape)."""
    _check_suffix(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no FTRL table file at {path!r}")
    try:
        arrays = _read(path)
    except Exception as e:
        raise ValueError(f"{path!r} is not a readable {os.path.splitext(path)[1]} file of FTRL tables "
                         f"({type(e).__name__}: {e})") from e
    held = sorted(k for k in arrays if "/" not in k)
    out = {}
    for name in names:
        for suffix, slot in (("", "weight"), ("/accum", "accum"), ("/linear", "linear")):
            key = name + suffix
            if key not in arrays:
                raise ValueError(f"table {name!r}: {path!r} has no {key!r} ({slot}); it holds tables "
                                 f"{held[:12]}{' ...' if len(held) > 12 else ''}")
            out[key] = np.ascontiguousarray(arrays[key], dtype=np.float32)
        shape = out[name].shape
        if len(shape) != 2:
            raise ValueError(f"table {name!r}: {path!r} holds shape {list(shape)}; FTRL tables are 2-D")
        if out[name + "/accum"].shape == shape[:1]:
            raise ValueError(f"table {name!r}: {name + '/accum'!r} has shape {[shape[0]]}, one accum per row "
                             f"(ftrl_accumulator='rowwise'); TensorFlow's Ftrl keeps one per element: "
                             f"convert tables trained with ftrl_accumulator='elementwise'")
        for suffix in ("/accum", "/linear"):
            if out[name + suffix].shape != shape:
                raise ValueError(f"table {name!r}: {name + suffix!r} has shape {list(out[name + suffix].shape)} "
                                 f"!= weight shape {list(shape)}")
    return out


def _save_v2(tf, prefix: str, tensors: Mapping[str, tuple[Any, Any]]) -> None:
    """Write ``tensors`` with TensorFlow's ``SaveV2`` op into a temporary directory next to ``prefix``,
    then move the data file and, last, the index into place (``os.replace``).

    The op runs in a graph of its own (fed through placeholders, so large tables never become graph
    constants), which works whether the caller is eager, inside another graph or has eager disabled.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    tmp = tempfile.mkdtemp(dir=directory, prefix=".tmp-convert-")
    try:
        names = sorted(tensors)
        graph = tf.Graph()
        with graph.as_default():
            feeds = {}
            for k in names:
                value, dtype = tensors[k]
                ph = tf.compat.v1.placeholder(dtype, shape=np.shape(value))
                feeds[ph] = value if dtype == tf.string else np.asarray(value, dtype=dtype.as_numpy_dtype)
            op = tf.raw_ops.SaveV2(prefix=os.path.join(tmp, "ckpt"), tensor_names=names,
                                   shape_and_slices=[""] * len(names), tensors=list(feeds))
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(op, feed_dict=feeds)
        files = sorted(os.listdir(tmp), key=lambda f: f.endswith(".index"))  # index last
        for f in files:
            os.replace(os.path.join(tmp, f), os.path.abspath(prefix) + f[len("ckpt"):])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_ftrl.convert",
        description="Convert FTRL tables between TensorFlow checkpoints (keras.optimizers.Ftrl or "
                    "tf.compat.v1.train.FtrlOptimizer) and torchrec_ftrl export files. See docs/convert.md.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("from-tensorflow", help="TensorFlow checkpoint -> export file (.npz/.safetensors)")
    f.add_argument("checkpoint", metavar="CKPT", help="checkpoint prefix, or a directory with a 'checkpoint' file")
    t = sub.add_parser("to-tensorflow", help="export file -> TensorFlow checkpoint")
    t.add_argument("file", metavar="FILE", help="export file (.npz/.safetensors)")
    t.add_argument("--template", metavar="CKPT", help="a checkpoint of the TensorFlow program that will restore "
                   "the result (required for keras); all its other tensors are copied")
    for sp, out_help in ((f, "export file to write (.npz or .safetensors)"),
                         (t, "checkpoint prefix to write (PREFIX.index, PREFIX.data-00000-of-00001)")):
        sp.add_argument("--table", action="append", required=True, metavar="NAME=TF_VARIABLE",
                        help="export-file table NAME <-> TensorFlow variable (keras: object path such as "
                             "model/emb, or the variable name; v1: the variable name); repeat per table")
        sp.add_argument("--out", required=True, help=out_help)
        sp.add_argument("--flavour", choices=FLAVOURS, help="keras (tf.train.Checkpoint + keras.optimizers.Ftrl) "
                        "or v1 (Saver + tf.compat.v1.train.FtrlOptimizer); default: detected")
        sp.add_argument("--v1-slots", default=",".join(DEFAULT_V1_SLOTS), metavar="ACCUM,LINEAR",
                        help="v1 slot suffixes (default Ftrl,Ftrl_1: {var}/Ftrl, {var}/Ftrl_1)")
        g = sp.add_argument_group("FTRL hyperparameters (TensorFlow names; default: stored in the "
                                  "checkpoint, else TensorFlow's default)")
        for tf_name, (knob, default) in HYPERPARAMETERS.items():
            dflt = "stored in Keras checkpoints; required otherwise" if default is None else f"default {default}"
            g.add_argument("--" + tf_name.replace("_", "-"), dest=tf_name, type=float, default=None,
                           help=f"-> {knob} ({dflt})")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    hyperparams = {name: getattr(args, name) for name in HYPERPARAMETERS}
    # Keep TensorFlow's start-up lines off stderr (errors stay one line): C++ info/warnings, and the oneDNN
    # notice that absl prints before its logging starts. The converter computes nothing in TensorFlow.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    try:
        if args.command == "from-tensorflow":
            result = from_tensorflow(args.checkpoint, args.table, args.out, flavour=args.flavour,
                                     hyperparams=hyperparams, v1_slots=args.v1_slots)
        else:
            result = to_tensorflow(args.file, args.table, args.out, flavour=args.flavour, template=args.template,
                                   hyperparams=hyperparams, v1_slots=args.v1_slots)
    except (TensorFlowNotInstalled, ValueError, FileNotFoundError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    print(result.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
