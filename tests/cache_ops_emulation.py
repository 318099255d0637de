"""FBGEMM's LRU cache ops as :class:`torchrec_ftrl.tbe.cache.RowCache` calls them, written out in Python
for CPU tensors (FBGEMM's are CUDA-only), so that the interpreter tests can run a whole cached TBE.

Transcribed from the contract of FBGEMM's ``split_embeddings_cache`` ops (``lru_cache_populate``:
the batch's cached rows are marked used at this timestep, then each missing row takes the least
recently used way of its set that no row of this batch uses, the evicted row's weight written back
first; ``lxu_cache_lookup``; ``lxu_cache_flush``), with rows copied ``D_offsets[t + 1] -
D_offsets[t]`` elements wide (zero-width rows copy nothing). The set of a row is ``row % sets``
here (FBGEMM hashes it): the tests compare a cached table with an uncached one, whatever rows the
cache holds. VBE batches, LFU and line locking are not emulated.
"""

from __future__ import annotations

import torch

ASSOC = 32
# What the emulated populates did since install(): rows evicted (written back) and inserted.
COUNTS = {"evicted": 0, "inserted": 0}


def linearize_cache_indices(cache_hash_size_cumsum, indices, offsets, *vbe):
    assert not vbe, "VBE batches are not emulated"
    features = cache_hash_size_cumsum.numel() - 1
    bags = offsets.numel() - 1
    feature = torch.repeat_interleave(torch.arange(bags) // (bags // features), offsets[1:] - offsets[:-1])
    return cache_hash_size_cumsum[feature] + indices


def _row_slice(row, row_table, weights_offsets, D_offsets, cumsum):
    t = int(row_table[row])
    D = int(D_offsets[t + 1] - D_offsets[t])
    start = int(weights_offsets[t]) + (row - int(cumsum[t])) * D
    return slice(start, start + D), D


def lru_cache_populate(weights, cumsum, total_rows, row_table, weights_offsets, D_offsets, linear,
                       state, cache_weights, timestep, lru_state, stochastic_rounding, gather_stats,
                       stats, lock_lines, locking_counter):
    assert not lock_lines, "line locking is not emulated"
    sets = state.shape[0]
    keys = [k for k in torch.unique(linear).tolist() if k < total_rows]
    missing = []
    for key in keys:                                  # hits first: they cannot be evicted now
        ways = (state[key % sets] == key).nonzero()
        if ways.numel():
            lru_state[key % sets, int(ways[0, 0])] = timestep
        else:
            missing.append(key)
    for key in missing:
        s = key % sets
        free = [w for w in torch.argsort(lru_state[s], stable=True).tolist() if lru_state[s, w] != timestep]
        if not free:
            continue                                  # every way holds a row of this batch
        way, slot = free[0], s * ASSOC + free[0]
        old = int(state[s, way])
        if old >= 0:
            sl, D = _row_slice(old, row_table, weights_offsets, D_offsets, cumsum)
            weights[sl] = cache_weights[slot, :D]
            COUNTS["evicted"] += 1
        COUNTS["inserted"] += 1
        sl, D = _row_slice(key, row_table, weights_offsets, D_offsets, cumsum)
        cache_weights[slot, :D] = weights[sl]
        state[s, way], lru_state[s, way] = key, timestep


def lxu_cache_lookup(linear, state, total_rows, gather_stats=False, stats=None):
    sets = state.shape[0]
    out = torch.full(linear.shape, -1, dtype=torch.int32)
    for i, key in enumerate(linear.tolist()):
        if key < total_rows:
            ways = (state[key % sets] == key).nonzero()
            if ways.numel():
                out[i] = (key % sets) * ASSOC + int(ways[0, 0])
    return out


def lxu_cache_flush(weights, cumsum, row_table, weights_offsets, D_offsets, total_D, state,
                    cache_weights, stochastic_rounding):
    for slot, row in enumerate(state.view(-1).tolist()):
        if row >= 0:
            sl, D = _row_slice(row, row_table, weights_offsets, D_offsets, cumsum)
            weights[sl] = cache_weights[slot, :D]


def install(monkeypatch) -> None:
    """Put these in place of ``torch.ops.fbgemm``'s ops for the test (``monkeypatch`` undoes it) and
    zero :data:`COUNTS`."""
    COUNTS.update(evicted=0, inserted=0)
    for fn in (linearize_cache_indices, lru_cache_populate, lxu_cache_lookup, lxu_cache_flush):
        monkeypatch.setattr(torch.ops.fbgemm, fn.__name__, fn)
