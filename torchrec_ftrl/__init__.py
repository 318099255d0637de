"""torchrec-ftrl: fused FTRL-Proximal for TorchRec sharded embedding tables, on stock wheels.

``import torchrec_ftrl`` checks the torchrec version (1.6.x-1.9.x) and installs the integration:
``EmbOptimType.FTRL``, ``torchrec.optim.FTRL``, the lookup routing to the fused FTRL TBE and the
planner's storage estimate (every patch is listed in :mod:`torchrec_ftrl.integration.patches`;
``torchrec_ftrl.integration.uninstall()`` reverses them).
"""

from .hyperparams import FTRLHyperparams
from . import kernels  # noqa: F401  (registers the ops torch.ops.torchrec_ftrl.*)
from .integration import FTRLStorageEstimator, ftrl_planner, install, sharders, uninstall
from .optim import FTRL, ftrl
from .tbe import FTRLTableBatchedEmbeddingBags

install()

__version__ = "0.1.0"
__all__ = ["FTRL", "FTRLHyperparams", "FTRLStorageEstimator", "FTRLTableBatchedEmbeddingBags", "ftrl",
           "ftrl_planner", "install", "sharders", "uninstall"]
