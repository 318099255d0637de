"""TorchRec's dynamic sharding (``DistributedModelParallel.reshard``) for modules with FTRL tables.

TorchRec's ``ShardedEmbeddingBagCollection.update_shards`` rebuilds the module's lookups for the new
plan and then moves each table's weight and ONE optimizer state, always looked up as
``"<table>.momentum1"`` (``torchrec/distributed/sharding/dynamic_sharding.py``; identical in torchrec
1.8.0 and 1.9.2). FTRL's states are named by the TBE (``accum``, ``linear``, or whatever its layout
keeps), so the stock transfer raises ``KeyError`` after the module was half rebuilt. For a module
holding FTRL tables, :func:`update_shards` (installed over the stock method by :mod:`.patches`):

1. checks every changed table's new plan (:func:`check_reshard`) and raises ``ValueError`` before
   anything changes when a move cannot be honoured;
2. keeps the module's state tensors: every ``ShardedTensor`` of ``module.state_dict()`` and of its
   fused optimizer's ``state_dict()["state"]``, whatever their names (:func:`sharded_state`);
3. runs TorchRec's rebuild with its own tensor moves switched off;
4. moves every kept tensor, bitwise, into the rebuilt module: each piece where an old shard and a new
   shard overlap goes from the old shard's rank to the new shard's rank (:func:`move_state`), so
   every sharding type moves one way, and tables that did not move are copied locally; the rebuilt
   FTRL TBEs continue at the module's optimizer step (``iter``, which keys the stochastic rounding of
   bf16 states).

The P2P tags are the index of the piece in one list every rank builds in the same order, never
Python's ``hash()`` of a string (which the stock transfer uses, so ranks on gloo disagree unless
``PYTHONHASHSEED`` is fixed).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed import embeddingbag
from torchrec.distributed.types import ShardingType
from torchrec.optim.keyed import CombinedOptimizer

from ..optim_type import is_ftrl
from .compute_kernels import FTRL_COMPUTE_KERNELS, ftrl_tbes

# A shard of one state tensor: (offsets, sizes, rank), in the tensor's global index space.
Box = tuple[tuple[int, ...], tuple[int, ...], int]

_MOVABLE = frozenset({ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
                      ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value,
                      ShardingType.TABLE_COLUMN_WISE.value})


def has_ftrl_tables(module) -> bool:
    """Whether any table of the sharded ``module`` is trained by FTRL, read from its sharding infos
    (the same on every rank, so every rank takes the same path)."""
    infos = getattr(module, "sharding_type_to_sharding_infos", None) or {}
    return any(is_ftrl((info.fused_params or {}).get("optimizer"))
               for per_type in infos.values() for info in per_type)


def _boxes(spec) -> list[Box]:
    return [(tuple(s.shard_offsets), tuple(s.shard_sizes), s.placement.rank()) for s in spec.shards]


def check_reshard(module, changed: dict[str, Any], world_size: int) -> None:
    """Raises ValueError, naming the table and the value, unless every entry of ``changed`` (table
    name -> new ``ParameterSharding``) is a move TorchRec's rebuild and :func:`move_state` can carry:
    a table of ``module``, the same sharding type (one of table-wise, column-wise, row-wise,
    table-row-wise, table-column-wise) and compute kernel as now (an FTRL table's kernel one of
    FTRL's), ranks in ``[0, world_size)``, shards that tile the table exactly, and for row-wise and
    table-row-wise tables the same row blocks on consecutive ranks (:func:`_check_row_blocks`)."""
    plan = module.module_sharding_plan
    configs = {info.embedding_config.name: info for per_type in module.sharding_type_to_sharding_infos.values()
               for info in per_type}
    for name, new in changed.items():
        if name not in plan or name not in configs:
            raise ValueError(f"reshard: {name!r} is not a table of this module (tables: {sorted(plan)})")
        old = plan[name]
        if new.sharding_type != old.sharding_type:
            raise ValueError(f"reshard: table {name!r} would change sharding type from {old.sharding_type!r} "
                             f"to {new.sharding_type!r}; TorchRec's dynamic sharding moves shards within "
                             f"one sharding type")
        if new.sharding_type not in _MOVABLE:
            raise ValueError(f"reshard: table {name!r} has sharding type {new.sharding_type!r}; movable: "
                             f"{sorted(_MOVABLE)}")
        if new.compute_kernel != old.compute_kernel:
            raise ValueError(f"reshard: table {name!r} would change compute kernel from "
                             f"{old.compute_kernel!r} to {new.compute_kernel!r}; a reshard moves shards only")
        info = configs[name]
        if is_ftrl((info.fused_params or {}).get("optimizer")) and new.compute_kernel not in FTRL_COMPUTE_KERNELS:
            raise ValueError(f"reshard: FTRL table {name!r} planned with compute kernel {new.compute_kernel!r}; "
                             f"FTRL runs on {sorted(FTRL_COMPUTE_KERNELS)}")
        ranks = list(new.ranks or [])
        if not ranks or any(not 0 <= r < world_size for r in ranks):
            raise ValueError(f"reshard: table {name!r} has ranks {ranks}; each must be in [0, {world_size})")
        if new.sharding_spec is None:
            raise ValueError(f"reshard: table {name!r} has no sharding_spec")
        rows, dim = info.embedding_config.num_embeddings, info.embedding_config.embedding_dim
        boxes = _boxes(new.sharding_spec)
        inside = all(len(o) == 2 and 0 <= o[0] and 0 <= o[1] and o[0] + s[0] <= rows and o[1] + s[1] <= dim
                     for o, s, _ in boxes)
        volume = sum(s[0] * s[1] for _, s, _ in boxes)
        overlap = any(_overlap(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])
        if not inside or volume != rows * dim or overlap:
            raise ValueError(f"reshard: the shards of table {name!r} {[(o, s) for o, s, _ in boxes]} "
                             f"(offsets, sizes) do not tile its [{rows}, {dim}] weight")
        if sorted({r for _, _, r in boxes}) != sorted(set(ranks)):
            raise ValueError(f"reshard: table {name!r} lists ranks {ranks} but its shards are placed on "
                             f"{sorted({r for _, _, r in boxes})}")
        if new.sharding_type in _ROW_BLOCKS:
            _check_row_blocks(name, new.sharding_type, boxes, _boxes(old.sharding_spec))


_ROW_BLOCKS = frozenset({ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value})


def _check_row_blocks(name: str, sharding_type: str, boxes: list[Box], old: list[Box]) -> None:
    """Row-wise shards must keep TorchRec's row blocks, block k on the k-th of consecutive ranks:
    TorchRec's row-wise input dist sends row block k (even blocks of the table) to the k-th rank of
    its group whatever the sharding spec says, so another split or order would train wrong rows. A
    row-wise table spans its whole sharding group, so its ranks stay too; a table-row-wise table may
    move to another host's consecutive ranks."""
    by_row = sorted(boxes)
    first = by_row[0][2] if sharding_type == ShardingType.TABLE_ROW_WISE.value else sorted(old)[0][2]
    if ([(o, s) for o, s, _ in by_row] != sorted((o, s) for o, s, _ in old)
            or [r for _, _, r in by_row] != list(range(first, first + len(by_row)))):
        raise ValueError(
            f"reshard: {sharding_type} table {name!r} would have shards {[(o, s, r) for o, s, r in by_row]} "
            f"(offsets, sizes, rank); its row blocks must stay {[(o, s) for o, s, _ in sorted(old)]}, "
            f"block k on the k-th of consecutive ranks (TorchRec routes row block k to the k-th rank"
            f"{'' if sharding_type == ShardingType.TABLE_ROW_WISE.value else ' of ' + str(sorted({r for *_, r in old}))})")


def sharded_state(module) -> dict[str, ShardedTensor]:
    """Every ``ShardedTensor`` the sharded ``module`` keeps: its ``state_dict()`` entries (weights)
    under their keys and its fused optimizer's states under ``"<param key>/<state name>"``, with the
    names the TBE gives them."""
    out = {k: v for k, v in module.state_dict().items() if isinstance(v, ShardedTensor)}
    for key, states in module.fused_optimizer.state_dict()["state"].items():
        for name, t in states.items():
            if isinstance(t, ShardedTensor):
                out[f"{key}/{name}"] = t
    return out


def _layout(state: dict[str, ShardedTensor]) -> dict[str, tuple[str, list[Box]]]:
    return {k: (str(t.metadata().tensor_properties.dtype), _boxes_of(t)) for k, t in state.items()}


def _boxes_of(t: ShardedTensor) -> list[Box]:
    return [(tuple(m.shard_offsets), tuple(m.shard_sizes), m.placement.rank())
            for m in t.metadata().shards_metadata]


def _gather_layouts(state: dict[str, ShardedTensor], pg) -> dict[str, tuple[str, list[Box]]]:
    """The global layout of every key any rank holds (a rank without a shard of a table has no
    optimizer entry for it)."""
    parts: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(parts, _layout(state), group=pg)
    merged: dict[str, tuple[str, list[Box]]] = {}
    for part in parts:
        merged.update(part)
    return merged


def _overlap(a: Box, b: Box) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _piece(local: dict[tuple[int, ...], torch.Tensor], box: Box, lo, size) -> torch.Tensor:
    t = local[box[0]]
    return t[tuple(slice(l - o, l - o + s) for l, o, s in zip(lo, box[0], size))]


def _local_shards(t: Optional[ShardedTensor]) -> dict[tuple[int, ...], torch.Tensor]:
    if t is None:
        return {}
    return {tuple(s.metadata.shard_offsets): s.tensor for s in t.local_shards()}


@torch.no_grad()
def move_state(old: dict[str, ShardedTensor], new: dict[str, ShardedTensor], pg) -> None:
    """Copy every tensor of ``old`` into the tensor of the same key in ``new``, bitwise, across
    ranks: each overlap of an old shard (on rank s) and a new shard (on rank d) goes from s to d by
    P2P (``batch_isend_irecv`` on ``pg``, raw bytes), or by a local copy when s == d.

    Raises:
        RuntimeError: a key or dtype of the old state missing from the new one (the rebuilt module
            does not hold the same tables).
    """
    old_layout, new_layout = _gather_layouts(old, pg), _gather_layouts(new, pg)
    rank = dist.get_rank(pg)
    ops, received = [], []
    tag = 0
    for key in sorted(old_layout):
        if key not in new_layout or new_layout[key][0] != old_layout[key][0]:
            raise RuntimeError(f"reshard: state {key!r} ({old_layout[key][0]}) has no counterpart after the "
                               f"rebuild ({new_layout.get(key, ('absent',))[0]})")
        src_local, dst_local = _local_shards(old.get(key)), _local_shards(new.get(key))
        for src in old_layout[key][1]:
            for dst in new_layout[key][1]:
                region = _overlap(src, dst)
                if region is None:
                    continue
                tag += 1
                if src[2] == rank and dst[2] == rank:
                    _piece(dst_local, dst, *region).copy_(_piece(src_local, src, *region))
                elif src[2] == rank:
                    data = _piece(src_local, src, *region).contiguous().view(torch.uint8)
                    ops.append(dist.P2POp(dist.isend, data, dist.get_global_rank(pg, dst[2]) if pg else dst[2],
                                          pg, tag))
                elif dst[2] == rank:
                    target = _piece(dst_local, dst, *region)
                    buf = torch.empty_like(target, memory_format=torch.contiguous_format)
                    ops.append(dist.P2POp(dist.irecv, buf.view(torch.uint8),
                                          dist.get_global_rank(pg, src[2]) if pg else src[2], pg, tag))
                    received.append((target, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for target, buf in received:
        target.copy_(buf)


@contextlib.contextmanager
def _stock_moves_off(module) -> Iterator[None]:
    """TorchRec's rebuild without its tensor moves: ``prepare_comm_ops`` plans none and the module's
    optimizer reads as empty (so ``update_shards`` neither looks up ``"<table>.momentum1"`` nor loads
    optimizer state)."""
    original = embeddingbag.prepare_comm_ops
    optim = module._optim
    embeddingbag.prepare_comm_ops = lambda *a, **k: {}
    module._optim = CombinedOptimizer([])
    try:
        yield
    finally:
        embeddingbag.prepare_comm_ops = original
        if not module._optim._optims:   # the rebuild failed before it made the new optimizer
            module._optim = optim


def _optimizer_step(module, pg, device) -> int:
    """The largest ``iter`` (optimizer step) of the FTRL TBEs of ``module`` on any rank of ``pg``."""
    local = max((int(tbe.iter.max()) for tbe in ftrl_tbes(module)), default=0)
    steps = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=pg)
    return int(steps.item())


def ftrl_update_shards(original: Callable[..., None]) -> Callable[..., None]:
    """``ShardedEmbeddingBagCollection.update_shards`` that carries every FTRL state (module docstring);
    modules without FTRL tables take ``original``."""

    @functools.wraps(original)
    def update_shards(self, changed_sharding_params, env, device) -> None:
        if not has_ftrl_tables(self) or not changed_sharding_params:
            return original(self, changed_sharding_params, env, device)
        check_reshard(self, dict(changed_sharding_params), env.world_size)
        old = sharded_state(self)
        step = _optimizer_step(self, env.process_group, device)
        with _stock_moves_off(self):
            original(self, changed_sharding_params, env, device)
        for tbe in ftrl_tbes(self):   # the rebuilt TBEs start at 0; bf16 states round keyed by it
            tbe.set_optimizer_step(step)
        # TorchRec recreates the input dist at the next forward but keeps this flag, which its
        # _create_input_dist only ever clears: a new feature order would be skipped.
        self._has_features_permute = True
        new = sharded_state(self)
        move_state(old, new, env.process_group)
        self._optim.load_state_dict(self._optim.state_dict())   # kernels' post-load hooks (cache reset)
    return update_shards
