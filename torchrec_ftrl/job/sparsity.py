"""Per-table sparsity of sharded embedding weights: share of exactly-zero weights and of all-zero rows.

Counts come from each rank's local shards (``ShardedTensor.local_shards()``) and are summed with one
``all_reduce``; ``ShardedTensor.gather`` is never called (it can hang for a table on one rank). For a
table split by columns, a row is all-zero only when it is zero in every column shard, so those tables
all_reduce a per-row count of non-zero shards.
"""

from __future__ import annotations

import itertools
import re
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist


def natural_key(name: str) -> list:
    """``t_C2`` before ``t_C10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _tables(state_dict: dict) -> Dict[str, object]:
    out = {}
    for key, v in state_dict.items():
        parts = key.split(".")
        if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] == "embedding_bags":
            out[parts[-2]] = v
    return out


class TouchTracker:
    """Which rows the training data has looked up, per table: one flat ``bool`` mask over the rows of
    all tables, on ``device`` (the training device, so that marking a batch launches a few device ops
    and never waits for them).

    ``update(kjt)`` marks this rank's ids; ``reduce()`` (a collective) ORs the masks of all ranks;
    ``masks`` is ``{table: bool [num_embeddings]}`` on the CPU (a copy). Under FTRL a touched row is
    recomputed from its (accum, linear) state, an untouched one keeps its random initial value, so
    sparsity among touched rows is the figure that says what L1 did.
    """

    def __init__(self, features, sizes, device: torch.device = torch.device("cpu")) -> None:
        self.device = torch.device(device)
        self.features = [str(f) for f in features]
        self.sizes = [int(n) for n in sizes]
        self._base = dict(zip(self.features, [0, *itertools.accumulate(self.sizes)]))
        self._flat = torch.zeros(sum(self.sizes), dtype=torch.bool, device=self.device)
        self._bases = {}   # keys -> int64 [F] first flat row of each key's table, on the device

    def update(self, kjt) -> None:
        """Mark the ids of ``kjt`` (a KJT whose keys are tracked features, values int64 row ids, on the
        CPU, pinned for an asynchronous copy when the tracker is on a GPU)."""
        keys = tuple(kjt.keys())
        n = kjt.values().numel()
        if n == 0:
            return
        if keys not in self._bases:
            self._bases[keys] = torch.tensor([self._base[k] for k in keys], dtype=torch.int64,
                                             device=self.device)
        cuda = self.device.type == "cuda"
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        if cuda:
            per_key = per_key.pin_memory()
        per_key = per_key.to(self.device, non_blocking=True)
        values = kjt.values().to(self.device, non_blocking=True)
        rows = values + torch.repeat_interleave(self._bases[keys], per_key, output_size=n)
        self._flat.index_fill_(0, rows, True)

    @property
    def masks(self) -> Dict[str, torch.Tensor]:
        flat = self._flat.cpu()
        return {f"t_{f}": flat[self._base[f]:self._base[f] + n].clone()
                for f, n in zip(self.features, self.sizes)}

    def reduce(self, device: torch.device) -> None:
        """OR the masks of all ranks (every rank calls it); ``device``: where the collective runs."""
        if not (dist.is_initialized() and dist.get_world_size() > 1) or not self.sizes:
            return
        flat = self._flat.to(device=device, dtype=torch.uint8)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        self._flat = flat.to(device=self.device, dtype=torch.bool)

    def state_dict(self) -> dict:
        return {n: m.to(torch.uint8) for n, m in self.masks.items()}

    def load_state_dict(self, state: dict) -> None:
        for f, n in zip(self.features, self.sizes):
            self._flat[self._base[f]:self._base[f] + n] = state[f"t_{f}"].to(torch.bool)


_CHUNK_ELEMENTS = 1 << 27


@torch.no_grad()
def table_sparsity(model: torch.nn.Module, device: torch.device,
                   touched: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, dict]:
    """``{table: {"rows", "dim", "zero_weights", "zero_rows", "zero_weight_share", "zero_row_share"}}``
    plus, with ``touched`` (global ``bool [rows]`` per table, identical on every rank),
    ``"touched_rows", "zero_weights_touched", "zero_rows_touched", "zero_weight_share_touched",
    "zero_row_share_touched"`` (shares of the touched rows / their weights). The same on every rank
    (a collective: every rank must call it)."""
    tables = _tables(model.state_dict())
    names = sorted(tables, key=natural_key)
    counts = _ZeroCounts(len(names), touched, device)
    shapes = [counts.count_table(i, name, tables[name]) for i, name in enumerate(names)]
    counts.all_reduce()
    return {name: counts.record(i, name, rows, dim)
            for i, (name, (rows, dim)) in enumerate(zip(names, shapes))}


class _ZeroCounts:
    """Counts of zero weights and zero rows of the tables, this rank's shards first, then summed
    over the ranks (:meth:`all_reduce`).

    ``scalars``: int64 ``[4 * tables]`` on ``device``, per table i at ``4 * i``: zero weights, zero
    rows, zero weights in touched rows, zero rows among touched rows. A table split by columns keeps
    instead of its zero rows ``row_vectors[name]``: int32 ``[rows]``, the number of column shards in
    which each row has a non-zero weight (a row is all-zero when that is 0 after the sum).
    """

    def __init__(self, num_tables: int, touched: Optional[Dict[str, torch.Tensor]],
                 device: torch.device) -> None:
        self.touched = touched
        self.device = device
        self.scalars = torch.zeros(4 * num_tables, dtype=torch.int64, device=device)
        self.row_vectors: Dict[str, torch.Tensor] = {}

    def count_table(self, i: int, name: str, v) -> Tuple[int, int]:
        """Count table ``i`` (``name``, its weight ``v``: a ShardedTensor, else replicated or
        unsharded and counted once, on rank 0); returns its ``(rows, dim)``."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if isinstance(v, ShardedTensor):
            rows, dim = v.size()
            full_width = all(m.shard_sizes[1] == dim for m in v.metadata().shards_metadata)
            if not full_width:
                self.row_vectors[name] = torch.zeros(rows, dtype=torch.int32, device=self.device)
            for shard in v.local_shards():
                self._count(i, shard.tensor, shard.metadata.shard_offsets[0], full_width, name)
        else:  # replicated (data-parallel) or unsharded: count once, on rank 0
            t = v.to_local() if hasattr(v, "to_local") else v
            rows, dim = t.shape
            if (dist.get_rank() if dist.is_initialized() else 0) == 0:
                self._count(i, t, 0, True, name)
        return int(rows), int(dim)

    def _count(self, i: int, t: torch.Tensor, r0: int, full_width: bool, name: str) -> None:
        """Count the block ``t`` (rows ``r0..`` of table ``i``) in row chunks of at most
        ``_CHUNK_ELEMENTS`` elements: a 40M x 128 shard's comparison and sum would otherwise take
        tens of GB beside the tables."""
        step = max(1, _CHUNK_ELEMENTS // max(1, t.shape[1]))
        for s in range(0, t.shape[0], step):
            self._count_rows(i, t[s:s + step], r0 + s, full_width, name)

    def _count_rows(self, i: int, t: torch.Tensor, r0: int, full_width: bool, name: str) -> None:
        z = t == 0
        nz_rows = (~z).any(dim=1)
        touched = self.touched
        tm = touched[name][r0:r0 + t.shape[0]].to(t.device) if touched is not None else None
        self.scalars[4 * i] += int(z.sum())
        if tm is not None:
            self.scalars[4 * i + 2] += int(z[tm].sum())
        if full_width:
            self.scalars[4 * i + 1] += int((~nz_rows).sum())
            if tm is not None:
                self.scalars[4 * i + 3] += int((~nz_rows & tm).sum())
        else:
            self.row_vectors[name][r0:r0 + t.shape[0]] += nz_rows.to(torch.int32)

    def all_reduce(self) -> None:
        """Sum the counts over the ranks (a collective; nothing to do in a one-rank run)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world <= 1:
            return
        dist.all_reduce(self.scalars)
        if self.row_vectors:
            flat = torch.cat([self.row_vectors[n] for n in sorted(self.row_vectors)])
            dist.all_reduce(flat)
            off = 0
            for n in sorted(self.row_vectors):
                k = self.row_vectors[n].numel()
                self.row_vectors[n] = flat[off:off + k]
                off += k

    def record(self, i: int, name: str, rows: int, dim: int) -> dict:
        """Table ``i``'s entry of :func:`table_sparsity` (after :meth:`all_reduce`)."""
        scalars, touched = self.scalars, self.touched
        zw = int(scalars[4 * i])
        if name in self.row_vectors:
            zero_row = (self.row_vectors[name] == 0).cpu()
            zr = int(zero_row.sum())
            zrt = int((zero_row & touched[name]).sum()) if touched is not None else 0
        else:
            zr, zrt = int(scalars[4 * i + 1]), int(scalars[4 * i + 3])
        rec = {"rows": rows, "dim": dim, "zero_weights": zw, "zero_rows": zr,
               "zero_weight_share": zw / (rows * dim), "zero_row_share": zr / rows}
        if touched is not None:
            nt = int(touched[name].sum())
            zwt = int(scalars[4 * i + 2])
            rec.update({"touched_rows": nt, "zero_weights_touched": zwt, "zero_rows_touched": zrt,
                        "zero_weight_share_touched": zwt / (nt * dim) if nt else float("nan"),
                        "zero_row_share_touched": zrt / nt if nt else float("nan")})
        return rec


def overall(sp: Dict[str, dict]) -> dict:
    """Totals over all tables: shares of zero weights and zero rows (and among touched rows)."""
    w = sum(t["rows"] * t["dim"] for t in sp.values())
    r = sum(t["rows"] for t in sp.values())
    out = {"zero_weight_share": sum(t["zero_weights"] for t in sp.values()) / max(w, 1),
           "zero_row_share": sum(t["zero_rows"] for t in sp.values()) / max(r, 1),
           "weights": w, "rows": r}
    if sp and all("touched_rows" in t for t in sp.values()):
        tr = sum(t["touched_rows"] for t in sp.values())
        tw = sum(t["touched_rows"] * t["dim"] for t in sp.values())
        out.update({"touched_rows": tr,
                    "zero_weight_share_touched": sum(t["zero_weights_touched"] for t in sp.values()) / max(tw, 1),
                    "zero_row_share_touched": sum(t["zero_rows_touched"] for t in sp.values()) / max(tr, 1)})
    return out
