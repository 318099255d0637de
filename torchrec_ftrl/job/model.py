"""DLRM with one embedding table per categorical feature, sharded by DMP with fused sparse optimizer;
its forward takes a batch and returns ``(loss, output)`` (what TorchRec's train pipelines call)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM


class CTRTrain(DLRM):
    """TorchRec's ``DLRM`` with the forward a train pipeline calls: ``forward(batch) -> (loss,
    (loss, logits, labels))``, as ``torchrec.models.dlrm.DLRMTrain`` returns it, for a
    ``torchrec.datasets.utils.Batch`` (``dense_features [B, num_dense]`` float32, KJT
    ``sparse_features``, ``labels [B]`` float32). ``loss`` is the 0-d float32 batch-mean binary
    cross-entropy of the logits; ``logits`` ``[B]`` float32 (detached); ``labels`` the batch's.

    Unlike ``DLRMTrain``, which holds the DLRM as ``.model``, it *is* the DLRM: parameter and
    state_dict names are DLRM's (``sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight``,
    ...). With ``num_dense == 0`` the dense input is a constant ``ones [B, 1]`` (the bottom MLP then
    learns a bias), which ``DLRMTrain`` cannot express.
    """

    def __init__(self, num_dense: int, **dlrm_kwargs) -> None:
        super().__init__(**dlrm_kwargs)
        self.num_dense = int(num_dense)

    def forward(self, batch):  # documented on the class
        dense = (batch.dense_features if self.num_dense > 0
                 else torch.ones_like(batch.labels).unsqueeze(1))
        logits = super().forward(dense, batch.sparse_features).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_dlrm(feature_names: Sequence[str], num_embeddings: Sequence[int], embedding_dim: int,
               num_dense: int, dense_arch: Sequence[int], over_arch: Sequence[int],
               dense_device: torch.device) -> nn.Module:
    """Unsharded ``CTRTrain`` (a TorchRec ``DLRM``): ``EmbeddingBagCollection`` on the meta device
    (DMP materialises it), one sum-pooled table ``t_{feature}`` per feature, bottom MLP
    ``dense_arch + [embedding_dim]`` over ``max(num_dense, 1)`` inputs, top MLP ``over_arch + [1]``.
    Forward: ``Batch -> (loss 0-d, (loss, logits [B], labels [B]))`` (see ``CTRTrain``).

    Raises:
        ValueError: ``feature_names`` and ``num_embeddings`` of different lengths.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if len(feature_names) != len(num_embeddings):
        raise ValueError(f"{len(feature_names)} features but {len(num_embeddings)} table sizes")
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=n,
                                 feature_names=[f], pooling=PoolingType.SUM)
              for f, n in zip(feature_names, num_embeddings)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return CTRTrain(num_dense, embedding_bag_collection=ebc, dense_in_features=max(num_dense, 1),
                    dense_arch_layer_sizes=[*dense_arch, embedding_dim],
                    over_arch_layer_sizes=[*over_arch, 1], dense_device=dense_device)


def make_planner(table_names: Sequence[str], sharding_types: Sequence[str], device_type: str,
                 world_size: int, local_world_size: int, batch_size: int):
    """The job's ``EmbeddingShardingPlanner``: the ``fused`` compute kernel only, ``sharding_types``
    as allowed, for ``world_size`` ranks of ``device_type`` at ``batch_size`` rows per rank."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    constraints = {t: ParameterConstraints(sharding_types=list(sharding_types), compute_kernels=["fused"])
                   for t in table_names}
    return EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device_type,
                          local_world_size=local_world_size),
        batch_size=batch_size, constraints=constraints, debug=False)


def shard(model: nn.Module, table_names: Sequence[str], sharders: list, device: torch.device,
          sharding_types: Sequence[str], world_size: int, local_world_size: int, batch_size: int):
    """Plan (:func:`make_planner`, collectively: rank 0 plans for all) and wrap in DMP.

    Returns ``(dmp_model, plan)``.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel

    planner = make_planner(table_names, sharding_types, device.type, world_size, local_world_size,
                           batch_size)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    return dmp, plan


def plan_summary(plan: Any) -> dict:
    """``{table: "sharding_type/compute_kernel ranks [...]"}`` from a ShardingPlan."""
    out = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = f"{ps.sharding_type}/{ps.compute_kernel} ranks {ps.ranks}"
    return out


def build_optimizer(dmp: nn.Module, name: str, lr: float):
    """``CombinedOptimizer([dmp.fused_optimizer, dense])``; the dense part (MLPs) uses ``name``
    (adagrad / adam / sgd) through ``KeyedOptimizerWrapper``; embedding tables are updated in backward
    by the fused optimizer."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    cls = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: cls(params, lr=lr))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def compile_dense(model: nn.Module) -> None:
    """``nn.Module.compile()`` (in place, same parameter names) on the DLRM's ``dense_arch``,
    ``inter_arch`` and ``over_arch``; the sharded embedding module stays eager (TorchRec's train
    pipelines rewrite its forward)."""
    for name in ("dense_arch", "inter_arch", "over_arch"):
        getattr(model, name).compile(dynamic=False)
