"""TorchRec embedding kernels that hold the fused FTRL TBE, as ``BatchedFusedEmbeddingBag`` /
``BatchedFusedEmbedding`` hold FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``.

They inherit TorchRec's fused-kernel behaviour (state_dict as ShardedTensors, ``fused_optimizer``,
``named_parameters`` with ``EmptyFusedOptimizer``) and only replace the TBE they build. The fused
optimizer exposes FTRL states under TensorFlow's slot names: ``{table}.accum`` and ``{table}.linear``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_sparse_type
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..fbgemm_enums import BoundsCheckMode, PoolingMode
from ..hyperparams import parse_options
from ..tbe import FTRLTableBatchedEmbeddingBags

# fused_params keys our TBE understands besides learning_rate and the ftrl_* knobs.
_PASSED_THROUGH = ("output_dtype", "bounds_check_mode")


def tbe_kwargs_from_fused_params(fused_params: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Constructor kwargs of :class:`FTRLTableBatchedEmbeddingBags` from a TorchRec ``fused_params``.

    Keeps ``learning_rate`` (or ``lr``), the ``ftrl_*`` knobs, ``output_dtype`` and ``bounds_check_mode``
    (default ``BoundsCheckMode.WARNING``, FBGEMM's default for stock tables); drops FBGEMM-only keys
    (``optimizer``, ``cache_precision``, ``stochastic_rounding``, ...).

    Raises:
        ValueError: an unknown ``ftrl_*`` key (a misspelling would otherwise be ignored silently),
            ``lr`` and ``learning_rate`` that differ, or an invalid knob (naming it and its value).
    """
    fp = dict(fused_params or {})
    kwargs: dict[str, Any] = parse_options(fp, where="fused_params").to_options()
    kwargs.update({k: fp[k] for k in _PASSED_THROUGH if k in fp and fp[k] is not None})
    # Under TorchRec, FBGEMM's default (WARNING: repair + count, no host sync) as for stock tables.
    kwargs.setdefault("bounds_check_mode", BoundsCheckMode.WARNING)
    return kwargs


class FTRLEmbeddingFusedOptimizer(EmbeddingFusedOptimizer):
    """TorchRec's ``EmbeddingFusedOptimizer`` over the FTRL TBE, with the first state named ``accum``
    (TorchRec names a table's first state ``momentum1`` whatever the TBE calls it)."""

    def __init__(self, config: GroupedEmbeddingConfig, emb_module: FTRLTableBatchedEmbeddingBags,
                 pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(config, emb_module, pg)
        for param, param_state in list(self.state.items()):
            self.state[param] = {
                (k[: -len("momentum1")] + "accum" if k.endswith(".momentum1") else k): v
                for k, v in param_state.items()}


def _build_tbe(kernel, config: GroupedEmbeddingConfig, device, pooling) -> FTRLTableBatchedEmbeddingBags:
    return FTRLTableBatchedEmbeddingBags(
        embedding_specs=list(zip(kernel._local_rows, kernel._local_cols)),
        feature_table_map=kernel._feature_table_map,
        pooling_mode=pooling,
        weights_precision=data_type_to_sparse_type(config.data_type),
        device=device,
        table_names=[t.name for t in config.embedding_tables],
        **tbe_kwargs_from_fused_params(config.fused_params),
    )


class FTRLBatchedFusedEmbeddingBag(BatchedFusedEmbeddingBag):
    """Pooled (EmbeddingBagCollection) kernel: one FTRL TBE for a group of FTRL tables on this rank."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None,
                 env: Optional[ShardingEnv] = None) -> None:
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        self._emb_module = _build_tbe(self, config, device, self._pooling)
        self._optim = FTRLEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    def forward(self, features: KeyedJaggedTensor, vbe_output: Optional[torch.Tensor] = None,
                vbe_output_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        kwargs: dict[str, Any] = {}
        if features.variable_stride_per_key():
            kwargs["batch_size_per_feature_per_rank"] = features.stride_per_key_per_rank()
        out = self._emb_module(indices=features.values(), offsets=features.offsets(),
                               per_sample_weights=weights, **kwargs)
        if vbe_output is not None:
            raise ValueError("vbe_output (a preallocated VBE output) is not supported by the FTRL kernel")
        return out


class FTRLBatchedFusedEmbedding(BatchedFusedEmbedding):
    """Sequence (EmbeddingCollection) kernel: the FTRL TBE with ``PoolingMode.NONE``."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, env: Optional[ShardingEnv] = None,
                 **_: Any) -> None:
        BaseBatchedEmbedding.__init__(self, config, pg, device)
        self._emb_module = _build_tbe(self, config, device, PoolingMode.NONE)
        self._optim = FTRLEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()
