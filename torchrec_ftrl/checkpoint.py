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
ShardedTensors.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from .state_dtype import STATE_NAMES as SLOTS  # the per-table state files, by FTRL's state names
from .tbe.derived_weight import DerivedWeight


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

    Every table must be in the file with the model's global shape; all checks run before any
    tensor is written, so a bad file leaves the model untouched.

    Raises:
        FileNotFoundError: no such file. ValueError: unknown suffix, an unreadable (corrupt or
        truncated) file, a missing table/slot, or a shape mismatch (naming the table, the slot and
        both shapes).
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
    plan = []
    for table, entry in sorted(tables.items()):
        for name, slot in (("", "weight"), ("/accum", "accum"), ("/linear", "linear")):
            key = table + name
            t = entry[slot]
            if key not in arrays:
                raise ValueError(f"{path!r} has no {key!r} (table {table!r}, slot {slot!r}); it holds "
                                 f"{sorted(arrays)[:10]}")
            if tuple(arrays[key].shape) != _global_shape(t):
                raise ValueError(f"{key!r}: file shape {tuple(arrays[key].shape)} != model shape "
                                 f"{_global_shape(t)}")
            plan.append((key, t))
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
