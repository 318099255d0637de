"""``python -m torchrec_ftrl.kernels.codegen --write | --check`` (:func:`torchrec_ftrl.kernels.codegen.main`)."""

import sys

from . import main

sys.exit(main())
