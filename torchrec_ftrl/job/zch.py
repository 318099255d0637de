"""Managed collision (ZCH) for the CTR job (``--zch``): raw ids mapped to table slots by TorchRec.

With ``--zch`` the data readers keep each categorical value's raw id (Criteo's hex value as is, other
strings hashed to 62 bits; :data:`RAW_ID_SPACE`), with no vocabulary and no modulo. Each table is then
a zero-collision hash table of ``--num-embeddings`` slots: TorchRec's ``MCHManagedCollisionModule``
(``DistanceLFU_EvictionPolicy``, an eviction pass every ``--zch-eviction-interval`` training
forwards) maps raw ids to slots inside ``ManagedCollisionEmbeddingBagCollection``, which
``ManagedCollisionEmbeddingBagCollectionSharder`` shards row-wise (the only sharding TorchRec gives
managed-collision modules) around the job's embedding sharder. A slot handed to a new id restarts:
the fused optimizer's ``reset_embedding_weight_momentum`` (for FTRL: accum = initial accumulator,
linear 0) and the table's ``init_fn`` (zeros) for the weight, so every id starts where FTRL starts. The remapping state (sorted raw ids, slot map, eviction metadata) is part of ``state_dict`` and so
of the job's DCP checkpoints.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

# Raw ids of a --zch run lie in [0, RAW_ID_SPACE): MCHManagedCollisionModule's input_hash_size, and
# the table size the readers reduce ids by (a no-op for Criteo's 32-bit hex values). Below 2^62, so
# the pyarrow reader decodes the ids itself.
RAW_ID_SPACE = (1 << 62) - 1


def slots_per_table(num_embeddings: Sequence[int], num_tables: int) -> list[int]:
    """``--num-embeddings`` (one entry for every table, or one per table) as one slot count per table.

    Raises:
        ValueError: a list whose length is neither 1 nor ``num_tables``.
    """
    if len(num_embeddings) == 1:
        return [int(num_embeddings[0])] * num_tables
    if len(num_embeddings) != num_tables:
        raise ValueError(f"--num-embeddings has {len(num_embeddings)} entries for {num_tables} "
                         f"categorical columns")
    return [int(n) for n in num_embeddings]


class PooledOnly(nn.Module):
    """Holds a ``ManagedCollisionEmbeddingBagCollection`` and returns only its pooled ``KeyedTensor``
    (what DLRM's ``SparseArch`` expects of an ``EmbeddingBagCollection``): ``forward(KJT of raw ids)
    -> KeyedTensor [B, sum(D)]``."""

    def __init__(self, mc_ebc: nn.Module) -> None:
        super().__init__()
        self.mc_ebc = mc_ebc

    def forward(self, features):
        return self.mc_ebc(features)[0]


# The attribute path of the MC-EBC inside CTRTrain after add_managed_collision.
MC_EBC_PATH = "sparse_arch.embedding_bag_collection.mc_ebc"


def add_managed_collision(dlrm: nn.Module, eviction_interval: int, device: torch.device) -> None:
    """Put DLRM's ``EmbeddingBagCollection`` (on the meta device) behind managed collision, in place:
    one ``MCHManagedCollisionModule(zch_size=num_embeddings, input_hash_size=RAW_ID_SPACE,
    eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=eviction_interval)`` per table,
    its buffers on ``device``. The tables' ``init_fn`` becomes ``zeros_``: every slot handed to a
    new id (its first fill included) starts at FTRL's starting point, weight 0, with the fused
    optimizer's reset state, and no eviction draws from the global RNG, so a resumed run evicts and
    initialises exactly as the uninterrupted one.

    Raises:
        ValueError: ``eviction_interval < 1``.
    """
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)

    if eviction_interval < 1:
        raise ValueError(f"eviction_interval must be >= 1, got {eviction_interval}")
    ebc = dlrm.sparse_arch.embedding_bag_collection
    tables = ebc.embedding_bag_configs()
    for t in tables:   # TorchRec writes init_fn into every slot it hands to a new id
        t.init_fn = torch.nn.init.zeros_
    mcc = ManagedCollisionCollection(
        {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=device,
                                           eviction_policy=DistanceLFU_EvictionPolicy(),
                                           eviction_interval=eviction_interval,
                                           input_hash_size=RAW_ID_SPACE)
         for t in tables},
        embedding_configs=tables)
    dlrm.sparse_arch.embedding_bag_collection = PooledOnly(
        ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False))


def shard(model: nn.Module, table_names: Sequence[str], sharders: list, device: torch.device,
          world_size: int, local_world_size: int):
    """DMP over a model from :func:`add_managed_collision`: every table row-wise on the ``fused``
    kernel, sharded by ``ManagedCollisionEmbeddingBagCollectionSharder`` around the
    ``EmbeddingBagCollectionSharder`` among ``sharders``. Returns ``(dmp_model, plan)``.

    Raises:
        ValueError: no ``EmbeddingBagCollectionSharder`` in ``sharders``.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    from .model import data_parallel_wrapper

    ebc_sharders = [s for s in sharders if isinstance(s, EmbeddingBagCollectionSharder)]
    if not ebc_sharders:
        raise ValueError(f"sharders must hold an EmbeddingBagCollectionSharder, got {sharders!r}")
    mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharders[0])
    mc_ebc = model.get_submodule(MC_EBC_PATH)
    module_plan = construct_module_sharding_plan(
        mc_ebc, per_param_sharding={t: row_wise(compute_kernel="fused") for t in table_names},
        sharder=mc_sharder, local_size=local_world_size, world_size=world_size,
        device_type=device.type)
    plan = ShardingPlan({MC_EBC_PATH: module_plan})
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[mc_sharder, *sharders],
                                   data_parallel_wrapper=data_parallel_wrapper(world_size))
    return dmp, plan


def size_history_buffers(dmp: nn.Module, values_per_forward: int) -> None:
    """Size every ``MCHManagedCollisionModule``'s id-history buffer for ``values_per_forward`` ids
    per training forward (the most a rank's module can receive).

    TorchRec sizes the buffer from the first training batch it sees (its ids x 1.25 x the eviction
    interval) and drops the ids of a later, larger batch that do not fit, so which ids are counted,
    and so what is evicted, would depend on the batch a run starts (or resumes) with. Sized from the
    largest batch, nothing is dropped and a resumed run evicts as the uninterrupted one.

    Raises:
        ValueError: the model holds no ``MCHManagedCollisionModule``.
    """
    from torchrec.modules.mc_modules import MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    found = [m for m in dmp.modules() if isinstance(m, MCHManagedCollisionModule)]
    if not found:
        raise ValueError("the model holds no MCHManagedCollisionModule")
    for m in found:
        ids = torch.zeros(int(values_per_forward), dtype=torch.int64, device=m.device)
        m._init_history_buffers({"ids": JaggedTensor(values=ids, lengths=torch.ones_like(ids))})


class EvictionCounter:
    """Counts the slots TorchRec resets in the sharded managed-collision modules of a DMP model, on
    this rank: ``evicted`` (int), every slot handed to a new id (an empty slot's first fill counts
    too, as TorchRec resets it the same way), read on the host from the eviction tensors' shapes, so
    counting never waits for the device."""

    def __init__(self, dmp: nn.Module) -> None:
        from torchrec.distributed.mc_embeddingbag import ShardedManagedCollisionEmbeddingBagCollection

        self.evicted = 0
        found = [m for m in dmp.modules() if isinstance(m, ShardedManagedCollisionEmbeddingBagCollection)]
        if not found:
            raise ValueError("the model holds no ShardedManagedCollisionEmbeddingBagCollection")
        for m in found:
            m._evict = self._counting(m._evict)

    def _counting(self, evict):
        def wrapped(evictions_per_table):
            self.evicted += sum(int(v.numel()) for v in evictions_per_table.values() if v is not None)
            return evict(evictions_per_table)
        return wrapped
