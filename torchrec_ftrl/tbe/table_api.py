"""The work behind FBGEMM's table API of the FTRL TBE (``split_optimizer_states``, ``load_weights``,
derived weights) and the hooks TorchRec calls on it (``reset_embedding_weight_momentum``), on the
tables' flat buffers by their row layout (:class:`~torchrec_ftrl.row_layout.RowLayout`). The TBE's
public methods (:class:`~.module.FTRLTableBatchedEmbeddingBags`) hold the docstrings and call these."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..hyperparams import FTRLHyperparams
from ..row_layout import RowLayout
from ..rule import ftrl_encode, ftrl_prox
from .args import _check_int_vector, _short
from .derived_weight import CHUNK_ROWS
from .tables import TableGeometry


# What a loaded tensor may hold, by the slot it fills: the float arrays (finite; ``accum`` also >= 0)
# and the int64 counters (``iter``, ``bounds_check_warning``, ``nonfinite_grad_rows``: integers >= 0).
FLOAT_SLOTS = ("weight", "accum", "linear")
COUNTER = "counter"
# The fused optimizer's state key of a table's step counter (the TBE's ``iter``): "{table}.step".
STEP_KEY = "step"


def value_problem(value: Any, slot: str, dtype: torch.dtype) -> Optional[str]:
    """Why ``value`` cannot be loaded into a tensor of ``dtype`` holding FTRL's ``slot`` (one of
    :data:`FLOAT_SLOTS` or :data:`COUNTER`), or None when it can: not a tensor, a meta tensor (no
    values), a dtype that does not cast to ``dtype`` without loss of kind (complex, bool; a float into
    a counter), NaN or Inf (also after rounding to ``dtype``), a negative ``accum`` or counter. One
    pass over ``value`` (``aminmax``: no copy of it).

    Returns:
        a phrase naming the problem and the offending value, for a message that names the key.
    """
    if not isinstance(value, torch.Tensor):
        return f"is not a tensor (got {type(value).__name__})"
    if value.is_meta:
        return "is a meta tensor (it holds no values)"
    if value.is_complex() or value.dtype == torch.bool:
        return f"has dtype {value.dtype}, which does not cast to {dtype}"
    if slot == COUNTER and value.is_floating_point():
        return f"has dtype {value.dtype}; a counter takes an integer dtype ({dtype})"
    if value.numel() == 0:
        return None
    try:
        lo, hi = (v.item() for v in torch.aminmax(value.detach().reshape(-1)))   # NaN propagates to both
    except (NotImplementedError, RuntimeError):   # e.g. uint32 / uint64, which aminmax does not take
        return f"has dtype {value.dtype}, which this TBE does not load"
    if lo != lo or hi != hi:
        return "holds NaN"
    limit = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    if max(-lo, hi) > limit:
        bad = lo if -lo > hi else hi
        return (f"holds {bad!r}, which is not finite in {dtype}" if dtype.is_floating_point
                else f"holds {bad!r}, beyond {dtype}'s range")
    if slot == COUNTER and lo < 0:
        return f"holds {int(lo)}; a counter is >= 0"
    if slot == "accum" and lo < 0:
        return f"holds {lo!r}; an accum is >= 0"
    return None


def check_loaded(own: dict[str, torch.Tensor], slots: dict[str, str], state_dict, prefix: str,
                 strict: Optional[bool], children: frozenset = frozenset(), assign: bool = False) -> bool:
    """Check every entry ``nn.Module.load_state_dict`` would copy into a TBE's persistent tensors
    ``own`` (``{name: tensor}``; ``slots``: the slot of each, :func:`value_problem`, default
    ``"weight"``) from ``state_dict`` (keys ``prefix + name``), before any is copied. ``strict``:
    the TBE's own ``load_state_dict``'s, or None when a parent module's load reaches the TBE
    (torch does not tell a module's ``_load_from_state_dict`` its caller's ``strict``);
    ``children``: the names of the TBE's submodules, whose keys are theirs to check. ``assign``
    (``load_state_dict(assign=True)``, which keeps the given tensors as the buffers): each must also
    have the buffer's dtype and device and be contiguous, as the kernels take them.

    Returns:
        whether to load: False when ``state_dict`` holds none of the keys under ``strict`` None
        (a parent's state dict without this TBE: torch reports them as missing).

    Raises:
        ValueError: a key missing or unexpected under ``strict`` (or, under None, some keys present
            and others missing); a value that is not a tensor of the tensor's shape; a value
            :func:`value_problem` refuses. The message names the key and the problem.
    """
    missing = [prefix + name for name in own if prefix + name not in state_dict]
    if missing and (strict or (strict is None and len(missing) < len(own))):
        raise ValueError(f"load_state_dict: the state dict has no {missing[0]!r}"
                         f"{' (strict=True)' if strict else ''}; this TBE's buffers are unchanged"
                         f"{'' if strict else ' (a partial state of this TBE loads through its own load_state_dict(strict=False))'}")
    if missing and strict is None:
        return False
    unexpected = [key for key in state_dict if key.startswith(prefix) and key[len(prefix):] not in own
                  and key[len(prefix):].split(".", 1)[0] not in children]
    if unexpected and strict:
        raise ValueError(f"load_state_dict: unexpected key {unexpected[0]!r} in the state dict "
                         "(strict=True); this TBE's buffers are unchanged")
    for name, tensor in own.items():
        key = prefix + name
        if key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, but this TBE's "
                             f"{name} has shape {tuple(tensor.shape)}; this TBE's buffers are unchanged")
        problem = value_problem(value, slots.get(name, "weight"), tensor.dtype)
        if problem is None and assign and (value.dtype != tensor.dtype or value.device != tensor.device
                                           or not value.is_contiguous()):
            problem = (f"is a {value.dtype} tensor on {value.device} (contiguous={value.is_contiguous()}); "
                       f"load_state_dict(assign=True) keeps it as the buffer, which must be a contiguous "
                       f"{tensor.dtype} tensor on {tensor.device}")
        if problem is not None:
            raise ValueError(f"load_state_dict: {key!r} {problem}; this TBE's buffers are unchanged")
    return True


class FTRLOptimizerState(dict):
    """One table's ``{"accum": ..., "linear": ...}``. A missing key (e.g. row-wise Adagrad's ``"sum"``,
    which TorchRec's ``sync_hash_zch_weights`` reads) raises a ``KeyError`` naming FTRL's states."""

    def __missing__(self, key):
        raise KeyError(f"{key!r}: the FTRL optimizer state of a table has 'accum' and 'linear' only "
                       f"(FTRL recomputes the weight from both, so one state alone cannot be synced "
                       f"or averaged)")


class TableStates:
    """The weight and state arrays of one TBE's tables (``geometry``) stored by ``layout``; every
    method takes the flat buffers it reads or writes."""

    def __init__(self, geometry: TableGeometry, layout: RowLayout) -> None:
        self.geometry = geometry
        self.layout = layout

    def optimizer_states(self, accum: torch.Tensor, linear: torch.Tensor) -> list[tuple]:
        """Per-table ``(accum, linear)`` views (see the TBE's ``split_optimizer_states``)."""
        g = self.geometry
        return [(g.accum_view(accum, self.layout, t), g.table_view(linear, t)) for t in range(g.num_tables)]

    def prox(self, accum: torch.Tensor, linear: torch.Tensor, hp: FTRLHyperparams, t: int,
             rows: torch.Tensor | slice) -> torch.Tensor:
        """fp32 ``prox(linear, accum)`` of table ``t``'s ``rows``: their weights by the knobs ``hp``."""
        g = self.geometry
        return ftrl_prox(g.table_view(linear, t)[rows], g.accum_rows(accum, self.layout, t, rows), hp).float()

    def check_load(self, t, weights, row_start, row_ids, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor | slice:
        """The rows ``load_weights`` writes (a slice, or int64 ids on ``device``), after checking every
        argument; ``dtype``: what the weights are stored (or encoded) in, where they must be finite.

        Raises:
            ValueError: naming the argument and the value (see the TBE's ``load_weights``).
        """
        where, g = "load_weights", self.geometry
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < g.num_tables:
            raise ValueError(f"{where}: t must be a table id in [0, {g.num_tables}), got {t!r}")
        rows, dim, name = g.rows[t], g.dims[t], g.names[t]
        ok = isinstance(weights, torch.Tensor) and weights.dim() == 2 and weights.shape[1] == dim
        if not ok or not weights.is_floating_point():
            shape = (f"{list(weights.shape)} {weights.dtype}" if isinstance(weights, torch.Tensor)
                     else type(weights).__name__)
            raise ValueError(f"{where}: weights of table {name!r} must be a floating-point "
                             f"[k, {dim}] tensor, got {shape}")
        if weights.is_meta:
            raise ValueError(f"{where}: weights of table {name!r} are a meta tensor (it holds no values)")
        problem = value_problem(weights, "weight", dtype)
        if problem is not None:
            raise ValueError(f"{where}: weights of table {name!r} hold NaN or Inf, or values beyond "
                             f"{dtype}: the tensor {problem}")
        k = weights.shape[0]
        if row_ids is None:
            if isinstance(row_start, bool) or not isinstance(row_start, int) or not 0 <= row_start <= rows - k:
                raise ValueError(f"{where}: row_start must be an int in [0, {rows - k}] for {k} rows of "
                                 f"table {name!r} ({rows} rows), got {row_start!r}")
            return slice(row_start, row_start + k)
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in (torch.int32, torch.int64) \
                or row_ids.shape != (k,):
            got = f"{row_ids.dtype} {list(row_ids.shape)}" if isinstance(row_ids, torch.Tensor) else repr(row_ids)
            raise ValueError(f"{where}: row_ids must be an int64 or int32 tensor of {k} row ids, got {got}")
        ids = row_ids.to(device=device, dtype=torch.int64)
        if bool(((ids < 0) | (ids >= rows)).any()):
            raise ValueError(f"{where}: row_ids must be row ids of table {name!r} in "
                             f"[0, {rows}), got {_short(row_ids.tolist())}")
        return ids

    def encode(self, accum: torch.Tensor, linear: torch.Tensor, hp: FTRLHyperparams, t: int,
               rows_written: torch.Tensor | slice, weights: torch.Tensor, only_changed: bool) -> int:
        """``linear := ftrl_encode(weights, accum)`` of table ``t``'s ``rows_written``, :data:`CHUNK_ROWS`
        rows at a time (rows whose weights are unchanged keep theirs with ``only_changed``); returns
        the number of weights that could not be held. Every chunk is encoded once before any is
        written, so a weight whose ``linear`` would not be finite in ``linear``'s dtype raises with
        nothing written.

        Raises:
            ValueError: such a weight, naming the table and its row among ``weights``.
        """
        dropped = 0
        for write in (False, True):
            for start in range(0, weights.shape[0], CHUNK_ROWS):   # temporaries of one chunk at a time
                if isinstance(rows_written, slice):
                    first = rows_written.start + start
                    sel = slice(first, min(rows_written.stop, first + CHUNK_ROWS))
                else:
                    sel = rows_written[start:start + CHUNK_ROWS]
                chunk = weights[start:start + CHUNK_ROWS]
                if write:
                    dropped += self._encode_chunk(accum, linear, hp, t, sel, chunk, only_changed)
                else:
                    self._check_encodable(accum, linear, hp, t, sel, chunk, start)
        return dropped

    def _check_encodable(self, accum, linear, hp, t, rows, weights, start: int) -> None:
        z = ftrl_encode(weights.to(linear.device), self.geometry.accum_rows(accum, self.layout, t, rows), hp)[0]
        bad = (~torch.isfinite(z.to(linear.dtype))).any(dim=1).nonzero()
        if bad.numel():
            row = start + int(bad[0, 0])
            raise ValueError(f"weights row {row} of table {t}: its linear (prox's inverse) is not finite in "
                             f"{linear.dtype} for these weights (max |w| {float(weights[row - start].abs().max())}); "
                             "nothing was written")

    def _encode_chunk(self, accum, linear, hp, t, rows, weights, only_changed) -> int:
        n = self.geometry.accum_rows(accum, self.layout, t, rows)
        weights = weights.to(linear.device)
        z, dropped = ftrl_encode(weights, n, hp)
        table_linear = self.geometry.table_view(linear, t)
        if only_changed:
            old = table_linear[rows]
            same = (ftrl_prox(old, n, hp) == weights).all(dim=1, keepdim=True)
            z = torch.where(same, old.to(z.dtype), z)
        table_linear[rows] = z.to(table_linear.dtype)
        return dropped

    def reset_rows(self, weights: Optional[torch.Tensor], accum: torch.Tensor, linear: torch.Tensor,
                   n0: float, segments: list[tuple[int, torch.Tensor]]) -> None:
        """FTRL's starting point (weight 0, ``accum`` ``n0``, ``linear`` 0) for each ``(table, rows)``
        of ``segments`` (``weights``: None where derived)."""
        g = self.geometry
        for t, rows in segments:
            if weights is not None:
                g.table_view(weights, t).index_fill_(0, rows, 0.0)
            g.accum_view(accum, self.layout, t).index_fill_(0, rows, n0)
            g.table_view(linear, t).index_fill_(0, rows, 0.0)

    def reset_segments(self, pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids,
                       device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """``(table, int64 rows on device)`` of each non-empty reset segment, after checking every
        argument (see the TBE's ``reset_embedding_weight_momentum``).

        Raises:
            ValueError: naming the argument and the value.
        """
        where = "reset_embedding_weight_momentum"
        args = dict(pruned_indices=pruned_indices, pruned_indices_offsets=pruned_indices_offsets,
                    logical_table_ids=logical_table_ids, buffer_ids=buffer_ids)
        for name, t in args.items():
            _check_int_vector(f"{where}: {name}", t, device, cpu_too=True)
        tables, bufs = logical_table_ids.tolist(), buffer_ids.tolist()
        if len(tables) != len(bufs):
            raise ValueError(f"{where}: logical_table_ids and buffer_ids must have one entry per reset, "
                             f"got {len(tables)} and {len(bufs)} entries")
        if not tables:
            return []
        offs, N = pruned_indices_offsets.tolist(), pruned_indices.numel()
        if not offs or offs[0] < 0 or offs[-1] > N or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"{where}: pruned_indices_offsets must be non-decreasing within [0, "
                             f"pruned_indices.numel()={N}], got {_short(offs)}")
        self._check_segment_ids(where, tables, bufs, len(offs) - 1)
        indices = pruned_indices.to(device).long()
        segments = []
        for k, (f, b) in enumerate(zip(tables, bufs)):
            if offs[b + 1] > offs[b]:
                segments.append(self._segment_rows(where, indices, offs[b], offs[b + 1], f, k, b))
        return segments

    def _check_segment_ids(self, where: str, tables: list, bufs: list, num_segments: int) -> None:
        F = len(self.geometry.feature_table_map)
        for k, (f, b) in enumerate(zip(tables, bufs)):
            if not 0 <= f < F:
                raise ValueError(f"{where}: logical_table_ids[{k}]={f} is not a logical table "
                                 f"(feature) of this TBE, [0, {F})")
            if not 0 <= b < num_segments:
                raise ValueError(f"{where}: buffer_ids[{k}]={b} is not a segment of "
                                 f"pruned_indices_offsets ({num_segments + 1} offsets: [0, {num_segments}))")

    def _segment_rows(self, where, indices, lo, hi, f, k, b) -> tuple[int, torch.Tensor]:
        """``(table, rows)`` of segment ``b`` (reset ``k``, logical table ``f``): ``indices[lo:hi]``.

        Raises:
            ValueError: a row outside its table.
        """
        t = self.geometry.feature_table_map[f]
        rows, n_rows = indices[lo:hi], self.geometry.rows[t]
        bad = (rows < 0) | (rows >= n_rows)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{where}: pruned_indices[{lo + i}]={int(rows[i])} (segment "
                             f"buffer_ids[{k}]={b}) is out of range [0, {n_rows}) of table "
                             f"{self.geometry.names[t]!r} (logical table {f}); {int(bad.sum())} bad "
                             f"index(es)")
        return t, rows
