"""The planner counts FTRL optimizer state as 2 x the weight (accum + linear), stock torchrec does not."""

import pytest
import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner import shard_estimators as se
from torchrec.distributed.planner.types import PlannerError
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_ftrl
from torchrec_ftrl.planner import ftrl_planner

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
    monkeypatch.setattr(se, "_get_optimizer_multipler", se._get_optimizer_multipler.__wrapped__)
    monkeypatch.setattr(se, "calculate_shard_storages", se.calculate_shard_storages.__wrapped__)


def test_multiplier_is_two_for_ftrl():
    shape = torch.Size([ROWS, DIM])
    assert se._get_optimizer_multipler(torchrec_ftrl.FTRL, shape) == 2.0
    assert se._get_optimizer_multipler(torchrec.optim.FTRL, shape) == 2.0
    assert se._get_optimizer_multipler(torchrec.optim.RowWiseAdagrad, shape) == pytest.approx(1 / DIM)


@pytest.mark.parametrize("how", ["fused_params", "in_backward"])
def test_stock_estimate_overfills_and_ours_refuses(monkeypatch, how):
    ebc = _ebc()
    if how == "fused_params":
        sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})
    else:
        apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.parameters(), {"lr": 0.1})
        sharders = torchrec_ftrl.sharders()
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
