"""Pieces of the CTR training job (examples/train_ctr.py): one module per job.

``cli`` (flags, fused_params), ``dist_env`` (process group, device), ``model`` (DLRM, planner, DMP,
optimizers), ``data`` (flags -> data source), ``evaluate`` (validation AUC / log loss), ``sparsity``
(per-table zero shares over local shards), ``checkpoint`` (atomic DCP save / resume), ``report``
(summary JSON and PNG).
"""
