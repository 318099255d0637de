"""The FBGEMM enums the core uses, from the modules where fbgemm_gpu 1.6 and 1.8 both define them."""

from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: F401
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: F401
    BoundsCheckMode,
    CacheAlgorithm,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice  # noqa: F401
