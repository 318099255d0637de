"""The planner counts FTRL optimizer state as 2 x the fp32 weight (accum + linear), stock torchrec does not:
``torchrec_ftrl.integration.planner`` (``FTRLStorageEstimator``, ``ftrl_planner``, and the patch that
makes DMP's default planner use the estimator)."""

import pytest
import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner import enumerators, planners
from torchrec.distributed.planner import shard_estimators as se
from torchrec.distributed.planner.types import PlannerError
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_ftrl
from torchrec_ftrl.integration.planner import ftrl_planner

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
