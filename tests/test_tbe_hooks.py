"""The TBE hooks TorchRec reaches on a fused FTRL table (issue #27; the list and the callers:
``docs/managed-collision.md``, "TBE hooks TorchRec calls").

* ``reset_embedding_weight_momentum`` (managed collision's eviction, ITEP's pruning): reset rows are
  exactly FTRL's starting point (weight 0, accum n0, linear 0), every other row keeps its bits, bad
  arguments raise before anything changes, and the next update of a reset row matches the float64
  reference (``conftest.reference_update``, ``tests/reference.py``) started from that point. Backends
  ``cpp`` and ``torch`` here, ``triton`` in the ``TRITON_INTERPRET=1`` child pytest; the
  ``fused_uvm_caching`` cache (FBGEMM's CUDA ops) by a stand-in cache here and for real in the
  ``cuda`` tests.
* The other hooks TorchRec reaches (state and weight views, learning rate and step, hyper-parameters,
  flush / purge / prefetch, weight init, ``uuid``, cache statistics), and the clear refusals of the
  FBGEMM-only ones.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from conftest import INTERP, bits, cuda, interpreter_parent, needs_cuda, \
    reference_update, run_interpreter_suite, tbe_state
from reference import reference_knobs
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import ComputeDevice, EmbeddingLocation, PoolingMode, SparseType

SPECS = [(12, 4), (9, 8), (7, 4)]
N0 = 0.1
HP = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3,
          ftrl_initial_accumulator_value=N0)
PRECISIONS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16}
# Relative tolerance of fp32 math against float64, and of a weight rounded to fp16.
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CPU = pytest.mark.parametrize("backend", ["cpp", "torch"])
PREC = pytest.mark.parametrize("precision", list(PRECISIONS))


def _tbe(backend="torch", precision=SparseType.FP32, specs=SPECS, fmap=None, device="cpu", **kw):
    return FTRLTableBatchedEmbeddingBags(specs, feature_table_map=fmap, weights_precision=precision,
                                         backend=backend, device=device, **{**HP, **kw})


def _batch(m, seed, device="cpu"):
    """Two bags per feature: every row of the feature's table, then a random few (so every row is
    touched, and some twice)."""
    rng = np.random.default_rng(seed)
    idx, lengths = [], []
    for t in m.feature_table_map:
        rows = m.embedding_specs[t][0]
        few = rng.integers(0, rows, 3).tolist()
        idx += list(range(rows)) + few
        lengths += [rows, len(few)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return (torch.tensor(idx, dtype=torch.int64, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device))


def _grad(m, seed, device="cpu"):
    return torch.randn(2, m.total_D, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).float().to(device)


def _train(m, steps, seed=0, device="cpu"):
    for s in range(steps):
        idx, off = _batch(m, seed + s, device)
        m(idx, off).backward(_grad(m, seed + s, device))


def _tables(m):
    """float64 CPU copies ``(weights, accums, linears)``, one ``[rows, D]`` per table."""
    W = [w.detach().double().cpu().clone() for w in m.split_embedding_weights()]
    S = m.split_optimizer_states()
    return W, [a.double().cpu().clone() for a, _ in S], [z.double().cpu().clone() for _, z in S]


def _check_step(m, W, A, Z, seed, device="cpu", what=""):
    """One training step of ``m`` against the float64 reference started from ``W``, ``A``, ``Z``
    (float64 tables given by the caller, not read from ``m``)."""
    idx, off = _batch(m, seed, device)
    g = _grad(m, seed, device)
    ref = reference_update(W, A, Z, m.feature_table_map, PoolingMode.SUM, idx, off, g,
                           reference_knobs(m.hyperparams))
    m(idx, off).backward(g)
    W1, A1, Z1 = _tables(m)
    wdt, sdt = m.weights_dev.dtype, m.accum_dev.dtype
    for t in range(len(W)):
        for name, got, want, dt in (("weight", W1[t], ref.w[t], wdt), ("accum", A1[t], ref.n[t], sdt),
                                    ("linear", Z1[t], ref.z[t], sdt)):
            want = torch.from_numpy(want)
            torch.testing.assert_close(got, want, rtol=RTOL[dt], atol=RTOL[dt] * 10,
                                       msg=lambda s: f"{what} table {t} {name}: {s}")


def _expected_after_reset(m, before, resets):
    """``before`` (bits of weights, accum, linear) with the rows ``resets`` = ``{table: rows}`` set to
    (0, n0, 0) in the buffers' dtypes, computed here from the table layout."""
    out = []
    for buf, flat, value in zip(("weights_dev", "accum_dev", "linear_dev"), before, (0.0, N0, 0.0)):
        t_flat = flat.clone()
        dtype = getattr(m, buf).dtype
        for t, rows in resets.items():
            r, d = m.embedding_specs[t][:2]
            view = t_flat.view(dtype)[m.weights_physical_offsets[t]:][:r * d].view(r, d)
            view[torch.tensor(sorted(set(rows)), dtype=torch.long)] = torch.tensor(value, dtype=dtype)
        out.append(t_flat)
    return out


def _flat_bits(m):
    return [getattr(m, b).detach().cpu().clone() for b in ("weights_dev", "accum_dev", "linear_dev")]


def _assert_bits(m, expected):
    for name, want, got in zip(("weights_dev", "accum_dev", "linear_dev"), expected, _flat_bits(m)):
        assert torch.equal(bits(got), bits(want)), f"{name}: a row other than the reset ones changed, " \
                                                    f"or a reset row is not (0, n0, 0)"


# ------------------------------------------------------------------ reset_embedding_weight_momentum
@CPU
@PREC
def test_reset_rows_start_afresh_and_train_like_never_seen_rows(backend, precision):
    """Train, reset rows of two tables (segments picked through ``buffer_ids`` out of order, a row
    twice), check the buffers bit for bit, then one more step against the float64 reference started
    from (0, n0, 0) for the reset rows and the pre-reset values for the others."""
    m = _tbe(backend, precision)
    _train(m, 3)
    W, A, Z = _tables(m)
    assert all(bool((a > N0).all()) for a in A), "the training must have touched every row"
    before = _flat_bits(m)
    m.reset_embedding_weight_momentum(
        pruned_indices=torch.tensor([5, 0, 3, 3, 11]), pruned_indices_offsets=torch.tensor([0, 2, 5]),
        logical_table_ids=torch.tensor([2, 0], dtype=torch.int32),
        buffer_ids=torch.tensor([0, 1], dtype=torch.int32))
    resets = {2: [5, 0], 0: [3, 11]}
    _assert_bits(m, _expected_after_reset(m, before, resets))
    for t, rows in resets.items():            # the independent starting point of the reference
        W[t][rows], A[t][rows], Z[t][rows] = 0.0, torch.tensor(N0, dtype=torch.float32).double(), 0.0
    _check_step(m, W, A, Z, seed=10, what="step after reset")


@CPU
def test_reset_as_managed_collision_calls_it_then_init_fn(backend):
    """TorchRec's ``_evict`` (mc_embedding_modules.py, 1.6-1.9): keyword arguments, int64 indices
    and offsets ``[0, n]``, int32 ``[table_idx]`` and ``[0]``, under ``no_grad``; then it writes the
    table's ``init_fn`` values into the evicted rows through the weight view. The slot ends as a
    never-seen row: that weight, accum n0, linear 0."""
    m = _tbe(backend)
    _train(m, 2)
    before = _flat_bits(m)
    evicted = torch.tensor([8, 1, 4])
    with torch.no_grad():
        m.reset_embedding_weight_momentum(
            pruned_indices=evicted.long(),
            pruned_indices_offsets=torch.tensor([0, evicted.shape[0]], dtype=torch.long),
            logical_table_ids=torch.tensor([1], dtype=torch.int), buffer_ids=torch.tensor([0], dtype=torch.int))
        _assert_bits(m, _expected_after_reset(m, before, {1: [8, 1, 4]}))
        weight = m.split_embedding_weights()[1]
        init = torch.full((3, 8), 0.0125)
        weight[evicted] = init
    W, A, Z = _tables(m)
    assert torch.equal(W[1][evicted], init.double())
    assert bool((A[1][evicted] == torch.tensor(N0, dtype=torch.float32).double()).all())
    assert bool((Z[1][evicted] == 0).all())
    _check_step(m, W, A, Z, seed=20, what="step after eviction")


def test_reset_logical_table_ids_are_features_and_buffer_ids_pick_segments():
    """ITEP's call (itep_modules.py): CPU int32 ids; the logical table is a feature, as in FBGEMM
    (feature 2 of ``feature_table_map=[0, 0, 1]`` is table 1); only the segments ``buffer_ids`` name
    are reset (segment 0 is not)."""
    m = _tbe("cpp", fmap=[0, 0, 1], specs=SPECS[:2])
    _train(m, 2)
    before = _flat_bits(m)
    m.reset_embedding_weight_momentum(torch.tensor([1, 2, 6, 0], dtype=torch.int64),
                                      torch.tensor([0, 2, 4]), torch.tensor([2], dtype=torch.int32),
                                      torch.tensor([1], dtype=torch.int32))
    _assert_bits(m, _expected_after_reset(m, before, {1: [6, 0]}))


def test_reset_with_nothing_to_reset_changes_nothing():
    """FBGEMM skips a segment with no index; no segment at all is a no-op too."""
    m = _tbe("cpp")
    _train(m, 1)
    before = tbe_state(m)
    i32 = dict(dtype=torch.int32)
    m.reset_embedding_weight_momentum(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]),
                                      torch.tensor([0], **i32), torch.tensor([0], **i32))
    m.reset_embedding_weight_momentum(torch.tensor([], dtype=torch.int64), torch.tensor([0]),
                                      torch.tensor([], **i32), torch.tensor([], **i32))
    for b, a in zip(before, tbe_state(m)):
        assert torch.equal(bits(b), bits(a))


def _good():
    return dict(pruned_indices=torch.tensor([1, 2, 3]), pruned_indices_offsets=torch.tensor([0, 1, 3]),
                logical_table_ids=torch.tensor([0, 2], dtype=torch.int32),
                buffer_ids=torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("change,match", [
    (dict(pruned_indices=torch.tensor([1, 2, 7])), r"pruned_indices\[2\]=7 .*\[0, 7\) of table 't2'"),
    (dict(pruned_indices=torch.tensor([-1, 2, 3])), r"pruned_indices\[0\]=-1 "),
    (dict(logical_table_ids=torch.tensor([0, 3], dtype=torch.int32)), r"logical_table_ids\[1\]=3 .*\[0, 3\)"),
    (dict(logical_table_ids=torch.tensor([-1, 0], dtype=torch.int32)), r"logical_table_ids\[0\]=-1"),
    (dict(buffer_ids=torch.tensor([0, 2], dtype=torch.int32)), r"buffer_ids\[1\]=2 .*\[0, 2\)"),
    (dict(buffer_ids=torch.tensor([0], dtype=torch.int32)), r"one entry per reset, got 2 and 1"),
    (dict(pruned_indices_offsets=torch.tensor([0, 2, 1])), r"non-decreasing .* got \[0, 2, 1\]"),
    (dict(pruned_indices_offsets=torch.tensor([0, 1, 4])), r"numel\(\)=3\], got \[0, 1, 4\]"),
    (dict(pruned_indices_offsets=torch.tensor([-1, 1, 3])), r"pruned_indices_offsets must be non-decreasing"),
    (dict(pruned_indices=torch.tensor([1.0, 2.0, 3.0])), r"pruned_indices must be int32 or int64, got dtype=torch.float32"),
    (dict(buffer_ids=torch.tensor([True, False])), r"buffer_ids must be int32 or int64, got dtype=torch.bool"),
    (dict(pruned_indices=torch.tensor([[1, 2, 3]])), r"pruned_indices must be 1-D, got shape=\(1, 3\)"),
    (dict(logical_table_ids=[0, 2]), r"logical_table_ids must be a torch.Tensor, got list"),
    (dict(pruned_indices=torch.tensor([1, 2, 3], device="meta")), r"pruned_indices must be on the CPU or on cpu"),
])
def test_reset_bad_arguments_raise_and_change_nothing(change, match):
    m = _tbe("cpp")
    _train(m, 1)
    before = tbe_state(m)
    with pytest.raises(ValueError, match=match):
        m.reset_embedding_weight_momentum(**{**_good(), **change})
    for b, a in zip(before, tbe_state(m)):
        assert torch.equal(bits(b), bits(a))


class _RecordingCache(torch.nn.Module):
    """Stands in for the HBM cache (FBGEMM's cache ops are CUDA-only): caches nothing, records calls."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.register_buffer("lxu_cache_weights", torch.zeros(1, 8))
        self.register_buffer("lxu_cache_states", torch.zeros(2, 1, 8))
        self.register_buffer("uvm_cache_stats", torch.arange(6))
        self.register_buffer("local_uvm_cache_stats", torch.ones(6, dtype=torch.int32))

    def invalidate(self, keys):
        self.calls.append(("invalidate", keys.tolist()))

    def flush(self, *buffers):
        self.calls.append(("flush", tuple(b.data_ptr() for b in buffers)))

    def reset(self):
        self.calls.append(("reset",))

    def linearize(self, indices, offsets, bags=None):
        return indices.clone()

    def populate(self, keys, *buffers):
        self.calls.append(("populate", keys.tolist()))
        return torch.full((keys.numel(),), -1, dtype=torch.int32)


def test_reset_drops_the_cached_copies_of_the_reset_rows():
    """``fused_uvm_caching``: the reset rows' cache entries are dropped (their row keys,
    ``row_base[table] + row``, as FBGEMM's ``linearize_cache_indices`` forms them), once, and the
    unified-memory rows are reset. The real cache: ``test_cuda_reset_*`` below."""
    m = _tbe("torch")
    _train(m, 1)
    before = _flat_bits(m)
    m.cache = _RecordingCache()
    m.reset_embedding_weight_momentum(torch.tensor([5, 3, 3]), torch.tensor([0, 1, 3]),
                                      torch.tensor([2, 1], dtype=torch.int32),
                                      torch.tensor([0, 1], dtype=torch.int32))
    assert m.cache.calls == [("invalidate", [12 + 9 + 5, 12 + 3, 12 + 3])]
    _assert_bits(m, _expected_after_reset(m, before, {2: [5], 1: [3]}))


# ------------------------------------------------------------------ the Triton backend (interpreter)
@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


@PREC
def test_interp_triton_reset_then_step_matches_reference(precision):
    if not INTERP:
        pytest.skip("runs in the child process of test_interpreter_suite (TRITON_INTERPRET=1)")
    m = _tbe("triton", precision)
    _train(m, 2)
    W, A, Z = _tables(m)
    before = _flat_bits(m)
    m.reset_embedding_weight_momentum(torch.tensor([2, 6]), torch.tensor([0, 2]),
                                      torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    _assert_bits(m, _expected_after_reset(m, before, {1: [2, 6]}))
    W[1][[2, 6]], A[1][[2, 6]], Z[1][[2, 6]] = 0.0, torch.tensor(N0, dtype=torch.float32).double(), 0.0
    _check_step(m, W, A, Z, seed=30, what="triton step after reset")


# ------------------------------------------------------------------ the real HBM cache (CUDA)
def _cuda_pair(precision):
    specs = [(600, 8), (400, 16)]
    ref = _tbe("triton", precision, specs=specs, device="cuda")
    cached = FTRLTableBatchedEmbeddingBags(
        [(r, d, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA) for r, d in specs],
        weights_precision=precision, device="cuda", cache_sets=2, **HP)     # 64 slots: evictions
    cached.load_state_dict(ref.state_dict())
    return ref, cached


@cuda
@needs_cuda
@PREC
def test_cuda_reset_drops_stale_cached_rows_and_trains_like_device(precision):
    """Dirty cached rows are reset: no cached copy survives (lookup misses, a flush writes nothing
    stale back), an ``init_fn`` write to unified memory (managed collision) is what the next lookup
    reads, and training goes on bitwise like the same steps on a DEVICE TBE."""
    ref, m = _cuda_pair(precision)
    rng = np.random.default_rng(0)

    def batches(n):
        for _ in range(n):
            idx = torch.tensor(np.concatenate([rng.integers(0, 40, 30), rng.integers(0, 30, 20)]),
                               device="cuda")
            off = torch.tensor([0, 10, 30, 40, 50], device="cuda")
            yield idx, off, torch.randn(2, 24, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))).cuda()

    for idx, off, g in batches(3):
        for x in (ref, m):
            x(idx, off).backward(g)
    last = idx[:30].unique()               # table 0 rows of the last batch (row keys = rows)
    keys = last[m.cache.lookup(last, count=False) >= 0][:3]
    assert keys.numel() == 3, "three updated (dirty) rows of table 0 must be cached"
    rows0 = torch.cat([keys, torch.tensor([300], device="cuda")])
    args = (torch.cat([rows0, torch.tensor([2], device="cuda")]), torch.tensor([0, 4, 5], device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"), torch.tensor([0, 1], dtype=torch.int32, device="cuda"))
    for x in (ref, m):
        x.reset_embedding_weight_momentum(*args)
    assert bool((m.cache.lookup(keys, count=False) == -1).all())
    for x in (ref, m):
        w0 = x.split_embedding_weights()[0]   # flushes the cache: nothing stale may come back
        s0 = x.split_optimizer_states()[0]
        assert bool((w0[rows0] == 0).all()) and bool((s0[0][rows0] == torch.tensor(N0, dtype=s0[0].dtype)).all())
        assert bool((s0[1][rows0] == 0).all())
        with torch.no_grad():
            w0[rows0[:2]] = 0.03                # managed collision's init_fn write
    for idx, off, g in batches(3):
        outs = [x(idx, off) for x in (ref, m)]
        assert torch.equal(outs[0], outs[1])
        for o in outs:
            o.backward(g)
    for a, b in zip(ref.split_embedding_weights() + [s for p in ref.split_optimizer_states() for s in p],
                    m.split_embedding_weights() + [s for p in m.split_optimizer_states() for s in p]):
        assert torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------ the other hooks TorchRec reaches
def test_weight_views_as_torchrec_slices_them():
    """``_gen_named_parameters_by_table_fused`` (batched_embedding_kernel.py) slices
    ``weights_dev`` / ``weights_host`` / ``weights_uvm`` (by the spec's location) from
    ``weights_physical_offsets[t]`` over ``rows * dim`` (``weights_precision`` not INT8): the same
    memory as ``split_embedding_weights()[t]``."""
    m = _tbe("cpp", SparseType.FP16)
    assert m.weights_precision == SparseType.FP16
    for t, ((rows, dim, location, _), view) in enumerate(zip(m.embedding_specs, m.split_embedding_weights())):
        assert location == EmbeddingLocation.HOST.value
        data = {EmbeddingLocation.DEVICE.value: m.weights_dev, EmbeddingLocation.HOST.value: m.weights_host}.get(
            location, m.weights_uvm)
        off = m.weights_physical_offsets[t]
        torch_slice = data[off:off + rows * dim].view(rows, dim)
        assert torch_slice.data_ptr() == view.data_ptr() and torch.equal(torch_slice, view)
    assert m.weights_physical_offsets == [0, 48, 120]


def test_optimizer_state_views_and_a_clear_key_error_for_other_states():
    """``get_optimizer_state()`` (EmbeddingFusedOptimizer; managed collision's
    ``sync_hash_zch_weights`` reads ``[t]["sum"]``, row-wise Adagrad's state): FTRL's two views,
    and a KeyError naming them for any other key."""
    m = _tbe("cpp")
    _train(m, 1)
    states = m.get_optimizer_state()
    for t, (st, (a, z)) in enumerate(zip(states, m.split_optimizer_states())):
        assert set(st) == {"accum", "linear"}
        off, (rows, dim) = m.weights_physical_offsets[t], SPECS[t]
        assert torch.equal(st["accum"], m.accum_dev[off:off + rows * dim].view(rows, dim))
        assert st["linear"].data_ptr() == z.data_ptr() == m.linear_dev[off:].data_ptr()
    with pytest.raises(KeyError, match="'sum'.*'accum' and 'linear'"):
        states[0]["sum"]
    assert states[0].get("sum") is None


def test_learning_rate_step_and_hyper_parameters_reach_the_update():
    """EmbeddingFusedOptimizer's ``step`` / ``zero_grad`` (``set_learning_rate``, read back by
    ``get_learning_rate``), ``set_optimizer_step`` and ``update_hyper_parameters``: the next update
    matches the reference with the new knobs; FTRL's rule has no step count (the counter only
    counts)."""
    m = _tbe("cpp")
    _train(m, 1)
    m.set_learning_rate(0.2)
    assert m.get_learning_rate() == m.learning_rate == 0.2
    m.set_optimizer_step(1000)
    assert int(m.iter) == 1000
    m.update_hyper_parameters({"ftrl_l1_reg": 0.004, "ftrl_beta": 1.0})
    assert reference_knobs(m.hyperparams) == dict(lr=0.2, lr_power=-0.5, l1=0.004, l2=0.01, beta=1.0,
                                                  l2_shrinkage=0.0, l2_convention="tensorflow")
    _check_step(m, *_tables(m), seed=40, what="step with new knobs")
    assert int(m.iter) == 1001
    with pytest.raises(ValueError, match="learning_rate"):
        m.set_learning_rate(-1.0)


def test_flush_purge_and_prefetch_reach_the_cache():
    """``flush`` (lookups' and kernels' ``flush``, ITEP, state_dict), ``reset_cache_states``
    (kernels' ``purge``, ITEP, load_state_dict) and ``prefetch`` (the prefetch pipeline): no-ops
    without a cache, cache operations with one."""
    m = _tbe("torch")
    _train(m, 1)
    before = tbe_state(m)
    m.flush(), m.reset_cache_states(), m.prefetch(*_batch(m, 0))
    for b, a in zip(before, tbe_state(m)):
        assert torch.equal(bits(b), bits(a))
    m.cache = _RecordingCache()
    m.flush()
    m.prefetch(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3]))
    m.reset_cache_states()
    assert m.cache.calls == [("flush", (m.weights_dev.data_ptr(), m.accum_dev.data_ptr(),
                                        m.linear_dev.data_ptr())),
                             ("populate", [1, 2, 3]), ("reset",)]
    assert m._cached.prefetched == []


def test_cache_statistics_reset():
    """``get_uvm_cache_stats`` / ``reset_uvm_cache_stats`` (FBGEMM's; TorchRec itself reads
    neither): six int64 counters, zeroed by the reset; zeros and a no-op without a cache."""
    m = _tbe("torch")
    m.reset_uvm_cache_stats()
    assert torch.equal(m.get_uvm_cache_stats(), torch.zeros(6, dtype=torch.int64))
    m.cache = _RecordingCache()
    assert m.get_uvm_cache_stats().tolist() == [0, 1, 2, 3, 4, 5]
    m.reset_uvm_cache_stats()
    assert m.get_uvm_cache_stats().tolist() == [0] * 6 and int(m.cache.local_uvm_cache_stats.sum()) == 0


@PREC
def test_init_embedding_weights_uniform(precision):
    m = _tbe("cpp", precision)
    _train(m, 1)
    states = [m.accum_dev.clone(), m.linear_dev.clone()]
    m.init_embedding_weights_uniform(0.5, 0.75)
    w = m.weights_dev.float()
    assert bool(((w >= 0.5) & (w <= 0.75)).all()) and w.unique().numel() > 10
    assert torch.equal(states[0], m.accum_dev) and torch.equal(states[1], m.linear_dev)


def test_identity_attributes():
    """``uuid`` (raw-id tracker of managed-collision modules, model_tracker/trackers/raw_id_tracker.py),
    ``table_names`` (embedding_kernel.py), ``optimizer`` (model delta tracker)."""
    from torchrec_ftrl.optim_type import emb_optim_type
    a, b = _tbe("cpp", table_names=["x", "y", "z"]), _tbe("cpp")
    assert uuid.UUID(a.uuid).version == 4 and a.uuid == a.uuid and a.uuid != b.uuid
    assert a.table_names == ["x", "y", "z"] and b.table_names == ["t0", "t1", "t2"]
    assert a.optimizer == emb_optim_type()


@pytest.mark.parametrize("name,why", [
    ("momentum1_dev", "no momentum.*accum_dev.*linear_dev"),
    ("momentum2_dev", "no momentum"),
    ("lxu_cache_weights", "tbe.cache.*stash_emo_cache"),
    ("lxu_cache_state", "tbe.cache"),
    ("lxu_cache_locations_list", "prefetch bookkeeping"),
    ("lxu_cache_locking_counter", "tbe.cache"),
    ("timesteps_prefetched", "tbe.cache"),
    ("create_rocksdb_hard_link_snapshot", "key-value / SSD"),
    ("get_named_split_embedding_weights_snapshot", "key-value / SSD"),
    ("direct_write_embedding", "key-value / SSD"),
    ("enrichment_query_id", "key-value / SSD"),
    ("tbe_unique_id", "key-value / SSD"),
    ("split_embedding_weights_with_scale_bias", "quantized"),
    ("int8_emb_row_dim_offset", "quantized"),
])
def test_fbgemm_only_hooks_are_refused_by_name(name, why):
    """An AttributeError naming the hook and why it has no FTRL meaning; ``hasattr`` stays False, as
    TorchRec's guards (``hasattr(tbe, "lxu_cache_weights")``, ...) expect."""
    m = _tbe("cpp")
    assert not hasattr(m, name)
    with pytest.raises(AttributeError, match=f"no '{name}': .*{why}"):
        getattr(m, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        m.no_such_thing


def test_memory_stashing_skips_the_ftrl_tbe():
    """TorchRec 1.8+'s ``MemoryStashingManager.stash_emo_cache`` (experimental pipelines) would free a
    fused_uvm_caching TBE's ``lxu_cache_weights`` and rebuild FBGEMM's prefetch state; it skips a TBE
    without the attribute, so the FTRL TBE keeps its cache."""
    stashing = pytest.importorskip("torchrec.distributed.memory_stashing")
    import types
    from torchrec.distributed.embedding_types import (EmbeddingComputeKernel, GroupedEmbeddingConfig,
                                                      ShardedEmbeddingTable)
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    table = ShardedEmbeddingTable(num_embeddings=12, embedding_dim=4, name="t0", feature_names=["f0"],
                                  compute_kernel=EmbeddingComputeKernel.FUSED_UVM_CACHING)
    config = GroupedEmbeddingConfig(DataType.FP32, PoolingType.SUM, False, False,
                                    EmbeddingComputeKernel.FUSED_UVM_CACHING, [table])
    m = _tbe("cpp", specs=SPECS[:1])
    lookup = types.SimpleNamespace(_emb_modules=[types.SimpleNamespace(_config=config, _emb_module=m)],
                                   _feature_splits=[1])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert stashing.MemoryStashingManager.stash_emo_cache(lookup, kjt) is None
