"""TorchRec paths that move or sync optimizer state by name, with FTRL tables (docs/state-paths.md):
dynamic sharding, 2D parallel's replica sync, the model delta tracker. The distributed tests run 2
CPU processes (gloo)."""

import types

import pytest
import torch
from torchrec.distributed import embeddingbag, model_parallel
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
from torchrec.distributed.model_tracker.types import TrackingMode
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardMetadata

import state_path_scenarios as sc
import torchrec_ftrl
from torchrec_ftrl import integration
from torchrec_ftrl.integration import delta_tracker, replica_sync, resharding
from torchrec_ftrl.row_layout import RowLayout


DISTRIBUTED = {   # test id: (worker in state_path_scenarios, world size); world size 1 also runs on one GPU
    "reshard_carries_every_ftrl_state_bitwise": (sc.reshard_carries_ftrl_state, 2),
    "dmp_collection_sync_averages_ftrl_replicas": (sc.dmp_collection_syncs_ftrl, 2),
    "reshard_merges_column_shards_world_1": (sc.reshard_merges_column_shards, 1),
    "dmp_collection_sync_one_replica_world_1": (sc.dmp_collection_syncs_ftrl, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DISTRIBUTED))
def test_state_path(run_distributed, case):
    worker, world_size = DISTRIBUTED[case]
    run_distributed(worker, world_size)


# ------------------------------------------------------------------ refusals, on stand-in modules
ROWS, DIM = 10, 4


def _ps(sharding_type, shards, kernel="fused"):
    """ParameterSharding with ``shards`` = [(offsets, sizes, rank)]."""
    return ParameterSharding(
        sharding_type=sharding_type, compute_kernel=kernel, ranks=[r for _, _, r in shards],
        sharding_spec=EnumerableShardingSpec([ShardMetadata(shard_offsets=list(o), shard_sizes=list(s),
                                                            placement=f"rank:{r}/cpu") for o, s, r in shards]))


def _sharded_module():
    """What check_reshard reads of a ShardedEmbeddingBagCollection: an FTRL table ``t`` [10, 4],
    table-wise on rank 0."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    info = types.SimpleNamespace(embedding_config=types.SimpleNamespace(name="t", num_embeddings=ROWS,
                                                                        embedding_dim=DIM),
                                 fused_params={"optimizer": EmbOptimType.FTRL})
    row_info = types.SimpleNamespace(embedding_config=types.SimpleNamespace(name="r", num_embeddings=ROWS,
                                                                            embedding_dim=DIM),
                                     fused_params={"optimizer": EmbOptimType.FTRL})
    return types.SimpleNamespace(
        module_sharding_plan={"t": _ps("table_wise", [((0, 0), (ROWS, DIM), 0)]),
                              "r": _ps("row_wise", [((0, 0), (5, DIM), 0), ((5, 0), (5, DIM), 1)])},
        sharding_type_to_sharding_infos={"table_wise": [info], "row_wise": [row_info]})


def _table_row_wise_module():
    m = _sharded_module()
    m.module_sharding_plan["r"].sharding_type = "table_row_wise"
    m.sharding_type_to_sharding_infos = {"table_row_wise": m.sharding_type_to_sharding_infos["row_wise"]}
    return m


@pytest.mark.parametrize("name, new, match", [
    ("u", _ps("table_wise", [((0, 0), (ROWS, DIM), 1)]), r"'u' is not a table of this module"),
    ("t", _ps("column_wise", [((0, 0), (ROWS, 2), 0), ((0, 2), (ROWS, 2), 1)]),
     r"table 't' would change sharding type from 'table_wise' to 'column_wise'"),
    ("t", _ps("table_wise", [((0, 0), (ROWS, DIM), 1)], kernel="key_value"),
     r"table 't' would change compute kernel from 'fused' to 'key_value'"),
    ("t", _ps("table_wise", [((0, 0), (ROWS, DIM), 2)]), r"table 't' has ranks \[2\]; each must be in \[0, 2\)"),
    ("t", _ps("table_wise", [((0, 0), (ROWS - 1, DIM), 1)]), r"shards of table 't' .* do not tile its \[10, 4\]"),
    ("t", _ps("table_wise", [((1, 0), (ROWS, DIM), 1)]), r"do not tile"),
    ("r", _ps("row_wise", [((0, 0), (8, DIM), 0), ((8, 0), (2, DIM), 1)]),   # another split
     r"row_wise table 'r' would have shards .* its row blocks must stay"),
    ("r", _ps("row_wise", [((0, 0), (5, DIM), 1), ((5, 0), (5, DIM), 0)]),   # blocks in another order
     r"row_wise table 'r' .* block k on the k-th of consecutive ranks .* of \[0, 1\]"),
])
def test_reshard_refuses_a_move_it_cannot_honour(name, new, match):
    with pytest.raises(ValueError, match=match):
        resharding.check_reshard(_sharded_module(), {name: new}, world_size=2)


def test_reshard_accepts_a_move_that_tiles_the_table():
    resharding.check_reshard(_sharded_module(), {"t": _ps("table_wise", [((0, 0), (ROWS, DIM), 1)])}, 2)
    to_host_1 = _ps("table_row_wise", [((0, 0), (5, DIM), 2), ((5, 0), (5, DIM), 3)])
    resharding.check_reshard(_table_row_wise_module(), {"r": to_host_1}, 4)
    with pytest.raises(ValueError, match=r"table_row_wise table 'r' .* consecutive ranks \(TorchRec routes"):
        resharding.check_reshard(_table_row_wise_module(), {"r": _ps("table_row_wise", [
            ((0, 0), (5, DIM), 3), ((5, 0), (5, DIM), 2)])}, 4)


def _with_ftrl_tbe() -> torch.nn.Module:
    m = torch.nn.Module()
    m.tbe = torchrec_ftrl.FTRLTableBatchedEmbeddingBags([(ROWS, DIM)], learning_rate=0.1)
    return m


def test_dmp_collection_refuses_ftrl_without_exactly_one_replica_group():
    model = _with_ftrl_tbe()
    replica_sync.check_ftrl_replicas(torch.nn.Module())            # no FTRL table: nothing to check
    with pytest.raises(ValueError, match=r"1 FTRL TBE\(s\) but has 0 replica groups"):
        replica_sync.check_ftrl_replicas(model)                      # a DMPCollection without _ctxs
    model._ctxs = [types.SimpleNamespace(replica_pg=object(), hash_zch_modules=[])] * 2
    with pytest.raises(ValueError, match=r"has 2 replica groups \(submodule_configs"):
        replica_sync.check_ftrl_replicas(model)


def test_replica_sync_derives_weights_only_where_the_layout_stores_them():
    assert replica_sync.stores_weights(_with_ftrl_tbe().tbe)
    assert not replica_sync.stores_weights(types.SimpleNamespace(row_layout=RowLayout(weights="derived")))


def test_dmp_collection_refuses_ftrl_under_fully_sharded():
    from torchrec.distributed.types import ShardingStrategy
    model = _with_ftrl_tbe()
    model._ctxs = [types.SimpleNamespace(replica_pg=object(), hash_zch_modules=[],
                                         sharding_strategy=ShardingStrategy.FULLY_SHARDED)]
    with pytest.raises(ValueError, match=r"under sharding_strategy \['FULLY_SHARDED'\]"):
        replica_sync.check_ftrl_replicas(model)
    model._ctxs[0].sharding_strategy = ShardingStrategy.DEFAULT
    replica_sync.check_ftrl_replicas(model)


def test_dmp_collection_refuses_hash_zch_ftrl_tables():
    model = _with_ftrl_tbe()
    model._ctxs = [types.SimpleNamespace(replica_pg=object(), hash_zch_modules=[(model, "t")])]
    with pytest.raises(ValueError, match=r"hash-ZCH \(MPZCH\) FTRL tables \['t'\].*'sum'"):
        replica_sync.check_ftrl_replicas(model)


@pytest.mark.parametrize("mode", [TrackingMode.MOMENTUM_LAST, TrackingMode.MOMENTUM_DIFF,
                                  TrackingMode.ROWWISE_ADAGRAD])
def test_model_delta_tracker_refuses_optimizer_state_modes_for_ftrl(mode):
    with pytest.raises(ValueError, match=f"mode {mode.value!r} reads row-wise Adagrad"):
        ModelDeltaTrackerTrec(_with_ftrl_tbe(), mode=mode)
    with pytest.raises(ValueError, match=f"mode {mode.value!r}"):
        ModelDeltaTrackerTrec(_with_ftrl_tbe(), None, True, False, mode)   # positional, as TorchRec's
    delta_tracker.check_tracking_mode(torch.nn.Module(), mode)           # no FTRL table: allowed


def test_state_path_patches_uninstall_and_reinstall():
    targets = [(embeddingbag.ShardedEmbeddingBagCollection, "update_shards"),
               (model_parallel.DMPCollection, "__init__"), (model_parallel.DMPCollection, "sync"),
               (ModelDeltaTrackerTrec, "__init__")]
    patched = [vars(cls)[name] for cls, name in targets]
    assert all(hasattr(f, "__wrapped__") for f in patched)
    try:
        integration.uninstall()
        assert [vars(cls)[name] for cls, name in targets] == [f.__wrapped__ for f in patched]
    finally:
        integration.install()
    assert all(hasattr(vars(cls)[name], "__wrapped__") for cls, name in targets)


def test_unsharded_fused_collection_refuses_ftrl():
    """torchrec.modules.fused_embedding_modules builds FBGEMM's TBE itself and names its states
    momentum_1 / momentum_2; it has no FTRL and refuses it (TorchRec's own error)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    table = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"])
    with pytest.raises(ValueError, match="Cannot fuse optimizer_type=ftrl"):
        FusedEmbeddingBagCollection([table], optimizer_type=EmbOptimType.FTRL,
                                    optimizer_kwargs={"learning_rate": 0.1}, device=torch.device("cpu"))
