"""Tests of the UVM placements (``fused_uvm``, ``fused_uvm_caching``): :mod:`torchrec_ftrl.tbe.cache`, the
cache paths of the Triton kernels, and the TBE under each placement.

* Interpreter (CI, ``TRITON_INTERPRET=1`` child pytest): the kernels' cache path against the float64
  oracle with a cache laid out by hand (no FBGEMM op: its cache ops are CUDA-only). The cached copy
  of a row differs from its unified-memory copy, so a kernel that reads or updates the wrong one
  fails. And the state-cache follow kernel against moves written out by hand.
* ``cuda``: FBGEMM's real cache ops. DEVICE, MANAGED and MANAGED_CACHING TBEs trained on the same
  batches end bitwise equal (same kernels, same summation order), across evictions of dirty rows,
  hits and misses in one batch, hot rows, fp16 weights, VBE, weighted features, LFU, a cache smaller
  than one batch's unique rows, prefetch, and state_dict save / load with a warm cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import HAS_CUDA, INTERP, cuda, interpreter_parent, needs_cuda, reference_update, \
    run_interpreter_suite

pytest.importorskip("triton")

from reference import reference_knobs  # noqa: E402
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags  # noqa: E402
from torchrec_ftrl.fbgemm_enums import (BoundsCheckMode, CacheAlgorithm, ComputeDevice,  # noqa: E402
                                        EmbeddingLocation, PoolingMode, SparseType)
from torchrec_ftrl.kernels import calls  # noqa: E402

KNOBS = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3)
BF16_STATES = {"accum": SparseType.BF16, "linear": SparseType.BF16}


@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


def _case(rng, specs, fmap, B, max_len, hot):
    lengths, idx = [], []
    for f in range(len(fmap)):
        rows = specs[fmap[f]][0]
        for _ in range(B):
            L = int(rng.randint(0, max_len + 1))
            lengths.append(L)
            ids = rng.randint(0, rows, L)
            if hot:
                ids = np.where(rng.rand(L) < 0.7, rng.randint(0, min(2, rows), L), ids)
            idx.extend(int(i) for i in ids)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return torch.tensor(idx, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


# ------------------------------------------------------------------ interpreter: the kernels
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE])
@pytest.mark.parametrize("specs,fmap,hot,psw", [
    ([(9, 4), (13, 8), (6, 4)], [0, 1, 2, 0], False, True),     # mixed D: table/dim lookups
    ([(9, 8), (13, 8)], [0, 1, 1], True, False),                 # one D (EVEN_D), long runs combined
])
def test_interp_cached_rows_are_read_and_updated_in_the_cache(interp, pooling, specs, fmap, hot, psw):
    """Half of the touched rows sit in a hand-made cache (slots in random order, row stride wider
    than D) holding values that differ from the flat buffers. The output and the update must follow
    the logical table (cache copy where cached, flat copy elsewhere), and the flat copies of cached
    rows must stay untouched."""
    if pooling == PoolingMode.NONE:
        specs = [(r, specs[0][1]) for r, _ in specs]
        psw = False
    rng = np.random.RandomState(3)
    torch.manual_seed(0)
    m = FTRLTableBatchedEmbeddingBags(specs, feature_table_map=fmap, pooling_mode=pooling,
                                      bounds_check_mode=BoundsCheckMode.FATAL, backend="triton",
                                      **KNOBS)
    with torch.no_grad():
        m.accum_dev.uniform_(0.0, 0.5)
        m.linear_dev.uniform_(-0.1, 0.1)
    indices, offsets = _case(rng, specs, fmap, B=4, max_len=6, hot=hot)
    weights = torch.tensor(rng.rand(indices.numel()) + 0.5, dtype=torch.float32) if psw else None
    batch = m._make_batch(indices, offsets, weights, None)

    row_base = np.cumsum([0] + [r for r, _ in specs])
    tables = batch.index_table().numpy()
    keys = row_base[tables] + indices.numpy()
    uniq = np.unique(keys)
    cached = rng.permutation(uniq)[: len(uniq) // 2]
    slots, stride = len(uniq) + 3, max(d for _, d in specs) + 4
    slot_of = dict(zip(cached.tolist(), rng.permutation(slots)[: len(cached)].tolist()))
    cache_w = torch.full((slots, stride), 7.0)
    cache_s = torch.full((2, slots, stride), 9.0)
    logical_w = [w.clone() for w in m.split_embedding_weights()]
    logical_s = [(a.clone(), z.clone()) for a, z in m.split_optimizer_states()]
    for key, slot in slot_of.items():
        t = int(np.searchsorted(row_base, key, side="right") - 1)
        r, D = key - row_base[t], specs[t][1]
        w = torch.tensor(rng.uniform(-0.05, 0.05, D), dtype=torch.float32)
        n = torch.tensor(rng.uniform(0.0, 0.7, D), dtype=torch.float32)
        z = torch.tensor(rng.uniform(-0.2, 0.2, D), dtype=torch.float32)
        cache_w[slot, :D], cache_s[0, slot, :D], cache_s[1, slot, :D] = w, n, z
        logical_w[t][r], logical_s[t][0][r], logical_s[t][1][r] = w, n, z
    loc = torch.tensor([slot_of.get(int(k), -1) for k in keys], dtype=torch.int32)
    batch = dataclasses.replace(batch, cache_locations=loc, cache_weights=cache_w, cache_states=cache_s)
    flat_before = [t.clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    cache_before = (cache_w.clone(), cache_s.clone())

    out, ctx = calls.forward_train(m._backend, m.table_arrays, batch, torch.float32, m.hyperparams)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    calls.backward_update_(m._backend, m.table_arrays, batch, ctx, g,
                           m.hyperparams, m.nonfinite_grad_rows)

    ref = reference_update(logical_w, [a for a, _ in logical_s], [z for _, z in logical_s], fmap,
                           pooling, indices, offsets, g, reference_knobs(m.hyperparams), psw=weights)
    np.testing.assert_allclose(out.double().reshape(-1).numpy(), ref.out.reshape(-1).numpy(),
                               rtol=5e-5, atol=1e-5)
    views = m.split_embedding_weights(), m.split_optimizer_states()
    for t, (_, D) in enumerate(specs):
        got_w, got_n, got_z = views[0][t].clone(), views[1][t][0].clone(), views[1][t][1].clone()
        for key, slot in slot_of.items():
            tt = int(np.searchsorted(row_base, key, side="right") - 1)
            if tt == t:
                r = key - row_base[t]
                got_w[r], got_n[r], got_z[r] = cache_w[slot, :D], cache_s[0, slot, :D], cache_s[1, slot, :D]
        np.testing.assert_allclose(got_w.double().numpy(), ref.w[t], rtol=5e-5, atol=1e-5)
        np.testing.assert_allclose(got_n.double().numpy(), ref.n[t], rtol=3e-5, atol=1e-6)
        np.testing.assert_allclose(got_z.double().numpy(), ref.z[t], rtol=5e-5, atol=1e-5)
    # The flat copies of cached rows are untouched; the cache's other slots and padding too.
    offs = [int(o) for o in batch.table_w_offset]
    for key in slot_of:
        t = int(np.searchsorted(row_base, key, side="right") - 1)
        D = specs[t][1]
        e = offs[t] + (key - row_base[t]) * D
        for now, before in zip((m.weights_dev, m.accum_dev, m.linear_dev), flat_before):
            assert torch.equal(now[e:e + D], before[e:e + D])
    free = sorted(set(range(slots)) - set(slot_of.values()))
    assert torch.equal(cache_w[free], cache_before[0][free])
    assert torch.equal(cache_s[:, free], cache_before[1][:, free])
    assert torch.equal(cache_w[:, max(d for _, d in specs):], cache_before[0][:, max(d for _, d in specs):])


def test_interp_state_cache_follows_slot_changes(interp):
    """Slots whose row changed write the old row's states back and load the new row's; empty slots,
    unchanged slots and the padding past D are left alone."""
    from torchrec_ftrl.kernels.cuda.cache import state_cache_follow_kernel

    specs = [(5, 4), (7, 8)]
    row_base = torch.tensor([0, 5, 12])
    w_off = torch.tensor([0, 5 * 4])
    dims = torch.tensor([4, 8])
    total = 5 * 4 + 7 * 8
    accum = torch.arange(total, dtype=torch.float32)
    linear = -torch.arange(total, dtype=torch.float32)
    row_table = torch.tensor([0] * 5 + [1] * 7, dtype=torch.int32)
    S = 10
    cache = torch.rand(2, 6, S) + 100.0
    before = torch.tensor([3, 6, -1, 11, 2, -1])      # slot 0: row 3 (t0), 1: row 6 (t1, r1), ...
    after = torch.tensor([3, 8, 0, -1, 2, -1])        # 1: 6 -> 8, 2: empty -> 0, 3: 11 -> empty
    acc0, lin0, cache0 = accum.clone(), linear.clone(), cache.clone()
    state_cache_follow_kernel[(3,)](before, after, accum, linear, cache[0], cache[1], row_table,
                                    w_off, dims, row_base, 6, S, SLOTS=2, BLOCK_D=8, ROWWISE=False)

    def flat(row):
        t = int(row_table[row])
        start = int(w_off[t]) + (row - int(row_base[t])) * int(dims[t])
        return slice(start, start + int(dims[t])), int(dims[t])

    exp_acc, exp_lin, exp_cache = acc0.clone(), lin0.clone(), cache0.clone()
    for slot, old in ((1, 6), (3, 11)):                      # written back
        sl, D = flat(old)
        exp_acc[sl], exp_lin[sl] = cache0[0, slot, :D], cache0[1, slot, :D]
    for slot, new in ((1, 8), (2, 0)):                       # loaded
        sl, D = flat(new)
        exp_cache[0, slot, :D], exp_cache[1, slot, :D] = acc0[sl], lin0[sl]
    assert torch.equal(accum, exp_acc)
    assert torch.equal(linear, exp_lin)
    assert torch.equal(cache, exp_cache)


# ------------------------------------------------------------------ CUDA: the real cache ops
def _tbe(location, specs, fmap=None, pooling=PoolingMode.SUM, precision=SparseType.FP32, seed=0,
         **kw):
    torch.manual_seed(seed)
    m = FTRLTableBatchedEmbeddingBags(
        [(r, d, location, ComputeDevice.CUDA) for r, d in specs], feature_table_map=fmap,
        pooling_mode=pooling, weights_precision=precision, device="cuda",
        bounds_check_mode=BoundsCheckMode.WARNING, **KNOBS, **kw)
    return m


def _same_start(models):
    first = models[0]
    for m in models[1:]:
        with torch.no_grad():
            for a, b in zip(m.split_embedding_weights(), first.split_embedding_weights()):
                a.copy_(b)
        m.reset_cache_states()


def _tables(m):
    return ([w.detach().clone().cpu() for w in m.split_embedding_weights()],
            [(a.clone().cpu(), z.clone().cpu()) for a, z in m.split_optimizer_states()])


def _assert_bitwise(a, b):
    (wa, sa), (wb, sb) = _tables(a), _tables(b)
    for x, y in zip(wa, wb):
        assert torch.equal(x, y)
    for (na, za), (nb, zb) in zip(sa, sb):
        assert na.dtype == nb.dtype and za.dtype == zb.dtype
        assert torch.equal(na, nb) and torch.equal(za, zb)


def _batches(steps, specs, fmap, B, L, zipf, seed, vbe=False):
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        sizes = [int(rng.randint(1, B + 1)) for _ in fmap] if vbe else [B] * len(fmap)
        lengths, idx = [], []
        for f, t in enumerate(fmap):
            rows = specs[t][0]
            for _ in range(sizes[f]):
                n = int(rng.randint(0, L + 1))
                lengths.append(n)
                ids = (rng.zipf(zipf, n) - 1) % rows if zipf else rng.randint(0, rows, n)
                idx.extend(int(i) for i in ids)
        off = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
        psw = torch.tensor(rng.rand(len(idx)) + 0.5, dtype=torch.float32)
        g_seed = int(rng.randint(1 << 30))
        out.append((torch.tensor(idx, dtype=torch.int64), off, psw, g_seed,
                    [[s] for s in sizes] if vbe else None))
    return out


def _keys(idx, off, specs, fmap, batches_vbe=False):
    """Linear row keys of a batch (bags feature-major)."""
    row_base = np.cumsum([0] + [r for r, _ in specs])
    lengths = (off[1:] - off[:-1]).numpy()
    nb = len(lengths)
    if batches_vbe:
        return set(idx.tolist())   # distinct raw ids: no more than the distinct keys
    bag_feature = np.arange(nb) // (nb // len(fmap))
    feat = np.repeat(bag_feature, lengths)
    return set((row_base[np.asarray(fmap)[feat]] + idx.numpy()).tolist())


def _train(m, batches, weighted=False, prefetch=False, pipelined=False):
    """Train on ``batches``. ``prefetch``: prefetch each batch right before its forward;
    ``pipelined``: as ``PrefetchTrainPipelineSparseDist`` does, prefetch batch i+1 after the forward
    of batch i and before its backward (its populate may evict rows batch i is about to update)."""
    cuda = [(idx.cuda(), off.cuda(), psw.cuda(), g_seed, bsfpr) for idx, off, psw, g_seed, bsfpr in batches]
    if pipelined and cuda:
        m.prefetch(cuda[0][0], cuda[0][1])
    for i, (idx, off, psw, g_seed, bsfpr) in enumerate(cuda):
        kw = dict(batch_size_per_feature_per_rank=bsfpr) if bsfpr else {}
        if prefetch:
            m.prefetch(idx, off, **kw)
        out = m(idx, off, psw if weighted else None, **kw)
        if pipelined and i + 1 < len(cuda):
            m.prefetch(cuda[i + 1][0], cuda[i + 1][1])
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).to(out.dtype)
        out.backward(g.cuda())
    torch.cuda.synchronize()


SPECS = [(20000, 64), (3000, 32), (500, 128)]
FMAP = [0, 1, 2, 0]


@cuda
@needs_cuda
@pytest.mark.parametrize("location", [EmbeddingLocation.MANAGED_CACHING, EmbeddingLocation.DEVICE])
def test_cuda_warning_check_repairs_and_counts_cached_batches_like_hbm(location):
    """WARNING on cached tables (checked by the TBE before FBGEMM's populate reads the indices, the
    offsets by the Triton repair kernel) and in HBM (fused into the kernels): a bad index reads row
    0, offsets are repaired like FBGEMM's, every repair is counted once."""
    import tbe_harness as H
    H.check_warning_repairs(_tbe(location, [(10, 4), (6, 8)], [0, 1], cache_load_factor=0.5))


@cuda
@needs_cuda
@pytest.mark.parametrize("name,kw,batch_kw,train_kw", [
    ("lru_evicting", dict(cache_load_factor=0.05), dict(zipf=1.1), {}),
    ("uniform_mostly_misses", dict(cache_load_factor=0.02), dict(zipf=None), {}),
    ("hot_rows", dict(cache_sets=4), dict(zipf=2.0), {}),
    ("lfu", dict(cache_load_factor=0.05, cache_algorithm=CacheAlgorithm.LFU), dict(zipf=1.1), {}),
    ("smaller_than_a_batch", dict(cache_sets=1), dict(zipf=1.05), {}),
    ("weighted", dict(cache_load_factor=0.05), dict(zipf=1.1), dict(weighted=True)),
    ("vbe", dict(cache_load_factor=0.05), dict(zipf=1.1, vbe=True), {}),
    ("prefetch", dict(cache_load_factor=0.05), dict(zipf=1.1), dict(prefetch=True)),
    ("prefetch_pipeline_locks", dict(cache_load_factor=0.05, prefetch_pipeline=True), dict(zipf=1.1),
     dict(pipelined=True)),
    ("prefetch_ahead_without_locks", dict(cache_load_factor=0.05), dict(zipf=1.1),
     dict(pipelined=True)),
    ("fp16", dict(cache_load_factor=0.05, precision=SparseType.FP16), dict(zipf=1.1), {}),
    # bf16 optimizer state: the state cache holds bf16 rows; same stochastic rounding everywhere.
    ("bf16_state", dict(cache_load_factor=0.05, optimizer_state_dtypes=BF16_STATES), dict(zipf=1.1), {}),
    ("bf16_linear_lfu_weighted", dict(cache_load_factor=0.05, cache_algorithm=CacheAlgorithm.LFU,
                                      optimizer_state_dtypes={"linear": SparseType.BF16}),
     dict(zipf=1.1), dict(weighted=True)),
    ("bf16_state_fp16_prefetch_pipeline", dict(cache_load_factor=0.05, precision=SparseType.FP16,
                                               prefetch_pipeline=True,
                                               optimizer_state_dtypes=BF16_STATES),
     dict(zipf=1.1), dict(pipelined=True)),
])
def test_cuda_placements_train_bitwise_equal(name, kw, batch_kw, train_kw):
    precision = kw.pop("precision", SparseType.FP32)
    states = kw.pop("optimizer_state_dtypes", None)
    dev = _tbe(EmbeddingLocation.DEVICE, SPECS, FMAP, precision=precision,
               optimizer_state_dtypes=states)
    uvm = _tbe(EmbeddingLocation.MANAGED, SPECS, FMAP, precision=precision,
               optimizer_state_dtypes=states)
    cached = _tbe(EmbeddingLocation.MANAGED_CACHING, SPECS, FMAP, precision=precision,
                  gather_uvm_cache_stats=True, optimizer_state_dtypes=states, **kw)
    if states is not None:   # the state cache holds the compact dtype
        assert cached.cache.lxu_cache_linear.dtype == torch.bfloat16 == cached.linear_dev.dtype
    _same_start([dev, uvm, cached])
    batches = _batches(12, SPECS, FMAP, B=256, L=12, seed=1, **batch_kw)
    for m in (dev, uvm, cached):
        _train(m, batches, **train_kw)
    touched = set()
    for idx, off, *_ in batches:
        touched.update(_keys(idx, off, SPECS, FMAP, batches_vbe=batch_kw.get("vbe", False)))
    # More distinct rows than cache slots: rows were evicted (dirty ones written back) on the way.
    assert len(touched) > cached.cache.slots
    _assert_bitwise(uvm, dev)
    _assert_bitwise(cached, dev)


@cuda
@needs_cuda
@pytest.mark.parametrize("accumulator,states", [("elementwise", None), ("rowwise", None), ("rowwise", BF16_STATES)],
                         ids=["elementwise-fp32", "rowwise-fp32", "rowwise-bf16"])
def test_cuda_managed_lean_layouts_train_bitwise_as_device(accumulator, states):
    """fused_uvm (MANAGED, no cache) with derived weights: the states live in unified memory and the
    same kernels update them in place, so a MANAGED table trains bit for bit as a DEVICE table of the
    same layout (Zipf ids: rows repeat within a batch)."""
    kw = dict(ftrl_weights="derived", ftrl_accumulator=accumulator, optimizer_state_dtypes=states)
    dev = _tbe(EmbeddingLocation.DEVICE, SPECS, FMAP, **kw)
    uvm = _tbe(EmbeddingLocation.MANAGED, SPECS, FMAP, **kw)
    assert uvm.weights_dev.numel() == 0 and uvm.accum_dev.numel() == (
        sum(r for r, _ in SPECS) if accumulator == "rowwise" else sum(r * d for r, d in SPECS))
    if hasattr(torch.ops.fbgemm, "is_uvm_tensor"):
        assert torch.ops.fbgemm.is_uvm_tensor(uvm.linear_dev) and torch.ops.fbgemm.is_uvm_tensor(uvm.accum_dev)
        assert not torch.ops.fbgemm.is_uvm_tensor(dev.linear_dev)
    _same_start([dev, uvm])
    start = _tables(uvm)
    batches = _batches(6, SPECS, FMAP, B=256, L=12, zipf=1.1, seed=3)
    for m in (dev, uvm):
        _train(m, batches)
    _assert_bitwise(uvm, dev)
    assert not torch.equal(_tables(uvm)[1][0][1], start[1][0][1]), "training changed no linear"


@cuda
@needs_cuda
@pytest.mark.parametrize("states", [None, "bf16"])
def test_cuda_state_dict_with_a_warm_cache_resumes_bitwise(states):
    """Save mid-run with dirty cached rows, load into a fresh cached TBE, continue: equal to the
    uninterrupted run (the save flushes; the load empties the cache). With bf16 state the saved
    ``iter`` keeps the stochastic rounding of the resumed steps equal too."""
    kw = dict(cache_load_factor=0.05, optimizer_state_dtypes=BF16_STATES if states else None)
    batches = _batches(10, SPECS, FMAP, B=256, L=12, zipf=1.1, seed=2)
    ref = _tbe(EmbeddingLocation.MANAGED_CACHING, SPECS, FMAP, **kw)
    _train(ref, batches)
    a = _tbe(EmbeddingLocation.MANAGED_CACHING, SPECS, FMAP, **kw)
    _train(a, batches[:5])
    saved = {k: v.detach().cpu().clone() for k, v in a.state_dict().items()}
    b = _tbe(EmbeddingLocation.MANAGED_CACHING, SPECS, FMAP, seed=7, **kw)
    _train(b, batches[5:7])      # b's cache is warm with other rows before the load
    b.load_state_dict(saved)
    _train(b, batches[5:])
    _assert_bitwise(b, ref)


@cuda
@needs_cuda
def test_cuda_cached_forward_matches_float64_reference():
    """One step of a cached TBE against the float64 oracle (not only against another placement)."""
    m = _tbe(EmbeddingLocation.MANAGED_CACHING, SPECS, FMAP, cache_load_factor=0.05)
    warm = _batches(3, SPECS, FMAP, B=128, L=8, zipf=1.1, seed=4)
    _train(m, warm)
    W0, S0 = _tables(m)
    idx, off, _, g_seed, _ = _batches(1, SPECS, FMAP, B=128, L=8, zipf=1.1, seed=5)[0]
    out = m(idx.cuda(), off.cuda())
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed))
    out.backward(g.cuda())
    ref = reference_update(W0, [a for a, _ in S0], [z for _, z in S0], FMAP, PoolingMode.SUM, idx, off,
                           g, reference_knobs(m.hyperparams))
    np.testing.assert_allclose(out.detach().double().cpu().numpy().reshape(-1),
                               ref.out.numpy().reshape(-1), rtol=5e-5, atol=1e-5)
    W1, S1 = _tables(m)
    for t in range(len(SPECS)):
        np.testing.assert_allclose(W1[t].double().numpy(), ref.w[t], rtol=5e-5, atol=2e-5)
        np.testing.assert_allclose(S1[t][0].double().numpy(), ref.n[t], rtol=3e-5, atol=1e-6)
        np.testing.assert_allclose(S1[t][1].double().numpy(), ref.z[t], rtol=5e-5, atol=1e-5)


def test_uvm_placements_need_cuda_and_one_location():
    specs = [(10, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        FTRLTableBatchedEmbeddingBags(specs, device="cpu")
    mixed = [(10, 4, EmbeddingLocation.MANAGED, ComputeDevice.CUDA),
             (10, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)]
    with pytest.raises(ValueError, match="for all tables"):
        FTRLTableBatchedEmbeddingBags(mixed, device="cpu")


@needs_cuda
def test_cuda_caching_refuses_what_it_cannot_honour():
    loc = EmbeddingLocation.MANAGED_CACHING
    with pytest.raises(ValueError, match="multiple of 4"):
        _tbe(loc, [(100, 6)])
    with pytest.raises(ValueError, match="cache_precision"):
        _tbe(loc, [(100, 8)], precision=SparseType.FP16, cache_precision=SparseType.FP32)
    with pytest.raises(ValueError, match="LRU"):
        _tbe(loc, [(100, 8)], cache_algorithm=CacheAlgorithm.LFU, prefetch_pipeline=True)
    with pytest.raises(ValueError, match="cache_load_factor"):
        _tbe(loc, [(100, 8)], cache_load_factor=0.0)


def _sharded_tensor_local(t):
    return (t.local_shards()[0].tensor if hasattr(t, "local_shards") else t).cpu()


def _assert_dmp_bitwise(got, want):
    """Weights (TorchRec's sharded state_dict, which flushes the caches) and FTRL states (the fused
    optimizer's, which flushes too) of two DMP models are bitwise equal."""
    a, b = got.state_dict(), want.state_dict()
    for key in b:
        assert torch.equal(_sharded_tensor_local(a[key]), _sharded_tensor_local(b[key])), key
    a, b = got.fused_optimizer.state_dict()["state"], want.fused_optimizer.state_dict()["state"]
    for key, st in b.items():
        for k, v in st.items():
            assert torch.equal(_sharded_tensor_local(a[key][k]), _sharded_tensor_local(v)), (key, k)


def _tbes(opt):
    """The TBEs behind DMP's (nested) CombinedOptimizer."""
    if hasattr(opt, "_emb_module"):
        yield opt._emb_module
    for _, sub in getattr(opt, "_optims", ()):
        yield from _tbes(sub)


class _EBCModel(torch.nn.Module):
    """EBC only; loss = sum(pooled * batch.dense_features) (a fixed output gradient per batch)."""

    def __init__(self, tables):
        super().__init__()
        import torchrec
        self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        return (pooled * batch.dense_features).sum(), pooled.detach()


@pytest.fixture
def nccl_world_of_one():
    import os

    import torch.distributed as dist

    from conftest import _free_port
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _dmp(tables, kernels, cache_params=None, **fused_params):
    import torchrec_ftrl
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec_ftrl.fbgemm_enums import EmbOptimType

    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **KNOBS, "cache_load_factor": 0.05,
                                       **fused_params})
    torch.manual_seed(0)
    model = _EBCModel(tables)
    cons = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[k],
                                         cache_params=cache_params)
            for t, k in zip(tables, kernels)}
    plan = torchrec_ftrl.ftrl_planner(Topology(world_size=1, compute_device="cuda"),
                                      constraints=cons).plan(model, sharders)
    return DistributedModelParallel(model, device=torch.device("cuda"), plan=plan, sharders=sharders)


def _kjt_batches(names, rows, steps, B=64, seed=0):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    rng = np.random.RandomState(seed)
    out = []
    for step in range(steps):
        lengths = torch.tensor(rng.randint(0, 6, len(names) * B), dtype=torch.int32)
        values = torch.cat([torch.tensor((rng.zipf(1.1, int(n)) - 1) % rows[i // B])
                            for i, n in enumerate(lengths.tolist())]).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(names, values, lengths)
        g = torch.randn(B, 32 * len(names), generator=torch.Generator().manual_seed(step))
        out.append(Batch(dense_features=g, sparse_features=kjt, labels=torch.zeros(B)))
    return out


@cuda
def test_cuda_dmp_mixed_placements_train_like_all_fused(nccl_world_of_one):
    """One GPU, three FTRL tables planned on ``fused``, ``fused_uvm`` and ``fused_uvm_caching`` (one
    TorchRec group, so torchrec_ftrl's sharder builds one TBE per table), trained on the same batches
    as the same model all on ``fused``: weights and states bitwise equal."""
    import torchrec
    names, rows = ["a", "b", "c"], [5000, 3000, 8000]
    tables = [torchrec.EmbeddingBagConfig(name=n, feature_names=[n], num_embeddings=r, embedding_dim=32)
              for n, r in zip(names, rows)]
    ref = _dmp(tables, ["fused"] * 3)
    mixed = _dmp(tables, ["fused", "fused_uvm", "fused_uvm_caching"])
    mixed.load_state_dict(ref.state_dict())
    for batch in _kjt_batches(names, rows, 8):
        batch = batch.to(torch.device("cuda"))
        for model in (ref, mixed):
            model(batch)[0].backward()
    _assert_dmp_bitwise(mixed, ref)
    kinds = {type(t).__name__ + ":" + t.embedding_specs[0][2].name for t in _tbes(mixed.fused_optimizer)}
    assert {"FTRLTableBatchedEmbeddingBags:MANAGED_CACHING", "FTRLTableBatchedEmbeddingBags:MANAGED",
            "FTRLTableBatchedEmbeddingBags:DEVICE"} <= kinds


@cuda
def test_cuda_prefetch_train_pipeline_matches_all_fused(nccl_world_of_one):
    """TorchRec's ``PrefetchTrainPipelineSparseDist`` (batch i+1 prefetched on its own stream while
    batch i trains) over ``fused_uvm_caching`` tables with ``CacheParams(prefetch_pipeline=True)``
    and a small cache: bitwise equal to ``TrainPipelineSparseDist`` over the same tables on ``fused``."""
    import torchrec
    from torchrec.distributed.train_pipeline import (PrefetchTrainPipelineSparseDist,
                                                     TrainPipelineSparseDist)
    from torchrec.distributed.types import CacheParams

    names, rows = ["a", "b"], [20000, 6000]
    tables = [torchrec.EmbeddingBagConfig(name=n, feature_names=[n], num_embeddings=r, embedding_dim=32)
              for n, r in zip(names, rows)]
    ref = _dmp(tables, ["fused"] * 2)
    cached = _dmp(tables, ["fused_uvm_caching"] * 2,
                  CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=0.02, prefetch_pipeline=True))
    cached.load_state_dict(ref.state_dict())
    tbes = list(_tbes(cached.fused_optimizer))
    assert tbes and all(t.cache is not None and t.prefetch_pipeline for t in tbes)
    batches = _kjt_batches(names, rows, 12, B=256)
    dummy = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    for model, cls in ((ref, TrainPipelineSparseDist), (cached, PrefetchTrainPipelineSparseDist)):
        pipe = cls(model, torch.optim.SGD([dummy], lr=0.0), torch.device("cuda"))
        it = iter(batches)
        done = 0
        while True:
            try:
                pipe.progress(it)
            except StopIteration:
                break
            done += 1
        assert done == len(batches)
    torch.cuda.synchronize()
    distinct = sum(len(set().union(*(b.sparse_features[n].values().tolist() for b in batches)))
                   for n in names)
    assert distinct > sum(t.cache.slots for t in tbes)      # more rows than slots: evictions happened
    _assert_dmp_bitwise(cached, ref)


def test_interp_state_cache_fill_moves_each_inserted_slot_once(interp):
    """Indices whose slot after the populate held another row before it (misses): the slot's evicted
    row goes back and the inserted row comes in, once per slot (duplicates of a row claim the slot
    once); hits (the slot held the same row) and uncached misses are left alone."""
    from torchrec_ftrl.kernels.cuda.cache import state_cache_fill_kernel

    row_base, w_off, dims = torch.tensor([0, 5]), torch.tensor([0, 5 * 4]), torch.tensor([4, 8])
    total = 5 * 4 + 7 * 8
    accum, linear = torch.arange(total, dtype=torch.float32), -torch.arange(total, dtype=torch.float32)
    row_table = torch.tensor([0] * 5 + [1] * 7, dtype=torch.int32)
    S = 8
    cache = torch.rand(2, 4, S) + 100.0
    snapshot = torch.tensor([4, 6, -1, 11])              # the slots' rows before the populate
    claim = torch.zeros(4, dtype=torch.int64)
    # rows: 8 (inserted into slot 1, twice), 0 (into empty slot 2), 4 (hit in slot 0), 9 (no slot)
    keys = torch.tensor([8, 0, 8, 4, 9])
    after = torch.tensor([1, 2, 1, 0, -1], dtype=torch.int32)
    acc0, lin0, cache0 = accum.clone(), linear.clone(), cache.clone()
    state_cache_fill_kernel[(5,)](keys, after, snapshot, claim, 7, accum, linear, cache[0], cache[1],
                                  row_table, w_off, dims, row_base, 5, S, BLOCK_D=8, ROWWISE=False)

    def flat(row):
        t = int(row_table[row])
        start = int(w_off[t]) + (row - int(row_base[t])) * int(dims[t])
        return slice(start, start + int(dims[t])), int(dims[t])

    exp_acc, exp_lin, exp_cache = acc0.clone(), lin0.clone(), cache0.clone()
    sl, D = flat(6)                                       # slot 1's evicted row written back
    exp_acc[sl], exp_lin[sl] = cache0[0, 1, :D], cache0[1, 1, :D]
    for slot, new in ((1, 8), (2, 0)):                    # inserted rows loaded
        sl, D = flat(new)
        exp_cache[0, slot, :D], exp_cache[1, slot, :D] = acc0[sl], lin0[sl]
    assert torch.equal(accum, exp_acc) and torch.equal(linear, exp_lin)
    assert torch.equal(cache, exp_cache)
    assert claim.tolist() == [0, 7, 7, 0]


# ------------------------------------------------------------------ CPU: byte model, TBE cache flow
@pytest.mark.parametrize("states,dtypes", [
    (None, (torch.float32, torch.float32)),                      # fp32 accum + fp32 linear
    ({"accum": SparseType.BF16, "linear": SparseType.BF16}, (torch.bfloat16, torch.bfloat16)),
    ({"linear": SparseType.BF16}, (torch.float32, torch.bfloat16)),
])
@pytest.mark.parametrize("lfu,lock", [(False, False), (False, True), (True, False)])
def test_row_cache_allocates_what_the_byte_model_counts(lfu, lock, states, dtypes):
    """The buffers RowCache allocates (on CPU here) equal placement.cache_bytes plus the small
    per-table / per-feature arrays and the statistics, counted here from their definitions; the
    state caches hold the state dtypes (bf16: half the bytes)."""
    from torchrec_ftrl.tbe.cache import RowCache
    from torchrec_ftrl.tbe.placement import cache_bytes, cache_slots
    from torchrec_ftrl.row_layout import RowLayout
    rows, dims, fmap = [4000, 1000], [128, 16], [0, 1, 1]
    algorithm = CacheAlgorithm.LFU if lfu else CacheAlgorithm.LRU
    c = RowCache(rows, dims, fmap, torch.tensor([0, 4000 * 128]), torch.float16, 0.2, 0, algorithm,
                 lock, 0.0, False, torch.device("cpu"),
                 layout=RowLayout(accum_dtype=dtypes[0], linear_dtype=dtypes[1]))
    assert (c.lxu_cache_accum.dtype, c.lxu_cache_linear.dtype) == dtypes
    allocated = sum(b.numel() * b.element_size() for b in c.buffers())
    slots = cache_slots(sum(rows), 0.2)
    assert c.slots == slots == 1024                        # ceil(floor(5000 * 0.2) / 32) sets of 32
    T, F = len(rows), len(fmap)
    small = (8 * (F + 1) + 8 * (T + 1) + 8 * T + 4 * (T + 1) + 8 * T   # cumsums, offsets, dims
             + 6 * 8 + 6 * 4 + (8 if lfu else 0))                      # statistics; LFU's extra row
    assert allocated - cache_bytes(sum(rows), max(dims), slots, lfu, 2, lock,
                                   layout=RowLayout(accum_dtype=dtypes[0], linear_dtype=dtypes[1])) == small


def test_byte_model_counts_state_bytes_by_dtype():
    """A D=128 row with fp32 weights moves 128 x (4 + 4 + 4) = 1536 bytes with fp32 state and
    128 x (4 + 2 + 2) = 1024 with bf16 state; the table bytes count the same per element."""
    from torchrec_ftrl.tbe.placement import cache_bytes, table_bytes
    from torchrec_ftrl.row_layout import RowLayout
    from torchrec_ftrl.state_dtype import parse_state_dtypes, state_bytes_per_element
    dtypes = parse_state_dtypes({"accum": SparseType.BF16, "linear": "bf16"})
    assert state_bytes_per_element(parse_state_dtypes(None)) == 8 and state_bytes_per_element(dtypes) == 4
    bf16 = RowLayout(accum_dtype=dtypes["accum"], linear_dtype=dtypes["linear"])
    assert table_bytes(1, 128, 4, EmbeddingLocation.MANAGED_CACHING) == 1536
    assert table_bytes(1, 128, 4, EmbeddingLocation.MANAGED_CACHING, layout=bf16) == 1024
    # one slot, no rows: the per-slot bytes (row of weights + states, then 40 bytes of LRU state)
    assert cache_bytes(0, 128, 1) - cache_bytes(0, 128, 1, layout=bf16) == 512


class _FakeRowCache(torch.nn.Module):
    """Stands in for RowCache on CPU (FBGEMM's cache ops are CUDA-only): caches nothing (every slot
    -1, so the TBE reads and updates the flat buffers) and records the calls."""

    def __init__(self, lock_lines):
        super().__init__()
        self.lock_lines = lock_lines
        self.calls = []
        self.register_buffer("lxu_cache_weights", torch.zeros(1, 8))
        self.register_buffer("lxu_cache_states", torch.zeros(2, 1, 8))
        self._n = 0
        self.generation = 0

    def linearize(self, indices, offsets, bags=None):
        self.calls.append(("linearize", indices.numel()))
        return indices.clone()

    def _slots(self, keys, tag):
        self._n += 1
        slots = torch.full((keys.numel(),), -1, dtype=torch.int32)
        slots.tag = (tag, self._n)
        return slots

    def populate(self, keys, *buffers):
        self.calls.append(("populate", keys.numel()))
        self.generation += 1
        return self._slots(keys, "populate")

    def lookup(self, keys, count=True):
        self.calls.append(("lookup", keys.numel(), count))
        return self._slots(keys, "lookup")

    def unlock(self, slots):
        self.calls.append(("unlock", slots.tag))

    def flush(self, *buffers):
        self.calls.append(("flush",))

    def reset(self):
        self.calls.append(("reset",))
        self.generation += 1

    def reset_states(self, value):
        pass


def _flat_rows(op):
    """``op`` (``tbe_forward`` / ``tbe_backward_update_`` of the CPU backend, whose kernels take no
    cache) for a batch of :class:`_FakeRowCache`: every slot is -1 (asserted), so the rows are read
    and updated in the flat buffers and the cache arguments (the schemas' last four) are dropped."""
    def call(*args):
        locations = args[-4]
        assert locations is None or bool((locations == -1).all()), "the fake cache holds no row"
        return op(*args[:-4], None, None, None, None)
    return call


def _fake_cache_backend(backend):
    """``backend`` (the CPU one) as the TBE's calls see it with :class:`_FakeRowCache`: its layouts
    run "cached" (``calls`` refuses a cached batch otherwise), the kernels on the flat buffers."""
    ops = dataclasses.replace(backend.ops, forward=_flat_rows(backend.ops.forward),
                              backward_update_=_flat_rows(backend.ops.backward_update_))
    capabilities = dataclasses.replace(backend.capabilities, cached_layouts=backend.capabilities.layouts)
    return dataclasses.replace(backend, ops=ops, capabilities=capabilities)


def _cpu_tbes(lock):
    ref = FTRLTableBatchedEmbeddingBags([(50, 8), (45, 8)], device="cpu", **KNOBS)
    m = FTRLTableBatchedEmbeddingBags([(50, 8), (45, 8)], device="cpu", **KNOBS)
    m.load_state_dict(ref.state_dict())
    m.cache = _FakeRowCache(lock)
    m._backend = _fake_cache_backend(m._backend)
    m.prefetch_pipeline = lock
    return ref, m


def _step(m, idx, off, g, backward=True):
    out = m(idx, off)
    if backward:
        out.backward(g)
    return out


@pytest.mark.parametrize("lock", [False, True])
def test_cached_flow_populates_once_and_releases_after_the_update(lock):
    """Forward: linearize + populate (its slots serve the update too: nothing moved the rows since);
    the update then releases the batch's lines."""
    ref, m = _cpu_tbes(lock)
    idx, off = torch.tensor([1, 2, 2, 40, 7, 3]), torch.tensor([0, 2, 3, 5, 6])
    g = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    want = _step(ref, idx, off, g)
    assert torch.equal(_step(m, idx, off, g), want)
    names = [c[0] for c in m.cache.calls]
    assert names == ["linearize", "populate", "unlock"]
    assert m.cache.calls[2][1] == ("populate", 1)
    for a, b in zip(m.split_embedding_weights(), ref.split_embedding_weights()):
        assert torch.equal(a, b)


def test_cached_flow_looks_up_again_when_a_populate_came_between():
    """A prefetch (populate) of the next batch between a forward and its update may have moved rows:
    the update looks its rows up again (uncounted) and releases its own lines."""
    ref, m = _cpu_tbes(True)
    idx, off = torch.tensor([1, 2, 2, 40, 7, 3]), torch.tensor([0, 2, 3, 5, 6])
    g = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    want = _step(ref, idx, off, g)
    out = m(idx, off)
    m.prefetch(torch.tensor([5, 6]), torch.tensor([0, 1, 1, 2, 2]))
    out.backward(g)
    assert torch.equal(out, want)
    names = [c[0] for c in m.cache.calls]
    assert names == ["linearize", "populate", "linearize", "populate", "lookup", "unlock"]
    assert m.cache.calls[4][2] is False and m.cache.calls[5][1] == ("populate", 1)
    for a, b in zip(m.split_embedding_weights(), ref.split_embedding_weights()):
        assert torch.equal(a, b)


def test_cached_flow_takes_the_prefetched_batch_and_tolerates_a_stale_one():
    ref, m = _cpu_tbes(True)
    idx, off = torch.tensor([1, 2, 2, 40, 7, 3]), torch.tensor([0, 2, 3, 5, 6])
    other_idx, other_off = torch.tensor([5, 6]), torch.tensor([0, 1, 1, 2, 2])
    g = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    m.prefetch(other_idx, other_off)          # a prefetch of another batch, left over
    m.cache.calls.clear()
    out = _step(m, idx, off, g)
    want = _step(ref, idx, off, g)
    assert torch.equal(out, want)             # rows read where they are, not at the stale slots
    names = [c[0] for c in m.cache.calls]
    assert names == ["linearize", "lookup", "unlock"]      # no populate: the queue had one
    assert m.cache.calls[-1][1][0] == "populate"                      # the prefetch's lines released
    assert m._cached.prefetched == []
    for a, b in zip(m.split_embedding_weights(), ref.split_embedding_weights()):
        assert torch.equal(a, b)


def test_cached_flow_releases_lines_at_once_without_an_update():
    _, m = _cpu_tbes(True)
    idx, off = torch.tensor([1, 2, 40]), torch.tensor([0, 2, 3])
    with torch.no_grad():
        m(idx, off)
    assert [c[0] for c in m.cache.calls] == ["linearize", "populate", "unlock"]
    m.cache.calls.clear()
    m.eval()                                  # grad enabled, eval mode: no update is expected
    out = m(idx, off)
    assert [c[0] for c in m.cache.calls] == ["linearize", "populate", "unlock"]   # before the update
    out.sum().backward()
    assert [c[0] for c in m.cache.calls] == ["linearize", "populate", "unlock"]


def test_prefetch_refuses_its_own_stream_without_locks_and_skips_what_it_cannot_lay_out():
    _, m = _cpu_tbes(False)
    with pytest.raises(ValueError, match="prefetch_pipeline=True"):
        m.prefetch(torch.tensor([1]), torch.tensor([0, 1, 1]), forward_stream=object())
    m.prefetch(torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]))     # 3 bags for 2 features: VBE
    assert m.cache.calls == [] and m._cached.prefetched == []
    m.prefetch(torch.tensor([99, 2]), torch.tensor([0, 1, 2]))       # out of range: read as row 0
    assert m.cache.calls[0] == ("linearize", 2) and int(m.bounds_check_warning) == 0
    m.reset_cache_states()
    assert m._cached.prefetched == [] and m.cache.calls[-1] == ("reset",)


def test_cached_flow_populates_a_vbe_batch_again_and_releases_both():
    """TorchRec prefetches a VBE batch without its batch sizes: the forward populates for the real
    layout and the update releases the prefetch's lines and its own."""
    ref, m = _cpu_tbes(True)
    idx, off = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3, 4, 4])
    bsfpr = [[3], [1]]                                    # 3 bags of feature 0, 1 of feature 1
    m.prefetch(idx, off)                                   # as TorchRec's pooled lookup does
    m.cache.calls.clear()
    g = torch.randn(3 * 8 + 1 * 8, generator=torch.Generator().manual_seed(1))
    out = m(idx, off, batch_size_per_feature_per_rank=bsfpr)
    out.backward(g)
    want = ref(idx, off, batch_size_per_feature_per_rank=bsfpr)
    want.backward(g)
    assert torch.equal(out, want)
    names = [c[0] for c in m.cache.calls]
    assert names == ["linearize", "populate", "unlock", "unlock"]
    assert {m.cache.calls[2][1][0], m.cache.calls[3][1][0]} == {"populate"}
    assert m.cache.calls[2][1] != m.cache.calls[3][1]      # the prefetch's slots, then the forward's


def test_a_prefetch_on_its_own_stream_waits_for_the_forwards_cache_work(monkeypatch):
    """TorchRec's prefetch pipeline issues batch i+1's prefetch (its stream) after batch i's forward
    (the default stream), and the two may run at once on the GPU. The cache's bookkeeping takes one
    lookup or populate at a time, so the prefetch's stream first waits for an event recorded on the
    default stream after the forward's lookup (its populate for a VBE batch), and for nothing later
    of that forward; the prefetched slots, made on the prefetch stream, are recorded as used on the
    forward's. Streams and events are stand-ins that log into the fake cache's calls."""
    ref, m = _cpu_tbes(True)
    log = m.cache.calls

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.recorded_on))

    class Event:
        def record(self):
            self.recorded_on = current[0].name
            log.append(("record", self.recorded_on))

    default, side = Stream("default"), Stream("prefetch")
    current = [default]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append(("record_stream", stream.name)))

    def prefetch(idx, off):
        current[0] = side
        m.prefetch(idx, off, forward_stream=default)
        current[0] = default

    batches = [(torch.tensor([1, 2, 2, 40, 7, 3]), torch.tensor([0, 2, 3, 5, 6])),
               (torch.tensor([5, 6, 9]), torch.tensor([0, 1, 2, 2, 3]))]
    g = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    prefetch(*batches[0])
    log.clear()
    out = m(*batches[0])
    prefetch(*batches[1])                 # before batch 0's backward, as the pipeline issues it
    out.backward(g)
    want = _step(ref, *batches[0], g)
    assert torch.equal(out, want)
    ops = [c[:2] if c[0] in ("linearize", "populate", "lookup") else c for c in log]
    assert ops[:8] == [("linearize", 6), ("wait_stream", "default", "prefetch"),
                       ("record_stream", "default"),   # the prefetched slots, used on this stream
                       ("lookup", 6), ("record", "default"), ("wait_event", "prefetch", "default"),
                       ("linearize", 3), ("populate", 3)]
    assert [c for c in ops[8:] if c[0] in ("record", "wait_event")] == []   # the backward: no event
    for a, b in zip(m.split_embedding_weights(), ref.split_embedding_weights()):
        assert torch.equal(a, b)
    log.clear()                           # a VBE forward populates: the event follows its populate
    out = m(*batches[1], batch_size_per_feature_per_rank=[[3], [1]])
    prefetch(*batches[0])
    ops = [c[:2] if c[0] in ("linearize", "populate", "lookup") else c for c in log]
    assert ops[:7] == [("linearize", 3), ("wait_stream", "default", "prefetch"),
                       ("record_stream", "default"), ("populate", 3), ("record", "default"),
                       ("wait_event", "prefetch", "default"), ("linearize", 6)]
    log.clear()                           # a reset (after a load) waits for the prefetch, and back
    m.reset_cache_states()
    assert log == [("wait_stream", "default", "prefetch"), ("reset",),
                   ("wait_stream", "prefetch", "default")]
