#!/usr/bin/env python3
"""Train a DLRM CTR model whose 26 (or any number of) embedding tables use a fused sparse optimizer
(FTRL-Proximal from torchrec_ftrl by default, or stock row-wise Adagrad), sharded with TorchRec's
DistributedModelParallel.

One process:  python examples/train_ctr.py                 (gloo, world size 1, synthetic data)
Several:      torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2 [-- FLAGS]
Real data:    python examples/train_ctr.py --data DATA/criteo/criteo_dac_combined.tsv

Prints a tqdm bar on rank 0 (step, loss, examples/s), validation AUC / log loss every --eval-every
steps, and at the end writes ``<output-dir>/<run-name>_summary.json`` and ``<run-name>.png``.

The job itself is the installed module ``torchrec_ftrl.job`` (``python -m torchrec_ftrl.job [FLAGS]``
is the same); this script only calls ``torchrec_ftrl.job.train.main()``.
"""

from torchrec_ftrl.job.extra import require_job_extra

if __name__ == "__main__":
    require_job_extra()
    from torchrec_ftrl.job.train import main

    main()
