"""Export / import of FTRL tables (weight, accum, linear) of a sharded model to a plain file.

The file holds, per FTRL table, three full (unsharded) fp32 arrays under TensorFlow's names (a bf16
state is upcast exactly on export; on import into a bf16-state model each value is rounded to the
nearest bf16, ties to even, by ``Tensor.to``):
``"{table}"`` (the weight), ``"{table}/accum"`` and ``"{table}/linear"`` (TF's ``Ftrl`` slots). Format by
suffix: ``.safetensors`` (needs the ``safetensors`` package) or ``.npz`` (NumPy). Positions are never
used to tell slots apart, so a converter from another layout (e.g. DynamicEmb's ``[linear | accum]``
rows) maps names.

Works on a ``DistributedModelParallel`` model (every rank calls it; rank 0 writes) and on plain
modules. For sharded checkpoints that keep the sharding, use ``torch.distributed.checkpoint`` on
``model.state_dict()`` and ``model.fused_optimizer.state_dict()``; both hold these tensors as
ShardedTensors, and the optimizer's also each table's step counter ``{table}.step``.
:func:`load_dcp` loads such a checkpoint all or nothing (staged, checked, then copied).
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.remote_device import _remote_device

from .state_dtype import STATE_NAMES as SLOTS  # the per-table state files, by FTRL's state names
from .tbe.derived_weight import DerivedWeight
from .tbe.table_api import COUNTER, STEP_KEY, value_problem


def _local_pieces(t) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, local tensor) of each local shard of a ShardedTensor / DTensor / plain tensor."""
    if hasattr(t, "local_shards"):
        for shard in t.local_shards():
            yield tuple(shard.metadata.shard_offsets), shard.tensor
    elif hasattr(t, "to_local") and hasattr(t, "placements"):
        raise NotImplementedError("DTensor state dicts are not supported; use ShardedTensor (default)")
    else:
        yield (0,) * t.dim(), t


def _global_shape(t) -> tuple[int, ...]:
    return tuple(t.size())


def ftrl_table_tensors(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """``{table: {"weight": T, "accum": T, "linear": T}}`` for every FTRL table of ``model``,
    where T is the (possibly sharded) tensor TorchRec exposes in the state dicts."""
    tables: dict[str, dict[str, object]] = {}
    opt = getattr(model, "fused_optimizer", None)
    if opt is None:
        raise ValueError(f"model has no fused_optimizer (got {type(model).__name__}); export needs a "
                         "DistributedModelParallel model with fused FTRL tables")
    osd = opt.state_dict()["state"]
    for param_key, states in osd.items():
        for key, tensor in states.items():
            table, _, slot = key.rpartition(".")
            if slot in SLOTS and table:
                tables.setdefault(table, {"param_key": param_key})[slot] = tensor
    msd = model.state_dict()
    for table, entry in tables.items():
        entry["weight"] = msd[entry.pop("param_key")]
    return {t: e for t, e in tables.items() if all(s in e for s in SLOTS)}


def export_ftrl_tables(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Write every FTRL table's full weight, accum and linear to ``path`` (.safetensors or .npz).

    Collective under torch.distributed: every rank must call it; rank 0 writes atomically
    (temporary file + rename).

    Raises:
        ValueError: unknown suffix, or a model without FTRL tables.
    """
    path = os.fspath(path)
    _check_suffix(path)
    tables = ftrl_table_tensors(model)
    if not tables:
        raise ValueError("model has no FTRL tables to export")
    pieces = []
    for table, entry in sorted(tables.items()):
        for name, slot in (("", "weight"), ("/accum", "accum"), ("/linear", "linear")):
            t = entry[slot]
            for offsets, local in _local_pieces(t):
                pieces.append((table + name, _global_shape(t), offsets, local.detach().float().cpu()))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pieces)
        pieces = [p for rank_pieces in gathered for p in rank_pieces]
        if dist.get_rank() != 0:
            dist.barrier()
            return
    arrays: dict[str, np.ndarray] = {}
    for name, shape, offsets, local in pieces:
        full = arrays.setdefault(name, np.zeros(shape, dtype=np.float32))
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
        full[sl] = local.numpy()
    _write(path, arrays)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def import_ftrl_tables(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load weight, accum and linear of every FTRL table of ``model`` from ``path`` (any sharding).

    Every table must be in the file with the model's global shape, and every value must load:
    weights and ``linear`` finite in the model's dtype, ``accum`` finite and >= 0. All the tables and
    slots are checked before any tensor is written, so a bad file leaves the model untouched. The
    file is read with NumPy / safetensors (no pickle).

    Raises:
        FileNotFoundError: no such file. ValueError: unknown suffix, an unreadable (corrupt or
        truncated) file, a missing table/slot, a shape mismatch (naming the table, the slot, both
        shapes and the table's row layout), or a value refused (naming the key and the value).
    """
    path = os.fspath(path)
    _check_suffix(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no FTRL table file at {path!r}")
    try:
        arrays = _read(path)
    except Exception as e:  # truncated / not an archive / wrong format: say which file
        raise ValueError(f"{path!r} is not a readable {os.path.splitext(path)[1]} file of FTRL tables "
                         f"({type(e).__name__}: {e})") from e
    tables = ftrl_table_tensors(model)
    plan = _import_plan(tables, arrays, path, _table_layouts(model))
    with torch.no_grad():
        for key, t in plan:
            src = torch.from_numpy(np.ascontiguousarray(arrays[key]))
            for offsets, local in _local_pieces(t):
                sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                local.copy_(src[sl].to(local.dtype))
    # The writes went to the tables themselves (reading the state dicts above flushed every HBM
    # cache): drop the cached copies, which hold the values from before the import.
    for tbe in _ftrl_tbes(opt_root=getattr(model, "fused_optimizer", None)):
        tbe.reset_cache_states()
    _warn_unrepresented(tables, arrays, path)


def _table_layouts(model: torch.nn.Module) -> dict:
    """``{table name: RowLayout}`` of the FTRL TBEs behind ``model``'s fused optimizer."""
    return {name: tbe.row_layout for tbe in _ftrl_tbes(getattr(model, "fused_optimizer", None))
            for name in tbe.table_names}


def _import_plan(tables, arrays, path: str, layouts: dict) -> list:
    """``(file key, model tensor)`` of every slot of every table, after checking them all: present,
    of the model's global shape, values :func:`~torchrec_ftrl.tbe.table_api.value_problem` accepts
    in each local piece's dtype.

    Raises:
        ValueError: the first problem, naming the key (and, for a shape, the table's row layout).
    """
    plan = []
    for table, entry in sorted(tables.items()):
        for name, slot in (("", "weight"), ("/accum", "accum"), ("/linear", "linear")):
            key, t = table + name, entry[slot]
            if key not in arrays:
                raise ValueError(f"{path!r} has no {key!r} (table {table!r}, slot {slot!r}); it holds "
                                 f"{sorted(arrays)[:10]}")
            if tuple(arrays[key].shape) != _global_shape(t):
                raise ValueError(_shape_message(path, key, table, slot, tuple(arrays[key].shape),
                                                _global_shape(t), layouts.get(table)))
            dtypes = {local.dtype for _, local in _local_pieces(t)}
            value = torch.from_numpy(np.ascontiguousarray(arrays[key]))
            for dtype in sorted(dtypes, key=str):
                problem = value_problem(value, slot, dtype)
                if problem is not None:
                    raise ValueError(f"{path!r}: {key!r} (table {table!r}, slot {slot!r}) {problem}; "
                                     f"nothing was imported")
            plan.append((key, t))
    return plan


def _shape_message(path: str, key: str, table: str, slot: str, got: tuple, want: tuple, layout) -> str:
    """The shape error of ``slot`` (file key ``key``) of ``table``: both shapes, and the row layout
    that stores it."""
    where = f"{path!r}: {key!r}, the {slot} of table {table!r}, has shape {got}"
    if layout is None:
        return f"{where} but the model's is {want}"
    kind = {"accum": "a row-wise" if layout.rowwise else "an element-wise"}.get(slot, "a")
    return (f"{where} but this table's row layout '{'-'.join(layout.key)}' ({layout.describe()}) "
            f"stores {kind} {slot} of shape {want}")


def _warn_unrepresented(tables, arrays, path: str) -> None:
    """A ``UserWarning`` per table with derived weights whose loaded weights differ from the file's:
    rows whose file weight is not ``prox(linear, accum)`` of the file's states (e.g. rows of a
    stored-weights table initialised but never trained) hold that instead."""
    for table, entry in sorted(tables.items()):
        for offsets, local in _local_pieces(entry["weight"]):
            if not isinstance(local, DerivedWeight):
                continue
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            want = torch.from_numpy(np.ascontiguousarray(arrays[table][sl])).float()
            bad = (local.to("cpu", copy=True) != want).any(dim=1).nonzero().flatten() + offsets[0]
            if bad.numel():
                warnings.warn(
                    f"{path!r}: table {table!r} derives its weights from (linear, accum); "
                    f"{bad.numel()} row(s) of the file hold a weight that is not prox(linear, accum) of "
                    f"their states and now hold prox(linear, accum) instead (rows "
                    f"{bad[:8].tolist()}{' ...' if bad.numel() > 8 else ''})", UserWarning, stacklevel=3)


def _ftrl_tbes(opt_root) -> list:
    """The FTRL TBEs behind a (nested) TorchRec ``CombinedOptimizer``: one per fused optimizer."""
    from .tbe import FTRLTableBatchedEmbeddingBags
    found, todo = {}, [opt_root]
    while todo:
        opt = todo.pop()
        emb = getattr(opt, "_emb_module", None)
        if isinstance(emb, FTRLTableBatchedEmbeddingBags):
            found[id(emb)] = emb
        todo.extend(sub for _, sub in getattr(opt, "_optims", ()))
    return list(found.values())


def _check_suffix(path: str) -> None:
    if not path.endswith((".safetensors", ".npz")):
        raise ValueError(f"path must end in .safetensors or .npz, got {path!r}")


def _write(path: str, arrays: dict[str, np.ndarray]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=os.path.splitext(path)[1])
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; the final file gets open()'s usual mode
    try:
        if path.endswith(".safetensors"):
            from safetensors.numpy import save_file
            save_file(arrays, tmp)
        else:
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file
        return load_file(path)
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


# ------------------------------------------------------------------ DCP loads, staged
def load_dcp(model: torch.nn.Module, optimizer, checkpoint_id: str | os.PathLike,
             extra: Optional[dict] = None, stage_on: Optional[str] = None) -> None:
    """Load the ``torch.distributed.checkpoint`` (DCP) checkpoint at ``checkpoint_id``, saved from
    ``{"model": model.state_dict(), "optim": optimizer.state_dict()}`` (and ``"extra"``: more
    tensors, then loaded into ``extra``'s in place), into ``model`` and ``optimizer``, all or
    nothing.

    ``dcp.load`` writes in place into the tensors of the state dict it is given, the tables
    themselves. Here it loads into a staged copy: every tensor of those state dicts cloned (so
    during the load the model's and the optimizer's local state is held twice, a derived table's
    weights as fp32), on its own device, or in host memory when the CUDA tensors of a device would
    take more than :data:`DEVICE_STAGING_SHARE` of its free memory (``stage_on`` overrides this),
    then every FTRL table's tensors are checked (weights and
    ``linear`` finite, ``accum`` finite and >= 0, the step counter ``{table}.step`` an integer
    >= 0), with one verdict for all ranks; only then is the staged state copied into the optimizer
    (``load_state_dict``: states and step counters) and the model (``load_state_dict``). A
    checkpoint without the step counters loads with the steps the TBEs have.

    DCP reads the checkpoint's metadata with ``pickle``: a checkpoint folder is code, so load only
    folders you trust.

    Collective: every rank calls it.

    Args:
        stage_on: ``"device"`` (each tensor staged on its own device), ``"host"`` (in host memory)
            or None (by :data:`DEVICE_STAGING_SHARE`).

    Raises:
        ValueError: an FTRL value refused on some rank (naming the rank, the key and the value);
            a ``stage_on`` other than those above.
        CheckpointException (DCP's): a checkpoint DCP cannot load (missing keys, other shapes, a
            corrupt file). Either way ``model``, ``optimizer`` and ``extra`` are unchanged.
    """
    import torch.distributed.checkpoint as dcp
    checkpoint_id = os.fspath(checkpoint_id)
    live = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    if extra:
        live["extra"] = extra
    staged = _staged(live, _staging_device(live, stage_on))
    absent = _absent_steps(staged, checkpoint_id)
    for states, key, _ in absent:     # not asked of DCP; they load the TBEs' own steps back
        del states[key]
    dcp.load(staged, checkpoint_id=checkpoint_id)
    for states, key, value in absent:
        states[key] = value
    _raise_any(_ftrl_value_problems(staged), checkpoint_id)
    with torch.no_grad():
        optimizer.load_state_dict(staged["optim"])
        model.load_state_dict(staged["model"])
        if extra:
            _copy_into(extra, staged["extra"])


# load_dcp stages in host memory when the CUDA tensors it would clone on a device take more than
# this share of the device's free memory (the rest is left to the load's own buffers).
DEVICE_STAGING_SHARE = 0.5
STAGE_ON = ("device", "host")


def _tensors(obj) -> Iterator[torch.Tensor]:
    """The tensors of a (nested) state dict (a ShardedTensor's: its local shards)."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, ShardedTensor):
        yield from (s.tensor for s in obj.local_shards())
    elif isinstance(obj, torch.Tensor):
        yield obj


def _staging_device(live, stage_on: Optional[str]) -> Optional[torch.device]:
    """Where :func:`load_dcp` stages ``live``: None (each tensor on its own device) or the CPU."""
    if stage_on is not None and stage_on not in STAGE_ON:
        raise ValueError(f"stage_on must be one of {STAGE_ON} or None, got {stage_on!r}")
    if stage_on is not None:
        return torch.device("cpu") if stage_on == "host" else None
    need: dict = {}
    for t in _tensors(live):
        if t.is_cuda:
            need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
    fits = all(n <= DEVICE_STAGING_SHARE * torch.cuda.mem_get_info(dev)[0] for dev, n in need.items())
    return None if fits else torch.device("cpu")


def _staged(obj, device: Optional[torch.device] = None):
    """A copy of a (nested) state dict whose tensors are clones, on their devices or on ``device``
    (a ShardedTensor: its local shards, with its metadata placed there)."""
    if isinstance(obj, dict):
        return {k: _staged(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_staged(v, device) for v in obj]
    if isinstance(obj, ShardedTensor):
        shards = [Shard(_clone(s.tensor, device), _placed(s.metadata, device)) for s in obj.local_shards()]
        metadata = copy.deepcopy(obj.metadata())
        metadata.shards_metadata = [_placed(m, device) for m in metadata.shards_metadata]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, metadata, process_group=obj._process_group)
    if isinstance(obj, torch.Tensor):
        return _clone(obj, device)
    return copy.deepcopy(obj)


def _clone(t: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    return t.detach().clone() if device is None else t.detach().to(device, copy=True)


def _placed(shard_metadata, device: Optional[torch.device]):
    """A copy of a shard's metadata, placed on ``device`` of the same rank (unchanged for None)."""
    out = copy.deepcopy(shard_metadata)
    if device is not None and out.placement is not None:
        out.placement = _remote_device(f"rank:{out.placement.rank()}/{device}")
    return out


def _ftrl_groups(state: dict) -> Iterator[tuple[str, str, dict]]:
    """``(prefix, param key, per-table states)`` of each FTRL table in an optimizer ``state_dict``'s
    ``"state"``: a param's states ``"{table}.accum"`` and ``"{table}.linear"`` (and ``"{table}.step"``)."""
    for param_key, states in state.items():
        if not isinstance(states, dict):
            continue
        for key in states:
            table, _, slot = key.rpartition(".")
            if slot == "accum" and f"{table}.linear" in states:
                yield table, param_key, states


def _absent_steps(staged: dict, checkpoint_id: str) -> list[tuple[dict, str, torch.Tensor]]:
    """``(per-param states, key, value)`` of each FTRL step counter of ``staged["optim"]`` that the
    checkpoint does not hold (a checkpoint of an optimizer without them)."""
    import torch.distributed.checkpoint as dcp
    if not os.path.isdir(checkpoint_id):
        return []
    try:
        saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    except Exception:   # no readable metadata: dcp.load says what is wrong
        return []
    absent = []
    for table, param_key, states in _ftrl_groups(staged["optim"].get("state", {})):
        key = f"{table}.{STEP_KEY}"
        if key in states and f"optim.state.{param_key}.{key}" not in saved:
            absent.append((states, key, states[key]))
    return absent


def _ftrl_value_problems(staged: dict) -> list[str]:
    """This rank's problems with the FTRL tensors of a loaded staged state: ``"'key' problem"``."""
    problems = []
    model = staged.get("model", {})
    for table, param_key, states in _ftrl_groups(staged["optim"].get("state", {})):
        entries = [(f"optim.state.{param_key}.{table}.{slot}", states.get(f"{table}.{slot}"), kind)
                   for slot, kind in (("accum", "accum"), ("linear", "linear"), (STEP_KEY, COUNTER))]
        entries.append((f"model.{param_key}", model.get(param_key), "weight"))
        for key, tensor, kind in entries:
            if tensor is None:
                continue
            for _, local in _local_pieces(tensor):
                problem = value_problem(local, kind, local.dtype)
                if problem is not None:
                    problems.append(f"{key!r} {problem}")
                    break
    return problems


def _raise_any(problems: list[str], checkpoint_id: str) -> None:
    """Raise the first problem of any rank (every rank learns every rank's verdict).

    Raises:
        ValueError: naming the rank, the checkpoint and the problem.
    """
    ranked = [(0, p) for p in problems]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems[:1])
        ranked = [(rank, p) for rank, ps in enumerate(gathered) for p in ps]
    if ranked:
        rank, problem = ranked[0]
        raise ValueError(f"checkpoint {checkpoint_id!r}: {problem} (rank {rank}); nothing was loaded")


def _copy_into(live, staged) -> None:
    """Copy the loaded ``staged`` values into the (nested) dict ``live``: tensors in place."""
    for k, v in staged.items():
        if isinstance(v, dict) and isinstance(live.get(k), dict):
            _copy_into(live[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
            live[k].copy_(v)
        else:
            live[k] = v
