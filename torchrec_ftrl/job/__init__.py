"""The CTR training job (``python -m torchrec_ftrl.job``, the torchx component
``torchrec_ftrl/components.py:train_ctr``, ``examples/train_ctr.py``): one module per job.

``cli`` (flags, fused_params), ``validate`` (the whole configuration, before any work), ``errors``
(the one-line ``train_ctr: error:`` form), ``torchrun`` (torchrun as the torchx component runs it),
``dist_env`` (process group, device), ``model`` (DLRM, planner, DMP,
optimizers), ``source`` (flags -> data source), ``evaluate`` (validation AUC / log loss), ``sparsity``
(per-table zero shares over local shards), ``checkpoint`` (atomic DCP save / resume), ``report``
(summary JSON and PNG), ``faults`` (the ``TORCHREC_FTRL_FAULT`` hook of the reliability tests),
``pipeline`` (one training step: TorchRec's ``TrainPipelineSparseDist`` or the plain loop),
``profile`` (``--profile-steps``: the per-phase step profile), ``extra`` (the ``[job]`` extra's
packages, checked before the job starts) and ``train`` (the training loop, ``main(argv=None)``).

The job is built on the library (``torchrec_ftrl``, ``torchrec_ftrl.data``); the library never
imports it. Importing this package imports none of its modules.
"""
