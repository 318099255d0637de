"""The planner counts FTRL optimizer state as 2 x the fp32 weight (accum + linear), stock torchrec does not:
``torchrec_ftrl.integration.planner`` (``FTRLStorageEstimator``, ``ftrl_planner``, and the patch that
makes DMP's default planner use the estimator)."""

import math

import pytest
import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner import enumerators, planners
from torchrec.distributed.planner import shard_estimators as se
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import CacheParams
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_ftrl
from torchrec_ftrl.integration.planner import FTRLEnumerator, ftrl_planner

ROWS, DIM, TABLES = 100_000, 64, 4
WEIGHT_BYTES = ROWS * DIM * 4          # 25.6 MB fp32 per table
CAP = 120 * 1024**2                     # DDR per rank: 2 tables' weights fit, 2 tables with FTRL state do not


def _ebc():
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)], device=torch.device("meta"))


def _plan(ebc, sharders, make_planner=ftrl_planner):
    topo = Topology(world_size=2, local_world_size=2, compute_device="cpu", ddr_cap=CAP)
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(TABLES)}
    return make_planner(topology=topo, constraints=cons).plan(ebc, sharders)


def _real_bytes_per_rank(plan):
    """What the plan really needs with FTRL: weight + accum + linear, fp32, per rank."""
    per_rank = {}
    for ps in plan.plan[""].values():
        for shard in ps.sharding_spec.shards:
            rank = shard.placement.rank()
            rows, cols = shard.shard_sizes
            per_rank[rank] = per_rank.get(rank, 0) + 3 * rows * cols * 4
    return per_rank


def _stock(monkeypatch):
    """DMP's default planner as stock TorchRec builds it: the stock enumerator, with the stock storage
    estimator."""
    monkeypatch.setattr(planners, "EmbeddingEnumerator", enumerators.EmbeddingEnumerator)
    monkeypatch.setattr(enumerators, "EmbeddingStorageEstimator", se.EmbeddingStorageEstimator)


def _ftrl_sharders(ebc, how):
    """Sharders under which every table of ``ebc`` is FTRL-trained: by the sharders' ``fused_params``, or
    in backward (``apply_optimizer_in_backward``, the sharders without fused_params)."""
    if how == "fused_params":
        return torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})
    apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.parameters(), {"lr": 0.1})
    return torchrec_ftrl.sharders()


def _shard_storages(ebc, sharders, estimator_cls, compute_device):
    """``{(table, sharding type): [(rows, cols, hbm, ddr) per shard]}`` of the fused kernel's options,
    estimated by ``estimator_cls`` alone."""
    topo = Topology(world_size=2, local_world_size=2, compute_device=compute_device)
    cons = {f"t{i}": ParameterConstraints(sharding_types=["table_wise", "row_wise", "column_wise"],
                                          compute_kernels=["fused"]) for i in range(2)}
    enumerator = enumerators.EmbeddingEnumerator(
        topology=topo, batch_size=512, constraints=cons,
        estimator=[estimator_cls(topology=topo, constraints=cons)])
    return {(so.name, so.sharding_type): [(s.size[0], s.size[1], s.storage.hbm, s.storage.ddr)
                                          for s in so.shards]
            for so in enumerator.enumerate(ebc, sharders)}


def _ebc2():
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=DIM // (i + 1), num_embeddings=ROWS // (i + 1),
        feature_names=[f"f{i}"]) for i in range(2)], device=torch.device("meta"))


@pytest.mark.parametrize("compute_device", ["cuda", "cpu"])
@pytest.mark.parametrize("how", ["fused_params", "in_backward"])
def test_estimator_adds_two_fp32_states_to_the_stock_weight_estimate(how, compute_device):
    """Each FTRL shard: TorchRec's estimate of the weights alone (no optimizer state: a stock sharder
    without an optimizer on the same tables) plus 8 bytes (accum + linear, fp32) per element, in HBM
    on a CUDA topology and in DDR on a CPU one."""
    ebc = _ebc2()
    sharders = _ftrl_sharders(ebc, how)
    ours = _shard_storages(ebc, sharders, torchrec_ftrl.FTRLStorageEstimator, compute_device)
    weights_only = _shard_storages(_ebc2(), [EmbeddingBagCollectionSharder()], se.EmbeddingStorageEstimator,
                                   compute_device)
    assert sorted(ours) == sorted(weights_only) and {("t0", "table_wise"), ("t1", "column_wise")} <= set(ours)
    for key, shards in ours.items():
        assert len(shards) == len(weights_only[key])
        for (rows, cols, hbm, ddr), (rows0, cols0, hbm0, ddr0) in zip(shards, weights_only[key]):
            assert (rows, cols) == (rows0, cols0)
            state = 2 * 4 * rows * cols
            if compute_device == "cuda":
                assert (hbm, ddr) == (hbm0 + state, ddr0), key
            else:
                assert (hbm, ddr) == (hbm0, ddr0 + state), key
    # the estimator leaves the tables' in-backward optimizer classes as they were
    for p in ebc.parameters():
        assert (getattr(p, "_optimizer_classes", None) == [torchrec.optim.FTRL]) == (how == "in_backward")


@pytest.mark.parametrize("how", ["fused_params", "in_backward"])
def test_stock_estimate_overfills_and_ours_refuses(monkeypatch, how):
    ebc = _ebc()
    sharders = _ftrl_sharders(ebc, how)
    # Ours: 4 tables x 3 x 25.6 MB cannot fit 2 x 120 MiB (minus the planner's reservation).
    with pytest.raises(PlannerError):
        _plan(ebc, sharders)
    # Stock (0 x for fused_params, 1 x in backward): it places all 4 tables, which really needs more
    # than a rank has.
    _stock(monkeypatch)
    plan = _plan(ebc, sharders, EmbeddingShardingPlanner)
    real = _real_bytes_per_rank(plan)
    assert max(real.values()) > CAP, real


def test_ours_places_what_fits():
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(2)], device=torch.device("meta"))
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})
    topo = Topology(world_size=2, local_world_size=2, compute_device="cpu", ddr_cap=CAP)
    plan = ftrl_planner(topo, constraints={f"t{i}": ParameterConstraints(sharding_types=["table_wise"])
                                           for i in range(2)}).plan(ebc, sharders)
    real = _real_bytes_per_rank(plan)
    assert sorted(real) == [0, 1] and max(real.values()) <= CAP, real


# ---------------------------------------------------------------- placements: fused_uvm, fused_uvm_caching
# The storage each FTRL placement needs, written out here from the byte model (docs: torchrec_ftrl/tbe/placement.py):
#   fused (HBM on CUDA, DDR on CPU), fused_uvm (DDR), fused_uvm_caching (DDR):
#     rows * D * (weight bytes + 8)                       weight + accum + linear (fp32 states)
#   fused_uvm_caching, HBM: slots * (D * (weight bytes + 8) + 8 + 8 + 8 + 8) + rows * 4 for LRU (cache rows of
#     weight + accum + linear; lxu_cache_state, lru_state, the slot snapshot and claim stamp int64 per slot;
#     cache_index_table_map int32 per row), slots * (D * (weight bytes + 8) + 8 + 8 + 8) + rows * (4 + 8) for LFU
#     (no lru_state; an lfu_state int64 per row), slots = 32 * max(1, ceil(floor(rows * load_factor) / 32)).
# Besides, TorchRec counts a table-wise shard's input and output buffers in HBM on CUDA (no pipeline):
#   B * world * pooling factor 1.0 * 8 (int64 ids) + B * world * D * 4 (fp32 pooled output).
GiB = 1024**3
B = 512


def _slots(rows, load_factor):
    return 32 * max(1, -(-int(rows * load_factor) // 32))


def _ftrl_bytes(kernel, rows, dim, weight_bytes=4, load_factor=0.2, lfu=False):
    """(hbm, ddr) of an FTRL table on a CUDA rank, from the formulas above."""
    table = rows * dim * (weight_bytes + 8)
    if kernel == "fused":
        return table, 0
    if kernel == "fused_uvm":
        return 0, table
    slots = _slots(rows, load_factor)
    row = dim * (weight_bytes + 8)
    hbm = slots * (row + 24) + rows * (4 + 8) if lfu else slots * (row + 32) + rows * 4
    return hbm, table


def _tw_io_bytes(dim, world=2, output_bytes=4):
    return B * world * 8 + B * world * dim * output_bytes


def _one_table(rows, dim, data_type=None):
    kw = {} if data_type is None else {"data_type": data_type}
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="big", embedding_dim=dim, num_embeddings=rows, feature_names=["f"], **kw)],
        device=torch.device("meta"))


def _storages(ebc, sharders, constraints, compute_device="cuda", estimator_cls=None):
    """``{(sharding type, compute kernel): [(rows, cols, hbm, ddr) per shard]}`` of ``ebc``'s one table."""
    topo = Topology(world_size=2, local_world_size=2, compute_device=compute_device)
    estimator_cls = estimator_cls or torchrec_ftrl.FTRLStorageEstimator
    enumerator = enumerators.EmbeddingEnumerator(
        topology=topo, batch_size=B, constraints=constraints,
        estimator=[estimator_cls(topology=topo, constraints=constraints)])
    return {(so.sharding_type, so.compute_kernel): [(s.size[0], s.size[1], s.storage.hbm, s.storage.ddr)
                                                    for s in so.shards]
            for so in enumerator.enumerate(ebc, sharders)}


FTRL_FUSED = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}


@pytest.mark.parametrize("kernel", ["fused", "fused_uvm", "fused_uvm_caching"])
def test_table_wise_storage_per_ftrl_kernel(kernel):
    rows, dim = 1_000_003, 96
    cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])}
    got = _storages(_one_table(rows, dim), torchrec_ftrl.sharders(FTRL_FUSED), cons)
    hbm, ddr = _ftrl_bytes(kernel, rows, dim)
    assert got == {("table_wise", kernel): [(rows, dim, hbm + _tw_io_bytes(dim), ddr)]}
    if kernel == "fused_uvm_caching":   # 200,000 of the 1,000,003 rows cached (default load factor 0.2)
        assert (hbm, ddr) == (200_000 * (12 * 96 + 32) + 4 * rows, 12 * 96 * rows)


def test_fp16_weights_shrink_table_and_cache():
    rows, dim = 400_000, 64
    ebc = _one_table(rows, dim, data_type=DataType.FP16)
    got = {}
    for kernel in ("fused", "fused_uvm", "fused_uvm_caching"):
        cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])}
        got.update(_storages(ebc, torchrec_ftrl.sharders(FTRL_FUSED), cons))
    io = _tw_io_bytes(dim, output_bytes=2)   # the output is in the weights' dtype
    assert got[("table_wise", "fused")] == [(rows, dim, rows * dim * 10 + io, 0)]
    assert got[("table_wise", "fused_uvm")] == [(rows, dim, io, rows * dim * 10)]
    assert got[("table_wise", "fused_uvm_caching")] == [
        (rows, dim, 80_000 * (10 * dim + 32) + 4 * rows + io, rows * dim * 10)]


BF16_STATES = {"accum": SparseType.BF16, "linear": SparseType.BF16}


@pytest.mark.parametrize("layout,row_bytes", [
    (dict(ftrl_weights="derived", optimizer_state_dtypes=BF16_STATES), 96 * 2 + 96 * 2),          # z, n bf16
    (dict(ftrl_weights="derived", ftrl_accumulator="rowwise"), 96 * 4 + 4),                       # z, one n
    (dict(ftrl_accumulator="rowwise", optimizer_state_dtypes=BF16_STATES), 96 * 4 + 96 * 2 + 2),  # w, z, one n
])
def test_lean_layouts_are_cached_with_their_own_rows(layout, row_bytes):
    """fused_uvm_caching holds every row layout: the cache rows (HBM) and the table (DDR) count the
    layout's arrays, written out here per layout (D = 96, fp32 weights)."""
    rows, dim = 1_000_003, 96
    cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"])}
    got = _storages(_one_table(rows, dim), torchrec_ftrl.sharders(dict(FTRL_FUSED, **layout)), cons)
    hbm = 200_000 * (row_bytes + 32) + 4 * rows
    assert got == {("table_wise", "fused_uvm_caching"): [(rows, dim, hbm + _tw_io_bytes(dim), rows * row_bytes)]}


@pytest.mark.parametrize("where", ["constraint", "fused_params"])
@pytest.mark.parametrize("algorithm", [CacheAlgorithm.LRU, CacheAlgorithm.LFU])
def test_cache_load_factor_and_algorithm_size_the_cache(where, algorithm):
    rows, dim = 300_000, 32
    fused = dict(FTRL_FUSED)
    cons = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"])
    if where == "constraint":
        cons.cache_params = CacheParams(load_factor=0.5, algorithm=algorithm)
    else:
        fused.update(cache_load_factor=0.5, cache_algorithm=algorithm)
    got = _storages(_one_table(rows, dim), torchrec_ftrl.sharders(fused), {"big": cons})
    lfu = algorithm == CacheAlgorithm.LFU
    hbm, ddr = _ftrl_bytes("fused_uvm_caching", rows, dim, load_factor=0.5, lfu=lfu)
    assert got == {("table_wise", "fused_uvm_caching"): [(rows, dim, hbm + _tw_io_bytes(dim), ddr)]}
    assert hbm == 150_016 * (12 * 32 + (24 if lfu else 32)) + rows * (12 if lfu else 4)


def _stock_tensor_bytes(kernel, rows, dim, shard_rows, shard_cols, load_factor=0.2):
    """(hbm, ddr) of TorchRec's own tensor estimate for one shard with no optimizer state: the fp32
    weights (shard's share), in HBM for fused and in DDR for the UVM kernels; for fused_uvm_caching HBM
    holds round(load_factor * weight bytes) (shard's share) + rows * (4 + 16 * load_factor)."""
    share = shard_rows * shard_cols / (rows * dim)
    weights = rows * dim * 4
    if kernel == "fused":
        return math.ceil(weights * share), 0
    if kernel == "fused_uvm":
        return 0, math.ceil(weights * share)
    return (math.ceil(round(weights * load_factor) * share) + math.ceil(shard_rows * (4 + load_factor * 16)),
            math.ceil(weights * share))


@pytest.mark.parametrize("how", ["fused_params", "in_backward"])
@pytest.mark.parametrize("kernel", ["fused", "fused_uvm", "fused_uvm_caching"])
def test_ftrl_bytes_replace_torchrec_tensor_estimate_for_every_sharding_type(kernel, how):
    """Per shard: ours - TorchRec's weights-only estimate == FTRL's bytes - TorchRec's tensor bytes, so
    TorchRec's input / output buffers stay and its weight estimate is replaced, for row-wise and
    column-wise shards too."""
    rows, dim = 200_000, 128
    cons = {"big": ParameterConstraints(sharding_types=["table_wise", "row_wise", "column_wise"],
                                        compute_kernels=[kernel], min_partition=64)}
    ebc = _one_table(rows, dim)
    ours = _storages(ebc, _ftrl_sharders(ebc, how), cons)
    stock = _storages(_one_table(rows, dim), [EmbeddingBagCollectionSharder()], cons,
                      estimator_cls=se.EmbeddingStorageEstimator)
    assert sorted(ours) == sorted(stock) == sorted((st, kernel) for st in ("table_wise", "row_wise", "column_wise"))
    for key, shards in ours.items():
        assert [s[:2] for s in shards] == [s[:2] for s in stock[key]] and len(shards) > (key[0] != "table_wise")
        for (r, c, hbm, ddr), (_, _, hbm0, ddr0) in zip(shards, stock[key]):
            new_hbm, new_ddr = _ftrl_bytes(kernel, r, c)
            old_hbm, old_ddr = _stock_tensor_bytes(kernel, rows, dim, r, c)
            assert (hbm - hbm0, ddr - ddr0) == (new_hbm - old_hbm, new_ddr - old_ddr), key


def test_cpu_topology_counts_every_ftrl_table_in_ddr():
    rows, dim = 100_000, 16
    cons = {"big": ParameterConstraints(sharding_types=["table_wise"])}
    got = _storages(_one_table(rows, dim), torchrec_ftrl.sharders(FTRL_FUSED), cons, compute_device="cpu")
    # fused only (the CPU kernels); TorchRec counts the io buffers in DDR on CPU
    assert got == {("table_wise", "fused"): [(rows, dim, 0, rows * dim * 12 + _tw_io_bytes(dim))]}


def _issue_tables(rows, dim, n=4):
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(n)], device=torch.device("meta"))


def _cuda_plan(ebc, sharders, constraints=None):
    topo = Topology(world_size=2, local_world_size=2, compute_device="cuda", hbm_cap=4 * GiB)
    return ftrl_planner(topo, constraints=constraints).plan(ebc, sharders)


def test_tables_larger_than_hbm_plan_on_uvm_caching():
    """Issue #22: 4 FTRL tables of 4M x 128 (6 GiB each with accum + linear) on 2 GPUs of 4 GiB. Only
    ``fused`` cannot fit; with the UVM placements the plan fits, by the formulas above."""
    rows, dim = 4_000_000, 128
    sharders = torchrec_ftrl.sharders(FTRL_FUSED)
    with pytest.raises(PlannerError):
        _cuda_plan(_issue_tables(rows, dim), sharders,
                   {f"t{i}": ParameterConstraints(compute_kernels=["fused"]) for i in range(4)})
    plan = _cuda_plan(_issue_tables(rows, dim), sharders)
    kernels = {name: ps.compute_kernel for name, ps in plan.plan[""].items()}
    assert sorted(kernels) == ["t0", "t1", "t2", "t3"]
    assert set(kernels.values()) <= {"fused", "fused_uvm_caching"} and "fused_uvm_caching" in kernels.values()
    hbm, ddr = {0: 0, 1: 0}, {0: 0, 1: 0}
    for name, ps in plan.plan[""].items():
        for shard in ps.sharding_spec.shards:
            h, d = _ftrl_bytes(ps.compute_kernel, *shard.shard_sizes)
            hbm[shard.placement.rank()] += h
            ddr[shard.placement.rank()] += d
    assert max(hbm.values()) <= 4 * GiB and min(hbm.values()) > 0, hbm
    assert sum(ddr.values()) >= 2 * 12 * rows * dim, ddr   # at least two tables in unified memory


def test_tables_that_fit_in_hbm_stay_fused():
    plan = _cuda_plan(_issue_tables(100_000, 64), torchrec_ftrl.sharders(FTRL_FUSED))
    assert {name: ps.compute_kernel for name, ps in plan.plan[""].items()} == {
        f"t{i}": "fused" for i in range(4)}


def test_in_backward_ftrl_tables_get_only_ftrl_kernels():
    """Sharders without FTRL fused_params offer every stock kernel; the enumerator keeps only the FTRL
    kernels (no virtual-table kernel, no data-parallel) for in-backward FTRL tables, stock tables keep
    theirs."""
    ebc = _issue_tables(100_000, 64, n=2)
    apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.embedding_bags["t0"].parameters(), {"lr": 0.1})
    topo = Topology(world_size=2, local_world_size=2, compute_device="cuda")
    kernels = ["dense", "fused", "fused_uvm", "fused_uvm_caching", "dram_virtual_table"]
    cons = {f"t{i}": ParameterConstraints(compute_kernels=kernels) for i in range(2)}
    options = FTRLEnumerator(topology=topo, batch_size=B, constraints=cons).enumerate(
        ebc, torchrec_ftrl.sharders())
    got = {name: {(so.sharding_type == "data_parallel", so.compute_kernel) for so in options
                  if so.name == name} for name in ("t0", "t1")}
    assert {k for _, k in got["t0"]} == {"fused", "fused_uvm", "fused_uvm_caching"}
    assert not any(dp for dp, _ in got["t0"])
    assert {(True, "dense"), (False, "dram_virtual_table"), (False, "fused_uvm_caching")} <= got["t1"]


def test_uvm_caching_only_for_dims_the_ftrl_cache_takes():
    """The FTRL cache moves rows 4 elements at a time (FBGEMM's cache ops): a table of dim 6 gets no
    fused_uvm_caching option, column-wise shards of dim 4 do."""
    topo = Topology(world_size=2, local_world_size=2, compute_device="cuda")
    sharders = torchrec_ftrl.sharders(FTRL_FUSED)
    got = {}
    for dim, min_partition in ((6, None), (8, 4)):
        cons = {"big": ParameterConstraints(sharding_types=["table_wise", "column_wise"],
                                            min_partition=min_partition)}
        options = FTRLEnumerator(topology=topo, batch_size=B, constraints=cons).enumerate(
            _one_table(1000, dim), sharders)
        got[dim] = {(so.sharding_type, so.compute_kernel, tuple(s.size[1] for s in so.shards)) for so in options}
    assert {k for _, k, _ in got[6]} == {"fused", "fused_uvm"}
    assert ("column_wise", "fused_uvm_caching", (4, 4)) in got[8]
    assert ("table_wise", "fused_uvm_caching", (8,)) in got[8]


# bf16 FTRL state (optimizer_state_dtypes / state_dtype): accum + linear take 2 + 2 bytes per element
# instead of 4 + 4, where the table lives and in each cache slot.
BF16_STATE = {"optimizer_state_dtypes": {"accum": torch.bfloat16, "linear": torch.bfloat16}}


@pytest.mark.parametrize("how", ["fused_params", "state_dtype", "in_backward"])
def test_bf16_state_counts_four_state_bytes_per_element(how):
    rows, dim = 1_000_003, 96
    got = {}
    for kernel in ("fused", "fused_uvm", "fused_uvm_caching"):
        cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])}
        ebc = _one_table(rows, dim)
        if how == "in_backward":
            apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.parameters(), {"lr": 0.1, "state_dtype": "bf16"})
            sharders = torchrec_ftrl.sharders()
        elif how == "state_dtype":
            sharders = torchrec_ftrl.sharders({**FTRL_FUSED, "state_dtype": torch.bfloat16})
        else:
            sharders = torchrec_ftrl.sharders({**FTRL_FUSED, **BF16_STATE})
        got.update(_storages(ebc, sharders, cons))
    io = _tw_io_bytes(dim)
    # by hand: 1,000,003 x 96 x (4 weight + 2 accum + 2 linear) = 768,002,304 bytes
    assert got[("table_wise", "fused")] == [(rows, dim, 768_002_304 + io, 0)]
    assert got[("table_wise", "fused_uvm")] == [(rows, dim, io, 768_002_304)]
    # 200,000 cached rows (load factor 0.2): 200,000 x (96 x 8 + 32) + 4 x 1,000,003 = 164,000,012
    assert got[("table_wise", "fused_uvm_caching")] == [(rows, dim, 164_000_012 + io, 768_002_304)]


def test_one_bf16_state_counts_six_bytes_and_fp32_in_backward_overrides_the_sharder():
    rows, dim = 10_000, 16
    cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    got = _storages(_one_table(rows, dim), torchrec_ftrl.sharders(
        {**FTRL_FUSED, "optimizer_state_dtypes": {"linear": SparseType.BF16}}), cons)
    assert got[("table_wise", "fused")] == [(rows, dim, 10_000 * 16 * 10 + _tw_io_bytes(dim), 0)]
    ebc = _one_table(rows, dim)
    apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.parameters(), {"lr": 0.1, "state_dtype": "fp32"})
    got = _storages(ebc, torchrec_ftrl.sharders({**FTRL_FUSED, **BF16_STATE}), cons)
    assert got[("table_wise", "fused")] == [(rows, dim, 10_000 * 16 * 12 + _tw_io_bytes(dim), 0)]


def test_bad_state_dtype_in_backward_is_refused_naming_the_table():
    ebc = _one_table(100, 8)
    apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.parameters(), {"lr": 0.1})
    ebc.embedding_bags["big"].weight._optimizer_kwargs[0]["optimizer_state_dtypes"] = {"accum": "fp16"}
    cons = {"big": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])}
    with pytest.raises(ValueError, match=r"table 'big' fused_params optimizer_state_dtypes\['accum'\]"):
        _storages(ebc, torchrec_ftrl.sharders(), cons)
