"""2D sparse parallel (TorchRec's ``DMPCollection``) with FTRL tables.

``DMPCollection`` shards a model within each sharding group and keeps one replica of every shard per
group; ``sync()`` averages the replicas over the replica process group. TorchRec collects only
FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` modules and their ``state["sum"]``
(``DMPCollection._cache_sync_tensors``, torchrec 1.8.0 and 1.9.2), so FTRL tables would drift apart
silently. :mod:`.patches` wraps both methods:

* ``DMPCollection.__init__`` (:func:`ftrl_dmp_collection_init`): after TorchRec's construction, a model
  with FTRL tables is refused with ``ValueError`` where this module cannot sync them (a torchrec
  without per-context replica groups, ``submodule_configs``, a sharding strategy other than
  ``DEFAULT``, or hash-ZCH tables, which TorchRec syncs through ``sync_hash_zch_weights`` and its
  ``state["sum"]``);
* ``DMPCollection.sync`` (:func:`ftrl_dmp_collection_sync`): after TorchRec's sync, every FTRL TBE
  is averaged across its replicas by :func:`average_ftrl_replicas`.

The rule (docs/ftrl.md, "Replicas (2D parallel)"): every optimizer state the TBE keeps is averaged
element-wise in fp32 and stored in its dtype (a bf16 state rounds to nearest even), then the weight
is derived from the stored states, ``w = prox(z, n)`` (:func:`torchrec_ftrl.rule.ftrl_prox`) with the
table's hyperparameters. FTRL's weight is a function of ``(z, n)``, so averaging the weights
themselves would leave each replica with a weight its state does not produce, and the next touch of
the row would recompute it from ``(z, n)`` anyway. FTRL tables sync their states also with
``include_optimizer_state=False``: their state is what defines the weight.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from ..tbe import FTRLTableBatchedEmbeddingBags
from .compute_kernels import ftrl_tbes

# The TBE's names (``get_optimizer_state``) of the two states the weight derives from.


@torch.no_grad()
def average_ftrl_replicas(tbes: list[FTRLTableBatchedEmbeddingBags], replica_pg) -> None:
    """Make every replica of each TBE in ``tbes`` equal (one all-reduce per table over ``replica_pg``):
    each state of ``get_optimizer_state()`` := the fp32 mean over the replicas (sum, then divide by
    the group size; stored by ``copy_``, so a bf16 state rounds to nearest even), then each weight of
    ``split_embedding_weights()`` := ``derived_weights`` (``ftrl_prox(linear, accum)``) of the stored states, in the
    weight dtype, where the TBE stores weights (:func:`stores_weights`). A cached TBE's HBM cache is
    flushed before and emptied after."""
    replicas = dist.get_world_size(replica_pg)
    for tbe in tbes:
        for per_table in tbe.get_optimizer_state():   # one table at a time: one fp32 copy of its states
            states = [t for _, t in sorted(per_table.items())]
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in states])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=replica_pg)
            flat /= replicas
            start = 0
            for t in states:
                t.copy_(flat[start:start + t.numel()].view(t.shape))
                start += t.numel()
        if stores_weights(tbe):
            for t, w in enumerate(tbe.split_embedding_weights()):
                w.copy_(tbe.derived_weights(t))
        tbe.reset_cache_states()


def stores_weights(tbe: FTRLTableBatchedEmbeddingBags) -> bool:
    """Whether ``tbe``'s row layout stores the weight (a TBE without ``row_layout`` does); a layout
    with derived weights computes ``prox(z, n)`` where it reads them, so only its states sync."""
    layout = getattr(tbe, "row_layout", None)
    return layout is None or layout.stores_weights


def _replica_groups(dmpc) -> list:
    """The replica process group of each of ``dmpc``'s sharding contexts (torchrec 1.8+)."""
    return [ctx.replica_pg for ctx in getattr(dmpc, "_ctxs", ())]


def check_ftrl_replicas(dmpc) -> None:
    """Raises ValueError when ``dmpc`` (a constructed ``DMPCollection``) holds FTRL tables that
    :func:`average_ftrl_replicas` cannot sync: this torchrec's ``DMPCollection`` has no per-context
    replica groups, or the model uses ``submodule_configs`` (several replica groups)."""
    tbes = ftrl_tbes(dmpc)
    if not tbes:
        return
    groups = _replica_groups(dmpc)
    if len(groups) != 1 or groups[0] is None:
        raise ValueError(
            f"DMPCollection holds {len(tbes)} FTRL TBE(s) but has "
            f"{len(groups)} replica groups (submodule_configs, or a torchrec whose DMPCollection keeps "
            f"none per context); torchrec_ftrl syncs FTRL replicas over exactly one replica group. "
            f"Use DistributedModelParallel, or DMPCollection without submodule_configs")
    strategies = sorted({getattr(ctx, "sharding_strategy", None).name for ctx in dmpc._ctxs
                         if getattr(getattr(ctx, "sharding_strategy", None), "name", "DEFAULT") != "DEFAULT"})
    if strategies:
        raise ValueError(
            f"DMPCollection holds FTRL tables under sharding_strategy {strategies}; torchrec_ftrl syncs "
            f"FTRL replicas only under ShardingStrategy.DEFAULT (sync() averages every state, then "
            f"derives the weights); FULLY_SHARDED reduce-scatters the weights alone")
    zch = sorted({table for ctx in dmpc._ctxs for kernel, table in getattr(ctx, "hash_zch_modules", ())
                  if ftrl_tbes(kernel)})
    if zch:
        raise ValueError(
            f"DMPCollection holds hash-ZCH (MPZCH) FTRL tables {zch}: TorchRec syncs their replicas with "
            f"sync_hash_zch_weights, which averages one optimizer state named 'sum'; FTRL's weight "
            f"derives from two ('accum', 'linear'). Use DistributedModelParallel for these tables")


def ftrl_dmp_collection_init(original: Callable[..., None]) -> Callable[..., None]:
    """``DMPCollection.__init__`` followed by :func:`check_ftrl_replicas`."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        check_ftrl_replicas(self)
    return __init__


def ftrl_dmp_collection_sync(original: Callable[..., None]) -> Callable[..., None]:
    """``DMPCollection.sync`` followed by :func:`average_ftrl_replicas` over the replica group."""

    @functools.wraps(original)
    def sync(self, include_optimizer_state: bool = True) -> None:
        original(self, include_optimizer_state)
        tbes = ftrl_tbes(self)
        if tbes:
            average_ftrl_replicas(tbes, _replica_groups(self)[0])
    return sync
