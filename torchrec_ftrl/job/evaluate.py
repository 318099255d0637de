"""Validation: forward every rank's padded batches, all_gather, exact AUC and log loss on all ranks."""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """``{"auc", "logloss", "ne", "ctr", "rows"}`` for ``logits [N]`` and 0/1 ``labels [N]``.

    AUC: torchmetrics ``binary_auroc`` (exact, no thresholds); logloss: mean binary cross-entropy
    (natural log); NE: logloss divided by the entropy of the empirical CTR (He et al. 2014);
    AUC is NaN when only one class is present.
    """
    from torchmetrics.functional.classification import binary_auroc

    logits, labels = logits.double().cpu(), labels.double().cpu()
    n = labels.numel()
    ctr = float(labels.mean()) if n else float("nan")
    ll = float(F.binary_cross_entropy_with_logits(logits, labels)) if n else float("nan")
    both = 0.0 < ctr < 1.0
    auc = float(binary_auroc(torch.sigmoid(logits), labels.long())) if both else float("nan")
    h = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)) if both else float("nan")
    return {"auc": auc, "logloss": ll, "ne": ll / h if both else float("nan"), "ctr": ctr, "rows": n}


@torch.no_grad()
def validate(model: torch.nn.Module, batches: List[Tuple[object, int]], device: torch.device) -> dict:
    """Metrics over the union of every rank's validation rows (padding rows dropped).

    ``model(batch)`` returns ``(loss, (loss, logits [B], labels [B]))`` (``model.CTRTrain`` under
    DMP); it runs in eval mode and is put back in its previous mode. Under a train pipeline, detach
    the model from the pipeline first (its sharded modules' forward reads the pipeline's batches).
    ``batches``: ``[(Batch, n_real)]`` with the same length and batch size on every rank (DMP's
    all-to-all needs it). A collective: every rank must call it.
    """
    was_training = model.training
    model.eval()
    logits, labels, mask = [], [], []
    for batch, n_real in batches:
        b = batch.to(device)
        _, (_, out, _) = model(b)
        out = out.reshape(-1)
        logits.append(out.float())
        labels.append(b.labels.float())
        mask.append(torch.arange(out.numel(), device=device) < n_real)
    if was_training:
        model.train()
    local = torch.stack([torch.cat(logits), torch.cat(labels), torch.cat(mask).float()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        local = torch.cat(parts, dim=1)
    keep = local[2] > 0.5
    return binary_metrics(local[0][keep], local[1][keep])
