"""End-of-run outputs: ``<run>_summary.json`` and ``<run>.png`` (loss / AUC curves, per-table sparsity)."""

from __future__ import annotations

import json
import math
import os


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_summary(path: str, summary: dict) -> None:
    """JSON (NaN/inf written as null), written to ``path + ".tmp"`` then renamed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(_clean(summary), f, indent=2, default=str)
    os.replace(path + ".tmp", path)


def plot(path: str, loss_history: list, val_history: list, sparsity: dict, title: str) -> None:
    """Three panels: train loss (and validation log loss) vs step; validation AUC vs step; per-table
    shares of zero weights and zero rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 4.5))
    if loss_history:
        s, l = zip(*loss_history)
        ax[0].plot(s, l, label="train loss (mean over ranks)")
    if val_history:
        ax[0].plot([v["step"] for v in val_history], [v["logloss"] for v in val_history], "o-",
                   label="validation log loss")
        ax[1].plot([v["step"] for v in val_history], [v["auc"] for v in val_history], "o-", color="C2")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("BCE"); ax[0].legend(); ax[0].grid(alpha=.3)
    ax[1].set_xlabel("step"); ax[1].set_ylabel("validation AUC"); ax[1].grid(alpha=.3)
    names = list(sparsity)  # table order (natural sort), as table_sparsity returns it
    x = range(len(names))
    ax[2].bar([i - 0.2 for i in x], [sparsity[n]["zero_weight_share"] for n in names], 0.4,
              label="zero weights")
    ax[2].bar([i + 0.2 for i in x], [sparsity[n]["zero_row_share"] for n in names], 0.4,
              label="all-zero rows")
    ax[2].set_xticks(list(x)); ax[2].set_xticklabels([n.removeprefix("t_") for n in names],
                                                       rotation=90, fontsize=7)
    ax[2].set_ylim(0, 1); ax[2].set_ylabel("share"); ax[2].legend(); ax[2].set_title("per-table sparsity")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
