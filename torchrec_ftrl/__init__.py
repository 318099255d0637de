"""torchrec-ftrl: fused FTRL-Proximal for TorchRec sharded embedding tables on stock wheels."""

from .hyperparams import FTRLHyperparams
from .optim import FTRL, ftrl

__version__ = "0.1.0"
__all__ = ["FTRL", "FTRLHyperparams", "ftrl"]
from .tbe import FTRLTableBatchedEmbeddingBags  # noqa: E402
from .registration import register as _register  # noqa: E402

_register()

from .distributed import sharders  # noqa: E402

__all__ += ["FTRLTableBatchedEmbeddingBags", "sharders"]
