"""Every row layout under the UVM-caching placement (``fused_uvm_caching``): the HBM cache holds
exactly the layout's arrays (no weight for derived weights, one ``accum`` value per slot when
row-wise), and the kernels read and update a cached row there.

* Interpreter (CI, ``TRITON_INTERPRET=1`` child pytest): the Triton backend's ops' calls on a cache
  laid out by hand (FBGEMM's cache ops are CUDA-only), whose unified-memory copies of the cached rows
  hold other values: each step's output and the logical tables (cache copy where cached) against the
  same layout uncached, bit for bit, and against the float64 oracle (``tests/reference.py``, through
  ``test_layouts_triton``'s helpers); the state-cache moves of a row-wise ``accum``; the cache's
  allocation per layout against the byte model.
* ``cuda``: FBGEMM's cache ops. A cached TBE at a small load factor (evictions of dirty rows every
  step) against the same layout in HBM, several steps, bitwise (outputs, weights, states); the
  derived table's weight reads and writes, resets and a ``state_dict`` round trip with a warm cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import bits, cuda, interpreter_parent, needs_cuda, run_interpreter_suite
from test_cache import nccl_world_of_one  # noqa: F401  (the fixture)

pytest.importorskip("triton")

from reference import reference_knobs  # noqa: E402
from test_layouts_triton import (LAYOUTS, Case, Tables, backend_stepper, batch_maker,  # noqa: E402
                                 check_against_oracle, copy_arrays, oracle_step, random_batch,
                                 start_arrays)
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags  # noqa: E402
from torchrec_ftrl.fbgemm_enums import (BoundsCheckMode, CacheAlgorithm, ComputeDevice,  # noqa: E402
                                        EmbeddingLocation, SparseType)
from torchrec_ftrl.kernels.pytorch import index_rows  # noqa: E402
from torchrec_ftrl.kernels.cuda import backend as triton_backend  # noqa: E402
from torchrec_ftrl.kernels.batch import TableArrays  # noqa: E402
from torchrec_ftrl.row_layout import RowLayout  # noqa: E402

KNOBS = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3)
DTYPES = [torch.float32, torch.bfloat16]


@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


# ------------------------------------------------------------------ interpreter: the kernels
class HandCache:
    """Half of all rows in a cache laid out by hand: slots in random order, a row stride wider than
    the widest D, the layout's arrays only. The unified-memory copies of the cached rows are set to
    values no cached row holds, so a kernel that reads or writes the wrong copy fails."""

    def __init__(self, case: Case, geo: Tables, arrays: TableArrays, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.case, self.geo, self.arrays = case, geo, arrays
        total_rows = int(geo.row_base[-1])
        keys = rng.permutation(total_rows)[: total_rows // 2]
        slots, S = len(keys) + 3, max(d for _, d in case.specs) + 3
        self.slot_of = dict(zip(keys.tolist(), rng.permutation(slots)[: len(keys)].tolist()))
        w = arrays.weights
        self.w = (torch.full((slots, S), 7.0, dtype=w.dtype) if w is not None
                  else torch.zeros(slots, 0))
        self.n = torch.full((slots, 1 if case.rowwise else S), 9.0, dtype=arrays.accum.dtype)
        self.z = torch.full((slots, S), 11.0, dtype=arrays.linear.dtype)
        for key, slot in self.slot_of.items():
            for flat, cache, rowwise in self._pairs(key):
                sl = self._flat(key, rowwise)
                cache[slot, :sl.stop - sl.start] = flat[sl]
                flat[sl] = 3.0 if flat is not arrays.accum else 5.0
        self.flat_cached = copy_arrays(arrays)

    def _pairs(self, key):
        a = self.arrays
        pairs = [(a.accum, self.n, self.case.rowwise), (a.linear, self.z, False)]
        return pairs + ([(a.weights, self.w, False)] if a.weights is not None else [])

    def _flat(self, key: int, rowwise: bool) -> slice:
        """The elements of row ``key`` in a flat buffer (one value at the key when ``rowwise``)."""
        if rowwise:
            return slice(key, key + 1)
        t = int(np.searchsorted(self.geo.row_base, key, side="right") - 1)
        D = self.case.specs[t][1]
        start = int(self.geo.w_offset[t]) + (key - int(self.geo.row_base[t])) * D
        return slice(start, start + D)

    def batch(self, batch):
        keys = self.geo.row_base[batch.index_table().numpy()] + batch.indices.numpy()
        loc = torch.tensor([self.slot_of.get(int(k), -1) for k in keys], dtype=torch.int32)
        return dataclasses.replace(batch, cache_locations=loc, cache_weights=self.w,
                                   cache_states=(self.n, self.z))

    def logical(self) -> TableArrays:
        """The tables as the layout sees them: each cached row's cache copy, the others' flat ones."""
        out = copy_arrays(self.arrays)
        for key, slot in self.slot_of.items():
            for flat, cache, rowwise in self._pairs(key):
                sl = self._flat(key, rowwise)
                getattr(out, _name(self.arrays, flat))[sl] = cache[slot, :sl.stop - sl.start]
        return out

    def assert_flat_copies_untouched(self) -> None:
        for key in self.slot_of:
            for flat, _, rowwise in self._pairs(key):
                name, sl = _name(self.arrays, flat), self._flat(key, rowwise)
                assert torch.equal(bits(flat[sl]), bits(getattr(self.flat_cached, name)[sl])), \
                    f"the unified-memory copy of cached row {key}'s {name} changed"


def _name(arrays: TableArrays, flat: torch.Tensor) -> str:
    return next(n for n in ("weights", "accum", "linear") if getattr(arrays, n) is flat)


def _assert_same_bits(a: TableArrays, b: TableArrays, what: str) -> None:
    for name in ("weights", "accum", "linear"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(bits(x), bits(y)), f"{what}: {name} differs from the uncached layout"


@pytest.mark.parametrize("state_dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_cached_layout_trains_like_uncached(interp, weights, accumulator, state_dtype):
    """Two steps (hot rows: long runs cut into pieces and combined; per-sample weights, MEAN) of
    the cached path and of the same layout uncached from the same logical start: outputs and the
    logical tables bit for bit equal, the updated rows against the float64 oracle, and the
    unified-memory copies of cached rows never touched."""
    from torchrec_ftrl.fbgemm_enums import PoolingMode
    case = Case(weights, accumulator, state_dtype, pooling=PoolingMode.MEAN, psw=True, hot=True, seed=4, steps=2)
    geo = Tables(case.specs)
    m = batch_maker(case, "cpu")
    hp = m.hyperparams
    start = start_arrays(case, geo, "cpu")
    plain, plain_step = backend_stepper(triton_backend, copy_arrays(start), hp, case)
    cache = HandCache(case, geo, copy_arrays(start), seed=5)
    _, cached_step = backend_stepper(triton_backend, cache.arrays, hp, case)
    rng = np.random.default_rng(case.seed)
    for step in range(case.steps):
        indices, offsets, psw = random_batch(case, rng, "cpu")
        batch = m._make_batch(indices, offsets, psw, None)
        grad = torch.randn(batch.out_numel, generator=torch.Generator().manual_seed(50 + step))
        before = cache.logical()
        ref = oracle_step(case, geo, before, indices, offsets, psw, grad, reference_knobs(hp))
        out, _ = cached_step(cache.batch(batch), grad, step)
        out_plain, _ = plain_step(batch, grad, step)
        what = f"{weights}/{accumulator}/{state_dtype} cached step {step}"
        assert torch.equal(bits(out), bits(out_plain)), f"{what}: output"
        after = cache.logical()
        _assert_same_bits(after, plain, what)
        check_against_oracle(case, geo, before, after, ref, what)
        cache.assert_flat_copies_untouched()


EMU_SPECS = [(60, 8), (40, 4)]
EMU_FMAP = [0, 1, 0]


def _emulated_pair(weights, accumulator, state_dtype):
    """``(uncached, cached)`` Triton TBEs on the CPU from the same start; the second with a
    :class:`~torchrec_ftrl.tbe.cache.RowCache` of one set (32 slots for 100 rows) on FBGEMM's emulated
    ops (``cache_ops_emulation``)."""
    from torchrec_ftrl.tbe.cache import RowCache
    kw = dict(feature_table_map=EMU_FMAP, device="cpu", backend="triton", ftrl_weights=weights,
              ftrl_accumulator=accumulator, ftrl_initial_accumulator_value=0.1,
              optimizer_state_dtypes={"accum": state_dtype, "linear": state_dtype}, **KNOBS)
    torch.manual_seed(0)
    plain = FTRLTableBatchedEmbeddingBags(EMU_SPECS, **kw)
    cached = FTRLTableBatchedEmbeddingBags(EMU_SPECS, **kw)
    cached.load_state_dict(plain.state_dict())
    cached.cache = RowCache([r for r, _ in EMU_SPECS], [d for _, d in EMU_SPECS], EMU_FMAP,
                            cached._table_w_offset, torch.float32, 0.2, 1, CacheAlgorithm.LRU, False, 0.0,
                            False, torch.device("cpu"), layout=cached.row_layout)
    cached.cache.reset_states(0.1)
    return plain, cached


def _emu_step(m, rng, k):
    bags = 3 * len(EMU_FMAP)
    lengths = rng.integers(1, 6, bags)
    idx = np.concatenate([rng.integers(0, EMU_SPECS[EMU_FMAP[b // 3]][0], n) for b, n in enumerate(lengths)])
    out = m(torch.tensor(idx, dtype=torch.int64), torch.tensor(np.concatenate([[0], np.cumsum(lengths)])))
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(k)))
    return out.detach()


def _assert_tbes_bitwise(a, b, what):
    for x, y in zip(a.split_optimizer_states(), b.split_optimizer_states()):
        assert torch.equal(bits(x[0]), bits(y[0])) and torch.equal(bits(x[1]), bits(y[1])), f"{what}: states"
    for t in range(len(a.embedding_specs)):
        assert torch.equal(bits(a.derived_weights(t)), bits(b.derived_weights(t))), f"{what}: weights"


@pytest.mark.parametrize("weights,accumulator,state_dtype", [
    ("stored", "rowwise", torch.bfloat16), ("derived", "elementwise", torch.bfloat16),
    ("derived", "rowwise", torch.float32)])
def test_interp_cached_tbe_trains_reads_writes_and_resets_like_uncached(interp, monkeypatch, weights,
                                                                        accumulator, state_dtype):
    """A whole cached TBE (RowCache, the state-cache moves, the TBE's cached flow) on FBGEMM's
    emulated cache ops, against the same layout uncached: outputs bit for bit over steps that evict
    written rows; then weights read through a written cache, a row write (``load_weights``) and a
    reset (``reset_embedding_weight_momentum``) followed by training, and the tables bit for bit."""
    import cache_ops_emulation
    cache_ops_emulation.install(monkeypatch)
    plain, cached = _emulated_pair(weights, accumulator, state_dtype)
    assert cached.cache.lxu_cache_weights.shape[1] == (0 if weights == "derived" else 8)
    rngs = [np.random.default_rng(3), np.random.default_rng(3)]
    for k in range(3):
        assert torch.equal(bits(_emu_step(cached, rngs[0], k)), bits(_emu_step(plain, rngs[1], k))), f"step {k}"
    assert cached.cache.written and cache_ops_emulation.COUNTS["evicted"] > 10   # written rows went back
    for t in range(len(EMU_SPECS)):   # read through the written cache
        assert torch.equal(bits(cached.derived_weights(t)), bits(plain.derived_weights(t)))
    for m, rng in zip((cached, plain), rngs):
        _emu_step(m, rng, 10)                          # the cache written again
    # Rows held by the cache now (keys: table 0 rows, then table 1 rows from 60), and one that is not.
    keys = sorted(cached.cache.lxu_cache_state.view(-1).tolist())
    rows0 = [k for k in keys if 0 <= k < 60][:4] + [next(r for r in range(60) if r not in keys)]
    rows1 = [k - 60 for k in keys if k >= 60][:3] + [next(r for r in range(40) if r + 60 not in keys)]
    assert len(rows0) == 5 and len(rows1) == 4
    w = torch.rand(5, EMU_SPECS[0][1]) * 0.02 - 0.01
    for m, rng in zip((cached, plain), rngs):
        m.load_weights(0, w, row_ids=torch.tensor(rows0))
        _emu_step(m, rng, 11)
        m.reset_embedding_weight_momentum(torch.tensor(rows1), torch.tensor([0, 4]),
                                          torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
        _emu_step(m, rng, 12)
    _assert_tbes_bitwise(cached, plain, f"{weights}/{accumulator}/{state_dtype}")


@pytest.mark.parametrize("weights", ["stored", "derived"])
def test_interp_kernel_warm_up_restores_a_cached_tbe_bitwise(interp, monkeypatch, weights):
    """The job's kernel warm-up (``job.warmup``: snapshot, a training step, restore) on a cached TBE
    whose cache holds written rows: afterwards its weights, states and step counter are bit for bit
    those of the same TBE without the warm-up (every row of EMU_SPECS is below WARMUP_ROWS)."""
    import cache_ops_emulation
    from torchrec_ftrl.job import warmup
    cache_ops_emulation.install(monkeypatch)
    plain, cached = _emulated_pair(weights, "rowwise", torch.float32)
    assert max(r for r, _ in EMU_SPECS) <= warmup.WARMUP_ROWS
    for m in (cached, plain):
        _emu_step(m, np.random.default_rng(3), 0)
    snap = warmup._snapshot(cached)
    _emu_step(cached, np.random.default_rng(9), 1)      # the warm-up's step: rows written in the cache
    assert cached.cache.written
    warmup._restore(cached, snap)
    assert torch.equal(cached.iter, plain.iter)
    for a, b in zip(cached.split_embedding_weights(), plain.split_embedding_weights()):
        assert torch.equal(bits(a[:]), bits(b[:])), "weights"
    _assert_tbes_bitwise(cached, plain, weights)
    for m in (cached, plain):                           # and they train on alike
        out = _emu_step(m, np.random.default_rng(4), 2)
    _assert_tbes_bitwise(cached, plain, f"{weights}, one step later")


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_per_sample_weight_gradient_reads_cached_rows(weights, accumulator):
    """The gradient of trainable per-sample weights (``index_rows.per_sample_weight_grad``, PyTorch
    code the TBE runs for every backend, the Triton one included) reads a cached row's weight in the
    cache: the weight cache's, or ``prox`` of the cached ``linear`` and ``accum``; bit for bit the
    gradient of the same tables uncached."""
    case = Case(weights, accumulator, psw=True, seed=6)
    geo = Tables(case.specs)
    m = batch_maker(case, "cpu")
    start = start_arrays(case, geo, "cpu")
    cache = HandCache(case, geo, copy_arrays(start), seed=7)
    indices, offsets, psw = random_batch(case, np.random.default_rng(6), "cpu")
    batch = m._make_batch(indices, offsets, psw, None)
    grad = torch.randn(batch.out_numel, generator=torch.Generator().manual_seed(6))
    got = index_rows.per_sample_weight_grad(cache.arrays, cache.batch(batch), grad, m.hyperparams)
    want = index_rows.per_sample_weight_grad(start, batch, grad, m.hyperparams)
    assert got.abs().sum() > 0 and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("kernel", ["fill", "follow"])
def test_interp_state_cache_moves_a_rowwise_accum_with_its_row(interp, kernel):
    """Row-wise ``accum`` (one value per row at its row key, cached at ``cn[slot, 0]``): a slot that
    changes rows writes the old row's value back and loads the new one's, with the row's ``linear``."""
    from torchrec_ftrl.kernels.cuda.cache import state_cache_fill_kernel, state_cache_follow_kernel
    row_base, w_off, dims = torch.tensor([0, 5]), torch.tensor([0, 5 * 4]), torch.tensor([4, 8])
    total, rows = 5 * 4 + 7 * 8, 12
    accum = torch.arange(rows, dtype=torch.float32) + 0.5
    linear = -torch.arange(total, dtype=torch.float32)
    row_table = torch.tensor([0] * 5 + [1] * 7, dtype=torch.int32)
    S = 8
    cn, cz = torch.rand(4, 1) + 100.0, torch.rand(4, S) + 200.0
    before = torch.tensor([4, 6, -1, 11])                      # the slots' rows
    acc0, lin0, cn0, cz0 = accum.clone(), linear.clone(), cn.clone(), cz.clone()
    if kernel == "fill":   # rows 8 (into slot 1, twice: evicts 6), 0 (empty slot 2), 4 (a hit)
        keys, after = torch.tensor([8, 0, 8, 4]), torch.tensor([1, 2, 1, 0], dtype=torch.int32)
        state_cache_fill_kernel[(4,)](keys, after, before, torch.zeros(4, dtype=torch.int64), 7, accum,
                                      linear, cn, cz, row_table, w_off, dims, row_base, 4, S,
                                      BLOCK_D=8, ROWWISE=True)
        out_, in_ = [(1, 6)], [(1, 8), (2, 0)]
    else:                  # flush: every cached row back, none loaded
        state_cache_follow_kernel[(2,)](before, torch.full_like(before, -1), accum, linear, cn, cz,
                                        row_table, w_off, dims, row_base, 4, S, SLOTS=2, BLOCK_D=8,
                                        ROWWISE=True)
        out_, in_ = [(0, 4), (1, 6), (3, 11)], []

    def flat(row):
        t = int(row_table[row])
        start = int(w_off[t]) + (row - int(row_base[t])) * int(dims[t])
        return slice(start, start + int(dims[t])), int(dims[t])

    exp_acc, exp_lin, exp_cn, exp_cz = acc0.clone(), lin0.clone(), cn0.clone(), cz0.clone()
    for slot, old in out_:
        sl, D = flat(old)
        exp_acc[old], exp_lin[sl] = cn0[slot, 0], cz0[slot, :D]
    for slot, new in in_:
        sl, D = flat(new)
        exp_cn[slot, 0], exp_cz[slot, :D] = acc0[new], lin0[sl]
    assert torch.equal(accum, exp_acc) and torch.equal(linear, exp_lin)
    assert torch.equal(cn, exp_cn) and torch.equal(cz, exp_cz)


# ------------------------------------------------------------------ CPU: what a slot holds
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_row_cache_holds_the_layouts_arrays(weights, accumulator):
    """RowCache (on CPU here) per layout: no weight cache and zero-width FBGEMM rows for derived
    weights, one ``accum`` value per slot when row-wise; its buffers' bytes equal the byte model
    (``placement.cache_bytes`` with the layout) plus the small per-table arrays, counted here."""
    from torchrec_ftrl.tbe.cache import RowCache
    from torchrec_ftrl.tbe.placement import cache_bytes
    rows, dims, fmap = [4000, 1000], [128, 16], [0, 1, 1]
    layout = RowLayout(weights, accumulator, torch.bfloat16, torch.float32)
    c = RowCache(rows, dims, fmap, torch.tensor([0, 4000 * 128]), torch.float16, 0.2, 0,
                 CacheAlgorithm.LRU, False, 0.0, False, torch.device("cpu"), layout=layout)
    derived = weights == "derived"
    assert tuple(c.lxu_cache_weights.shape) == (c.slots, 0 if derived else 128)
    assert tuple(c.lxu_cache_accum.shape) == (c.slots, 1 if accumulator == "rowwise" else 128)
    assert c.lxu_cache_accum.dtype == torch.bfloat16 and tuple(c.lxu_cache_linear.shape) == (c.slots, 128)
    assert c.D_offsets.tolist() == ([0, 0, 0] if derived else [0, 128, 144])
    allocated = sum(b.numel() * b.element_size() for b in c.buffers())
    T, F = len(rows), len(fmap)
    small = (8 * (F + 1) + 8 * (T + 1) + 8 * T + 4 * (T + 1) + 8 * T   # cumsums, offsets, dims
             + 6 * 8 + 6 * 4 + (4 if derived else 0))                   # statistics; FBGEMM's stand-in
    assert allocated - cache_bytes(sum(rows), max(dims), c.slots, False, 2, False, layout=layout) == small


# ------------------------------------------------------------------ CUDA: FBGEMM's cache ops
CUDA_SPECS = [(6000, 64), (1500, 32)]
CUDA_FMAP = [0, 1, 0]


@cuda
def test_cuda_dmp_lean_layout_on_fused_uvm_caching_trains_like_fused(nccl_world_of_one):
    """TorchRec's DMP, one GPU: two tables with derived weights and a row-wise bf16 ``accum``
    (``fused_params``) planned on ``fused_uvm_caching`` (5% of the rows cached) against the same
    model on ``fused``, 8 Zipf steps: TorchRec's state_dict (weights) and the fused optimizer's
    states bit for bit."""
    import torchrec
    from test_cache import _assert_dmp_bitwise, _dmp, _kjt_batches
    names, rows = ["a", "b"], [5000, 3000]
    tables = [torchrec.EmbeddingBagConfig(name=n, feature_names=[n], num_embeddings=r, embedding_dim=32)
              for n, r in zip(names, rows)]
    layout = dict(ftrl_weights="derived", ftrl_accumulator="rowwise", ftrl_initial_accumulator_value=0.1,
                  optimizer_state_dtypes={"accum": SparseType.BF16, "linear": SparseType.BF16})
    ref = _dmp(tables, ["fused"] * 2, **layout)
    cached = _dmp(tables, ["fused_uvm_caching"] * 2, **layout)
    _assert_dmp_bitwise(cached, ref)   # the same initialisation (same seed): z and n bit for bit
    for batch in _kjt_batches(names, rows, 8):
        batch = batch.to(torch.device("cuda"))
        for model in (ref, cached):
            model(batch)[0].backward()
    _assert_dmp_bitwise(cached, ref)


def _tbe(location, weights, accumulator, states, **kw):
    return FTRLTableBatchedEmbeddingBags(
        [(r, d, location, ComputeDevice.CUDA) for r, d in CUDA_SPECS], feature_table_map=CUDA_FMAP,
        device="cuda", bounds_check_mode=BoundsCheckMode.WARNING, ftrl_weights=weights,
        ftrl_accumulator=accumulator, ftrl_initial_accumulator_value=0.1,
        optimizer_state_dtypes={"accum": states, "linear": states}, **KNOBS, **kw)


def _batches(steps, B=256, L=10, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, L + 1, B * len(CUDA_FMAP))
        idx = np.concatenate([(rng.zipf(1.1, n) - 1) % CUDA_SPECS[CUDA_FMAP[k // B]][0]
                              for k, n in enumerate(lengths)])
        out.append((torch.tensor(idx, dtype=torch.int64, device="cuda"),
                    torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device="cuda"),
                    torch.tensor(rng.uniform(0.5, 1.5, len(idx)), dtype=torch.float32, device="cuda"),
                    int(rng.integers(1 << 30))))
    return out


def _distinct_rows(batches, B=256) -> int:
    """Distinct (table, row) pairs the batches touch (bags feature-major, ``B`` per feature)."""
    rows = set()
    for idx, off, *_ in batches:
        bag_table = np.repeat(np.asarray(CUDA_FMAP), B)
        tables = np.repeat(bag_table, (off[1:] - off[:-1]).cpu().numpy())
        rows.update(zip(tables.tolist(), idx.cpu().tolist()))
    return len(rows)


def _step(m, batch, prefetch=False):
    idx, off, psw, g_seed = batch
    if prefetch:
        m.prefetch(idx, off)
    out = m(idx, off, psw)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).cuda())
    return out.detach()


def _copy_tables(src, dst):
    """``dst`` (a cached TBE, its cache emptied) starts from ``src``'s arrays: each construction
    draws its own uniform start (encoded into ``z`` for derived weights, as ``accum`` starts > 0)."""
    with torch.no_grad():
        for name in ("weights_dev", "accum_dev", "linear_dev"):
            getattr(dst, name).copy_(getattr(src, name))
    dst.reset_cache_states()


def _assert_tables_bitwise(a, b, what):
    for x, y in zip(a.split_optimizer_states(), b.split_optimizer_states()):
        assert torch.equal(bits(x[0]), bits(y[0])) and torch.equal(bits(x[1]), bits(y[1])), f"{what}: states"
    for x, y in zip(a.split_embedding_weights(), b.split_embedding_weights()):
        assert torch.equal(bits(x.cpu()), bits(y.cpu())), f"{what}: weights"


@cuda
@needs_cuda
@pytest.mark.parametrize("weights,accumulator,states,kw", [
    ("stored", "rowwise", SparseType.FP32, dict(cache_load_factor=0.05)),
    ("stored", "rowwise", SparseType.BF16, dict(cache_load_factor=0.05, cache_algorithm=CacheAlgorithm.LFU)),
    ("derived", "elementwise", SparseType.FP32, dict(cache_load_factor=0.05)),
    ("derived", "elementwise", SparseType.BF16, dict(cache_load_factor=0.05, prefetch_pipeline=True)),
    ("derived", "rowwise", SparseType.FP32, dict(cache_load_factor=0.05, cache_algorithm=CacheAlgorithm.LFU)),
    ("derived", "rowwise", SparseType.BF16, dict(cache_load_factor=0.05)),
])
def test_cuda_cached_layout_trains_bitwise_like_hbm(weights, accumulator, states, kw):
    """A cached table (5% of the rows: evictions of dirty rows every step) against the same layout
    in HBM over 6 Zipf steps: each output, then the weights and states, bit for bit."""
    hbm = _tbe(EmbeddingLocation.DEVICE, weights, accumulator, states)
    cached = _tbe(EmbeddingLocation.MANAGED_CACHING, weights, accumulator, states, **kw)
    _copy_tables(hbm, cached)
    prefetch = bool(kw.get("prefetch_pipeline"))
    batches = _batches(6)
    assert _distinct_rows(batches) > 2 * cached.cache.slots   # rows were evicted, dirty ones written back
    for k, batch in enumerate(batches):
        assert torch.equal(bits(_step(cached, batch, prefetch)), bits(_step(hbm, batch))), f"output {k}"
    _assert_tables_bitwise(cached, hbm, f"{weights}/{accumulator}/{states.name}")


@cuda
@needs_cuda
@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_cuda_cached_derived_table_reads_writes_resets_and_checkpoints(accumulator):
    """A derived cached table with a warm, written cache: its weights (``split_embedding_weights``,
    ``DerivedWeight``) are those of the same table in HBM; a row write (``load_weights``), a reset
    (``reset_embedding_weight_momentum``) and a ``state_dict`` round trip into a fresh cached table
    act as in HBM, and training continues bit for bit."""
    hbm = _tbe(EmbeddingLocation.DEVICE, "derived", accumulator, SparseType.FP32)
    cached = _tbe(EmbeddingLocation.MANAGED_CACHING, "derived", accumulator, SparseType.FP32,
                  cache_load_factor=0.05)
    _copy_tables(hbm, cached)
    batches = _batches(6, seed=2)
    for batch in batches[:2]:
        _step(cached, batch), _step(hbm, batch)
    assert cached.cache.written
    for t in range(len(CUDA_SPECS)):   # reads through a warm cache: no explicit flush
        assert torch.equal(bits(cached.derived_weights(t, slice(0, 50))), bits(hbm.derived_weights(t, slice(0, 50))))
    rows = torch.arange(0, 40, 3, device="cuda")
    w = torch.rand(len(rows), CUDA_SPECS[0][1], device="cuda") * 0.02 - 0.01
    for m in (cached, hbm):
        m.load_weights(0, w, row_ids=rows)
        _step(m, batches[2])
        m.reset_embedding_weight_momentum(torch.tensor([0, 1, 2, 5]), torch.tensor([0, 4]),
                                          torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
        _step(m, batches[3])
    _assert_tables_bitwise(cached, hbm, "after load_weights and reset")
    fresh = _tbe(EmbeddingLocation.MANAGED_CACHING, "derived", accumulator, SparseType.FP32,
                 cache_load_factor=0.05)
    _step(cached, batches[4])   # written again: the save must flush
    fresh.load_state_dict(cached.state_dict())
    _step(hbm, batches[4])
    for batch in batches[5:]:
        assert torch.equal(bits(_step(fresh, batch)), bits(_step(hbm, batch)))
    _assert_tables_bitwise(fresh, hbm, "resumed from a state_dict")
