"""torchrec-ftrl: fused FTRL-Proximal for TorchRec sharded embedding tables, on stock wheels.

``import torchrec_ftrl`` checks the torchrec version (1.6.x-1.8.x) and registers ``EmbOptimType.FTRL``,
``torchrec.optim.FTRL``, the lookup routing to the fused FTRL TBE and the planner's 2 x D state count
(see :mod:`torchrec_ftrl.registration`).
"""

import torchrec as _torchrec

from .compat import check_torchrec_version as _check_torchrec_version

_check_torchrec_version(getattr(_torchrec, "__version__", ""))

from .hyperparams import FTRLHyperparams  # noqa: E402
from .optim import FTRL, ftrl  # noqa: E402
from .registration import register as _register  # noqa: E402
from .tbe import FTRLTableBatchedEmbeddingBags  # noqa: E402

_register()

from .distributed import sharders  # noqa: E402

__version__ = "0.1.0"
__all__ = ["FTRL", "FTRLHyperparams", "FTRLTableBatchedEmbeddingBags", "ftrl", "sharders"]
