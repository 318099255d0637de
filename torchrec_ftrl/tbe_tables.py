"""FBGEMM's table API of the FTRL TBE (``split_embedding_weights``, ``split_optimizer_states``,
``get_optimizer_state``, learning rate and knobs, ``flush``, initialisation) and the hooks TorchRec
calls on it (``reset_embedding_weight_momentum``, ``uuid``, ``reset_uvm_cache_stats``), by its row
layout (:mod:`torchrec_ftrl.row_layout`). A mixin of :class:`torchrec_ftrl.tbe.FTRLTableBatchedEmbeddingBags`."""

from __future__ import annotations

import uuid as _uuid
from typing import Any, Optional

import torch

from .derived_weight import CHUNK_ROWS, DerivedWeight
from .hyperparams import parse_options
from .row_layout import warn_dropped_weights
from .rule import ftrl_encode, ftrl_prox
from .tbe_args import _check_int_vector, _short


class _FTRLOptimizerState(dict):
    """One table's ``{"accum": ..., "linear": ...}``. A missing key (e.g. row-wise Adagrad's ``"sum"``,
    which TorchRec's ``sync_hash_zch_weights`` reads) raises a ``KeyError`` naming FTRL's states."""

    def __missing__(self, key):
        raise KeyError(f"{key!r}: the FTRL optimizer state of a table has 'accum' and 'linear' only "
                       f"(FTRL recomputes the weight from both, so one state alone cannot be synced "
                       f"or averaged)")


class TableAPIMixin:
    """FBGEMM's table API and TorchRec's hooks (see the module docstring)."""

    def _table_view(self, buf: torch.Tensor, t: int) -> torch.Tensor:
        rows, dim = self.embedding_specs[t][:2]
        off = self.weights_physical_offsets[t]
        return buf[off:off + rows * dim].view(rows, dim)

    def _accum_view(self, t: int) -> torch.Tensor:
        """Table ``t``'s ``accum``: ``[rows, D]``, or ``[rows]`` for a row-wise accumulator."""
        if self.row_layout.accumulator == "elementwise":
            return self._table_view(self.accum_dev, t)
        base = int(self._table_row_base[t])
        return self.accum_dev[base:base + self.embedding_specs[t][0]]

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per-table ``[rows, D]`` weights, in table order (the HBM cache is flushed first): views (not
        copies) of the weight buffer when the row layout stores weights; with derived weights,
        :class:`~torchrec_ftrl.derived_weight.DerivedWeight` tensors, which compute
        ``prox(linear, accum)`` when read and encode what is written into them (:meth:`load_weights`)."""
        self.flush()
        T = len(self.embedding_specs)
        if self.row_layout.weights == "stored":
            return [self._table_view(self.weights_dev, t) for t in range(T)]
        return [DerivedWeight(self, t) for t in range(T)]

    @torch.no_grad()
    def derived_weights(self, t: int, rows: Optional[torch.Tensor | slice] = None) -> torch.Tensor:
        """fp32 ``[len(rows), D]`` (``rows``: int64 row ids or a slice; default every row) weights
        ``prox(linear, accum)`` of table ``t`` with the knobs of now
        (:func:`torchrec_ftrl.rule.ftrl_prox`): the weights the kernels use with derived weights. For a table that stores weights they equal the stored
        ones wherever training wrote them (bitwise for fp32 weights and states). Under
        ``MANAGED_CACHING`` the HBM cache is flushed first if an update wrote it since."""
        self._flush_written()
        rows = slice(None) if rows is None else rows
        return ftrl_prox(self._table_view(self.linear_dev, t)[rows], self._accum_rows(t, rows),
                         self._hp).float()

    def _accum_rows(self, t: int, rows: torch.Tensor | slice) -> torch.Tensor:
        """Table ``t``'s ``accum`` of ``rows``, broadcastable against their ``[k, D]`` ``linear``
        (``[k, 1]`` for a row-wise accumulator)."""
        n = self._accum_view(t)[rows]
        return n.unsqueeze(-1) if self.row_layout.accumulator == "rowwise" else n

    def split_optimizer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-table ``(accum, linear)`` views (not copies) in their stored dtypes (fp32, or bf16 per
        ``optimizer_state_dtypes``): ``linear`` ``[rows, D]``; ``accum`` ``[rows, D]``, or ``[rows]``
        with a row-wise accumulator (1-D, as TorchRec classifies row-wise state). The HBM cache is
        flushed first."""
        self.flush()
        return [(self._accum_view(t), self._table_view(self.linear_dev, t))
                for t in range(len(self.embedding_specs))]

    def get_optimizer_state(self, *args: Any, **kwargs: Any) -> list[dict[str, torch.Tensor]]:
        """Per-table ``{"accum": [rows, D] or [rows], "linear": [rows, D]}`` views in the stored dtypes
        (``optimizer_state_dtypes``; TensorFlow slot names; see :meth:`split_optimizer_states`)."""
        return [_FTRLOptimizerState(accum=a, linear=z) for a, z in self.split_optimizer_states()]

    def get_learning_rate(self) -> float:
        return self._hp.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Raises ValueError (nothing changed) unless ``lr`` is finite and > 0."""
        self._set_hp(self._hp.with_learning_rate(lr))

    def set_optimizer_step(self, step: int) -> None:
        self.iter.fill_(int(step))

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        """Update ``lr``/``learning_rate`` and ``ftrl_*`` knobs atomically: all are validated first.

        Raises:
            ValueError: an unknown key, ``ftrl_initial_accumulator_value`` (it only applies when the
                states are created), or an invalid value; nothing is changed then.
        """
        if "ftrl_initial_accumulator_value" in params_dict:
            raise ValueError("ftrl_initial_accumulator_value only applies when states are created; "
                             "use reset_optimizer_state() after constructing with the new value")
        self._set_hp(parse_options(params_dict, base=self._hp, strict=True, where="update_hyper_parameters"))

    def _set_hp(self, hp) -> None:
        """Take ``hp`` unless it equals the current knobs: the object, and with it the kernels' knob
        tensor, is kept (TorchRec's fused optimizer sets the learning rate at every step)."""
        if hp != self._hp:
            self._hp = hp
            self._warn_if_captured()

    def reset_optimizer_state(self) -> None:
        """accum := initial_accumulator_value (rounded to nearest in a bf16 accum), linear := 0."""
        self.accum_dev.fill_(self._hp.initial_accumulator_value)
        self.linear_dev.zero_()
        if self.cache is not None:
            self.cache.reset_states(self._hp.initial_accumulator_value)

    def _flush_written(self) -> None:
        """:meth:`flush` when the HBM cache holds rows updated since its last flush."""
        if self.cache is not None and self.cache.written:
            self.flush()

    def flush(self) -> None:
        """Write the HBM cache's rows (weights and states) back to unified memory; they stay cached.
        A no-op for the other placements."""
        if self.cache is not None:
            self.cache.flush(self.weights_dev, self.accum_dev, self.linear_dev)

    def reset_cache_states(self) -> None:
        """Empty the HBM cache without writing it back, and forget prefetched batches (after a
        load has replaced the tables). A no-op for the other placements."""
        if self.cache is not None:
            self.cache.reset()
            self._prefetched.clear()

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Weights uniform in ``[min_val, max_val]``; with derived weights, encoded into ``linear``
        (:meth:`load_weights`, which warns once where they cannot be held)."""
        self._init_uniform(min_val, max_val, warn=True)

    @torch.no_grad()
    def _init_uniform(self, min_val: float, max_val: float, warn: bool) -> None:
        if self.row_layout.weights == "stored":
            for w in self.split_embedding_weights():
                w.uniform_(min_val, max_val)
            self.reset_cache_states()
            return
        for t, (rows, dim, *_) in enumerate(self.embedding_specs):
            for start in range(0, rows, CHUNK_ROWS):
                w = torch.empty(min(CHUNK_ROWS, rows - start), dim, device=self.linear_dev.device)
                self.load_weights(t, w.uniform_(min_val, max_val), warn=warn, row_start=start)

    @torch.no_grad()
    def load_weights(self, t: int, weights: torch.Tensor, warn: bool = True, row_start: int = 0,
                     only_changed: bool = False, row_ids: Optional[torch.Tensor] = None) -> None:
        """Set the weights of table ``t``'s rows ``[row_start, row_start + len(weights))`` (or the int64
        row ids ``row_ids``, ``[k]``) to ``weights`` (``[k, D]``, any float dtype; default the whole
        table).

        Under ``MANAGED_CACHING`` the HBM cache is written back first and emptied after (the cached
        copies of the rows written are stale). A stored-weights table copies them. A
        derived-weights table keeps ``accum`` and sets
        ``linear`` to the z with ``prox(z, accum) = w`` (:func:`torchrec_ftrl.rule.ftrl_encode`):
        exact up to rounding where ``q(accum) > 0`` (``accum > 0``, ``ftrl_beta > 0`` or an L2 term;
        with ``ftrl_l1_reg > 0`` a weight small beside ``l1 / q`` keeps fewer bits, and a bf16
        ``linear`` keeps bf16's precision);
        where ``q == 0`` no z gives a non-zero w, so those rows start at w = 0 (what FTRL does at a
        row's first touch anyway) and, with ``warn``, a one-time ``UserWarning`` says how many non-zero
        weights were dropped. With ``only_changed``, rows whose weights equal ``prox(linear, accum)``
        already keep their ``linear`` bit for bit (a checkpoint load that writes the weights after
        the states restores the states). (The constructor's FBGEMM-style uniform initialisation loads without
        the warning: a derived table with ``accum = 0`` and ``ftrl_beta = 0`` starts at w = 0.)

        Raises:
            ValueError: ``t`` not a table of this TBE; ``weights`` not a finite floating-point ``[k, D]``
                tensor; ``row_start`` not an int with the rows inside the table; ``row_ids`` not
                ``k`` int32/int64 row ids of the table. Nothing is changed then.
        """
        rows_written = self._check_load(t, weights, row_start, row_ids)
        if self.row_layout.weights == "stored":
            self.flush()
            self._table_view(self.weights_dev, t)[rows_written] = weights.to(
                device=self.weights_dev.device, dtype=self.weights_dev.dtype)
            self.reset_cache_states()
            return
        self._flush_written()   # the cached rows' accum, and linear for only_changed
        dropped = 0
        for start in range(0, weights.shape[0], CHUNK_ROWS):   # temporaries of one chunk of rows at a time
            sel = (rows_written[start:start + CHUNK_ROWS] if row_ids is not None
                   else slice(row_start + start, min(rows_written.stop, row_start + start + CHUNK_ROWS)))
            dropped += self._encode_rows(t, sel, weights[start:start + CHUNK_ROWS], only_changed)
        self.reset_cache_states()   # the cached copies of the rows written are stale
        if dropped and warn:
            warn_dropped_weights(dropped, self.table_names[t])

    def _check_load(self, t, weights, row_start, row_ids) -> torch.Tensor | slice:
        """The rows :meth:`load_weights` writes (a slice, or int64 ids on the tables' device).

        Raises:
            ValueError: naming the argument and the value (see :meth:`load_weights`).
        """
        where = "load_weights"
        T = len(self.embedding_specs)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < T:
            raise ValueError(f"{where}: t must be a table id in [0, {T}), got {t!r}")
        rows, dim = self.embedding_specs[t][:2]
        ok = isinstance(weights, torch.Tensor) and weights.dim() == 2 and weights.shape[1] == dim
        if not ok or not weights.is_floating_point():
            shape = (f"{list(weights.shape)} {weights.dtype}" if isinstance(weights, torch.Tensor)
                     else type(weights).__name__)
            raise ValueError(f"{where}: weights of table {self.table_names[t]!r} must be a floating-point "
                             f"[k, {dim}] tensor, got {shape}")
        if not bool(torch.isfinite(weights).all()):
            raise ValueError(f"{where}: weights of table {self.table_names[t]!r} hold NaN or Inf")
        k = weights.shape[0]
        if row_ids is None:
            if isinstance(row_start, bool) or not isinstance(row_start, int) or not 0 <= row_start <= rows - k:
                raise ValueError(f"{where}: row_start must be an int in [0, {rows - k}] for {k} rows of "
                                 f"table {self.table_names[t]!r} ({rows} rows), got {row_start!r}")
            return slice(row_start, row_start + k)
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype not in (torch.int32, torch.int64) \
                or row_ids.shape != (k,):
            got = f"{row_ids.dtype} {list(row_ids.shape)}" if isinstance(row_ids, torch.Tensor) else repr(row_ids)
            raise ValueError(f"{where}: row_ids must be an int64 or int32 tensor of {k} row ids, got {got}")
        ids = row_ids.to(device=self.linear_dev.device, dtype=torch.int64)
        if bool(((ids < 0) | (ids >= rows)).any()):
            raise ValueError(f"{where}: row_ids must be row ids of table {self.table_names[t]!r} in "
                             f"[0, {rows}), got {_short(row_ids.tolist())}")
        return ids

    def _encode_rows(self, t: int, rows: torch.Tensor | slice, weights: torch.Tensor,
                     only_changed: bool) -> int:
        """``linear[rows] := ftrl_encode(weights, accum[rows])`` of table ``t`` (rows whose weights
        are unchanged keep theirs with ``only_changed``); returns the weights that could not be held."""
        n = self._accum_rows(t, rows)
        weights = weights.to(self.linear_dev.device)
        z, dropped = ftrl_encode(weights, n, self._hp)
        table_linear = self._table_view(self.linear_dev, t)
        if only_changed:
            linear = table_linear[rows]
            same = (ftrl_prox(linear, n, self._hp) == weights).all(dim=1, keepdim=True)
            z = torch.where(same, linear.to(z.dtype), z)
        table_linear[rows] = z.to(table_linear.dtype)
        return dropped

    # ------------------------------------------------------------------ hooks TorchRec calls
    # (the list, and what each does: docs/managed-collision.md, "TBE hooks TorchRec calls")
    @torch.no_grad()
    def reset_embedding_weight_momentum(self, pruned_indices: torch.Tensor,
                                        pruned_indices_offsets: torch.Tensor,
                                        logical_table_ids: torch.Tensor,
                                        buffer_ids: torch.Tensor) -> None:
        """Start rows afresh: FBGEMM's ``reset_embedding_weight_momentum``, called by TorchRec's
        managed collision at every eviction (``ShardedManagedCollisionEmbedding(Bag)Collection``,
        ``_evict``) and by ITEP's pruning (``torchrec/modules/itep_modules.py``).

        Segment ``k`` (``k < buffer_ids.numel()``) is the rows
        ``pruned_indices[pruned_indices_offsets[b] : pruned_indices_offsets[b + 1]]``, ``b =
        buffer_ids[k]``, of logical table ``f = logical_table_ids[k]``. As in FBGEMM, whose
        ``D_offsets`` / ``weights_offsets`` / ``cache_hash_size_cumsum`` it indexes, a logical table
        is a feature: the rows are those of table ``feature_table_map[f]`` (ITEP passes each table's
        first feature; managed collision passes the table's position in its group, the same thing
        when each table of the TBE has one feature). Each such row gets FTRL's starting point,
        ``w = prox(z = 0) = 0``: weight 0, ``accum`` = ``initial_accumulator_value`` (n0), ``linear``
        0 (FBGEMM zeroes the weight and ``momentum1``, and only for row-wise Adagrad). Every other
        row keeps its bits. Under ``MANAGED_CACHING`` the rows' cached copies (weight and both
        states) are dropped without write-back, so the reset values in unified memory, and
        whatever the caller writes there next through the weight views (TorchRec's managed
        collision re-initialises evicted rows with the table's ``init_fn``), are what the next
        lookup reads. Duplicate rows are fine. No segment, or only empty ones, changes nothing, as
        in FBGEMM.

        Args:
            pruned_indices: int64 (or int32) ``[N]``, row indices within their tables.
            pruned_indices_offsets: int64 (or int32) ``[S + 1]``, non-decreasing, within ``[0, N]``:
                segment ``b`` of ``pruned_indices`` is ``[offsets[b], offsets[b + 1])``.
            logical_table_ids: int32 (or int64) ``[K]``, the logical table (feature) of each reset,
                in ``[0, len(feature_table_map))``.
            buffer_ids: int32 (or int64) ``[K]``, the segment of each reset, in ``[0, S)``.
            Each on the CPU or on the tables' device (FBGEMM moves them to its device). The
            arguments are checked on the host (a few syncs per call when they are on the device).

        Raises:
            ValueError: an argument that is not a 1-D int32/int64 tensor on the CPU or the tables'
                device; ``logical_table_ids`` and ``buffer_ids`` of different lengths; malformed
                offsets; a logical table or segment id out of range; an index outside its table.
                The message names the argument and the value; nothing is changed.
        """
        segments = self._reset_segments(pruned_indices, pruned_indices_offsets, logical_table_ids,
                                        buffer_ids)
        if not segments:
            return
        if self.cache is not None:
            self.cache.invalidate(torch.cat([self._table_row_base[t] + rows for t, rows in segments]))
        n0 = self._hp.initial_accumulator_value
        for t, rows in segments:
            if self.row_layout.weights == "stored":
                self._table_view(self.weights_dev, t).index_fill_(0, rows, 0.0)
            self._accum_view(t).index_fill_(0, rows, n0)
            self._table_view(self.linear_dev, t).index_fill_(0, rows, 0.0)

    def _reset_segments(self, pruned_indices, pruned_indices_offsets, logical_table_ids,
                        buffer_ids) -> list[tuple[int, torch.Tensor]]:
        """``(table, int64 rows on the tables' device)`` of each non-empty reset segment, after
        checking every argument (see :meth:`reset_embedding_weight_momentum`)."""
        where = "reset_embedding_weight_momentum"
        dev = self.linear_dev.device
        args = dict(pruned_indices=pruned_indices, pruned_indices_offsets=pruned_indices_offsets,
                    logical_table_ids=logical_table_ids, buffer_ids=buffer_ids)
        for name, t in args.items():
            _check_int_vector(f"{where}: {name}", t, dev, cpu_too=True)
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
        F = len(self.feature_table_map)
        for k, (f, b) in enumerate(zip(tables, bufs)):
            if not 0 <= f < F:
                raise ValueError(f"{where}: logical_table_ids[{k}]={f} is not a logical table "
                                 f"(feature) of this TBE, [0, {F})")
            if not 0 <= b < len(offs) - 1:
                raise ValueError(f"{where}: buffer_ids[{k}]={b} is not a segment of "
                                 f"pruned_indices_offsets ({len(offs)} offsets: [0, {len(offs) - 1}))")
        indices = pruned_indices.to(dev).long()
        segments = []
        for k, (f, b) in enumerate(zip(tables, bufs)):
            lo, hi, t = offs[b], offs[b + 1], self.feature_table_map[f]
            if hi == lo:
                continue
            rows, n_rows = indices[lo:hi], self.embedding_specs[t][0]
            bad = (rows < 0) | (rows >= n_rows)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{where}: pruned_indices[{lo + i}]={int(rows[i])} (segment "
                                 f"buffer_ids[{k}]={b}) is out of range [0, {n_rows}) of table "
                                 f"{self.table_names[t]!r} (logical table {f}); {int(bad.sum())} bad "
                                 f"index(es)")
            segments.append((t, rows))
        return segments

    @property
    def uuid(self) -> str:
        """A random ``str(uuid.uuid4())`` naming this TBE, fixed for its lifetime (FBGEMM's ``uuid``;
        TorchRec's raw-id tracker names its consumers by it)."""
        value = self.__dict__.get("_uuid")
        if value is None:
            value = self.__dict__["_uuid"] = str(_uuid.uuid4())
        return value

    def reset_uvm_cache_stats(self) -> None:
        """Zero the statistics :meth:`get_uvm_cache_stats` returns (FBGEMM's
        ``reset_uvm_cache_stats``). A no-op for the other placements."""
        if self.cache is not None:
            self.cache.uvm_cache_stats.zero_()
            self.cache.local_uvm_cache_stats.zero_()
