"""TorchRec glue: kernels holding the FTRL TBE, lookup routing, sharders."""

from .sharders import (  # noqa: F401
    FTRLEmbeddingBagCollectionSharder,
    FTRLEmbeddingCollectionSharder,
    sharders,
)
