"""Everything that touches TorchRec / FBGEMM: the patch list (:mod:`.patches`), lookup routing
(:mod:`.routing`), TorchRec kernel wrappers (:mod:`.compute_kernels`), sharders (:mod:`.sharders`), the
planner's storage estimator (:mod:`.planner`), and the paths that move or sync optimizer state:
dynamic sharding (:mod:`.resharding`), 2D parallel's replica sync (:mod:`.replica_sync`) and the model
delta tracker's modes (:mod:`.delta_tracker`). The core package never imports this subpackage.
"""

from .patches import PATCHES, install, installed, uninstall  # noqa: F401
from .planner import FTRLEnumerator, FTRLStorageEstimator, ftrl_planner  # noqa: F401
from .sharders import FTRLEmbeddingBagCollectionSharder, FTRLEmbeddingCollectionSharder, sharders  # noqa: F401
