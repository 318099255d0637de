"""Everything that touches TorchRec / FBGEMM: the patch list (:mod:`.patches`), lookup routing
(:mod:`.routing`), TorchRec kernel wrappers (:mod:`.kernels`), sharders (:mod:`.sharders`) and the
planner's storage estimator (:mod:`.planner`). The core package never imports this subpackage.
"""

from .patches import PATCHES, install, installed, uninstall  # noqa: F401
from .planner import FTRLEnumerator, FTRLStorageEstimator, ftrl_planner  # noqa: F401
from .sharders import FTRLEmbeddingBagCollectionSharder, FTRLEmbeddingCollectionSharder, sharders  # noqa: F401
