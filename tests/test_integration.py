"""``torchrec_ftrl.integration``: the patch list (``import torchrec_ftrl`` installs it into stock
fbgemm_gpu / torchrec, idempotently; ``uninstall()`` gives back the stock objects), the supported
torchrec versions, the lookup routing (which compute kernels FTRL runs on), the sharders, the
fused_params -> TBE keyword mapping and the TBE placements the kernels ask for. CUDA TBEs are not built
here (FBGEMM's cache ops and unified memory are CUDA-only): the tests check what the kernels hand the TBE.
(The planner's storage estimator: tests/test_planner.py.)"""

import json
import os
import subprocess
import sys

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import utils as dist_utils
from torchrec.distributed.embedding_sharding import group_tables
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology, enumerators, planners
from torchrec.distributed.planner import shard_estimators
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_ftrl
from conftest import STOCK, stock_snapshot
from torchrec_ftrl import integration, optim_type
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode
from torchrec_ftrl.integration import compute_kernels as kernels_mod
from torchrec_ftrl.integration import patches, routing
from torchrec_ftrl.integration.compute_kernels import tbe_kwargs_from_fused_params
from torchrec_ftrl.integration.versions import check_torchrec_version
from torchrec_ftrl.row_layout import RowLayout

sharders_mod = importlib.import_module("torchrec_ftrl.integration.sharders")   # integration.sharders is the function
MAPS = ("_OPTIMIZER_CLASS_TO_EMB_OPT_TYPE", "_EMB_OPT_TYPE_TO_OPTIMIZER_CLASS")


def _facts() -> dict:
    """:func:`conftest.stock_snapshot` of this process, in its JSON form."""
    return json.loads(json.dumps(stock_snapshot()))


def _stock() -> dict:
    """The stock objects' facts from before ``import torchrec_ftrl``: conftest's snapshot, or (if the
    package was imported before conftest) one taken in a fresh process."""
    if STOCK is not None:
        return json.loads(json.dumps(STOCK))
    p = subprocess.run([sys.executable, "-c", "import json, conftest; print(json.dumps(conftest.STOCK))"],
                       cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def _kernel_factories() -> list:
    return [vars(lookup)["_create_embedding_kernel"] for lookup, _ in routing.ROUTES]


def _default_planner_estimators() -> list:
    """The estimator classes of the enumerator that DMP's default planner (``plan=None``) builds."""
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, local_world_size=1,
                                                         compute_device="cpu"))
    return [type(e) for e in planner._enumerator._estimators]


def _ftrl_map_entries() -> dict:
    """The FTRL entries of each optimizer class <-> type map of torchrec.distributed.utils."""
    return {name: [(k, v) for k, v in (getattr(dist_utils, name, None) or {}).items()
                   if optim_type.is_ftrl(k) or optim_type.is_ftrl(v)] for name in MAPS}


def _one_ftrl_pair_per_map() -> bool:
    return all(entries == [(torchrec_ftrl.FTRL, EmbOptimType.FTRL)] or
               entries == [(EmbOptimType.FTRL, torchrec_ftrl.FTRL)]
               for name, entries in _ftrl_map_entries().items() if getattr(dist_utils, name, None) is not None)


def test_enum_member_and_lookups():
    assert EmbOptimType.FTRL.value == "ftrl"
    assert EmbOptimType("ftrl") is EmbOptimType.FTRL
    assert EmbOptimType["FTRL"] is EmbOptimType.FTRL
    assert EmbOptimType.FTRL in list(EmbOptimType)
    assert optim_type.emb_optim_type() is EmbOptimType.FTRL
    assert torchrec.optim.FTRL is torchrec_ftrl.FTRL
    assert dist_utils.optimizer_type_to_emb_opt_type(torchrec.optim.FTRL) is EmbOptimType.FTRL
    estimators = _default_planner_estimators()
    assert torchrec_ftrl.FTRLStorageEstimator in estimators
    assert shard_estimators.EmbeddingStorageEstimator not in estimators


def test_patch_list_names_every_change():
    assert integration.installed()
    assert len(patches.PATCHES) == 7 + len(routing.ROUTES)
    for patch in patches.PATCHES:
        assert patch.target and patch.change and patch.verified and callable(patch.apply)
    targets = " ".join(p.target for p in patches.PATCHES)
    for name in ("EmbOptimType", "torchrec.optim.FTRL", *MAPS, "GroupedPooledEmbeddingsLookup",
                 "GroupedEmbeddingsLookup", "torchrec.distributed.planner.", "update_shards", "DMPCollection",
                 "ModelDeltaTrackerTrec"):
        assert name in targets, name


def test_install_is_idempotent():
    def objects():
        return [EmbOptimType.FTRL, torchrec.optim.FTRL, enumerators.EmbeddingStorageEstimator,
                planners.EmbeddingEnumerator, *_kernel_factories()]

    members, before, entries = list(EmbOptimType), objects(), _ftrl_map_entries()
    torchrec_ftrl.install()
    integration.install()
    assert all(a is b for a, b in zip(before, objects()))
    assert list(EmbOptimType) == members
    assert sum(m.value == "ftrl" for m in EmbOptimType) == 1
    assert _ftrl_map_entries() == entries and _one_ftrl_pair_per_map()


def test_uninstall_restores_the_stock_objects_and_install_reapplies():
    stock = _stock()
    lookups = [lookup for lookup, _ in routing.ROUTES]
    originals = [f.__wrapped__ for f in _kernel_factories()]     # the wrappers keep the originals
    native_member = "FTRL" in stock["members"]
    assert integration.installed() and _facts() != stock
    try:
        integration.uninstall()
        assert not integration.installed()
        assert _facts() == stock
        assert ("FTRL" in EmbOptimType.__members__) == native_member
        if not native_member:
            assert "ftrl" not in EmbOptimType._value2member_map_ and not hasattr(EmbOptimType, "FTRL")
            assert all(m.value != "ftrl" for m in EmbOptimType)
            with pytest.raises(LookupError, match="install"):
                optim_type.emb_optim_type()
        if stock["torchrec.optim.FTRL"] == "None":
            assert not hasattr(torchrec.optim, "FTRL")
        assert all(vars(lk)["_create_embedding_kernel"] is f for lk, f in zip(lookups, originals))
        assert enumerators.EmbeddingStorageEstimator is shard_estimators.EmbeddingStorageEstimator
        assert planners.EmbeddingEnumerator is enumerators.EmbeddingEnumerator
        estimators = _default_planner_estimators()
        assert shard_estimators.EmbeddingStorageEstimator in estimators
        assert torchrec_ftrl.FTRLStorageEstimator not in estimators
        assert _ftrl_map_entries() == {name: [] for name in MAPS}
        integration.uninstall()                                   # idempotent
        assert _facts() == stock
    finally:
        integration.install()
    # reinstalled: later tests see the integration again
    assert integration.installed()
    assert EmbOptimType("ftrl") is EmbOptimType.FTRL is optim_type.emb_optim_type()
    assert torchrec.optim.FTRL is torchrec_ftrl.FTRL
    assert all(f.__wrapped__ is o for f, o in zip(_kernel_factories(), originals))
    assert torchrec_ftrl.FTRLStorageEstimator in _default_planner_estimators()
    assert dist_utils.optimizer_type_to_emb_opt_type(torchrec.optim.FTRL) is EmbOptimType.FTRL
    assert _one_ftrl_pair_per_map()


@pytest.mark.parametrize("version", ["1.6.1", "1.7.0", "1.8.0", "1.8.0+cpu", "1.9.0", "1.9.2"])
def test_supported_torchrec_versions(version):
    check_torchrec_version(version)


@pytest.mark.parametrize("version", ["1.5.0", "1.10.0", "2.0.0", "", "nightly"])
def test_unsupported_torchrec_version_names_the_range(version):
    with pytest.raises(ImportError, match=r"1\.6\.x to 1\.9\.x.*" + (version if version else "")):
        check_torchrec_version(version)


def test_fused_params_to_tbe_kwargs():
    kw = tbe_kwargs_from_fused_params({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.3,
                                       "ftrl_l1_reg": 0.1, "stochastic_rounding": True,
                                       "multipass_prefetch_config": object(), "enforce_hbm": True,
                                       "stats_reporter_config": object(), "eps": 1e-8})
    # every knob (the documented defaults where not given); FBGEMM-only keys dropped; WARNING default
    defaults = {"ftrl_learning_rate_power": -0.5, "ftrl_l1_reg": 0.0, "ftrl_l2_reg": 0.0, "ftrl_beta": 0.0,
                "ftrl_l2_shrinkage": 0.0, "ftrl_initial_accumulator_value": 0.0,
                "ftrl_l2_convention": "tensorflow"}
    assert kw == {**defaults, "learning_rate": 0.3, "ftrl_l1_reg": 0.1,
                  "bounds_check_mode": BoundsCheckMode.WARNING, "row_layout": RowLayout()}
    kw = tbe_kwargs_from_fused_params({"lr": 0.3, "bounds_check_mode": BoundsCheckMode.FATAL,
                                       "ftrl_weights": "derived"})
    assert kw == {**defaults, "learning_rate": 0.3, "bounds_check_mode": BoundsCheckMode.FATAL,
                  "row_layout": RowLayout(weights="derived")}
    assert tbe_kwargs_from_fused_params(None)["learning_rate"] == 0.01
    with pytest.raises(ValueError, match="ftrl_l1_regg"):
        tbe_kwargs_from_fused_params({"ftrl_l1_regg": 0.1})
    with pytest.raises(ValueError, match="ftrl_beta.*-1.0"):
        tbe_kwargs_from_fused_params({"ftrl_beta": -1.0})
    with pytest.raises(ValueError, match="fused_params has lr=0.1 and learning_rate=0.2"):
        tbe_kwargs_from_fused_params({"lr": 0.1, "learning_rate": 0.2})


# What TorchRec's add_params_from_parameter_sharding puts in fused_params from a table's CacheParams
# (algorithm, load_factor, reserved_memory, precision, prefetch_pipeline), plus FBGEMM's other cache keys.
CACHE_KEYS = {"cache_algorithm": CacheAlgorithm.LRU, "cache_load_factor": 0.3, "cache_reserved_memory": 2.5,
              "prefetch_pipeline": True, "cache_sets": 7, "uvm_host_mapped": True,
              "gather_uvm_cache_stats": True}


def test_fused_params_cache_keys_reach_the_tbe():
    kw = tbe_kwargs_from_fused_params({"learning_rate": 0.3, **CACHE_KEYS,
                                       "cache_precision": DataType.FP16, "cache_load_factor_x": 1})
    assert {k: kw[k] for k in CACHE_KEYS} == CACHE_KEYS
    assert kw["cache_precision"] is SparseType.FP16        # TorchRec DataType -> FBGEMM SparseType
    assert "cache_load_factor_x" not in kw
    # keys given as None (TorchRec's "unset") are not passed
    kw = tbe_kwargs_from_fused_params({k: None for k in (*CACHE_KEYS, "cache_precision")})
    assert not set(kw) & {*CACHE_KEYS, "cache_precision"}
    # a caching TBE whose cache precision is the weights': passed
    kw = tbe_kwargs_from_fused_params({"cache_precision": SparseType.FP16},
                                      EmbeddingLocation.MANAGED_CACHING, SparseType.FP16)
    assert kw["cache_precision"] is SparseType.FP16


def test_fused_params_cache_precision_refused_when_it_changes_results():
    # the FTRL cache keeps the weights in their own precision; FBGEMM would round cached rows to fp16
    with pytest.raises(ValueError, match="cache_precision=FP16 differs from .* weights precision FP32"):
        tbe_kwargs_from_fused_params({"cache_precision": SparseType.FP16},
                                     EmbeddingLocation.MANAGED_CACHING, SparseType.FP32)
    # no cache, nothing rounded (FBGEMM ignores it there too)
    for location in (EmbeddingLocation.DEVICE, EmbeddingLocation.MANAGED, EmbeddingLocation.HOST):
        kw = tbe_kwargs_from_fused_params({"cache_precision": SparseType.FP16}, location, SparseType.FP32)
        assert kw["cache_precision"] is SparseType.FP16
    with pytest.raises(ValueError, match="cache_precision must be a SparseType or DataType, got 'fp32'"):
        tbe_kwargs_from_fused_params({"cache_precision": "fp32"})
    with pytest.raises(ValueError, match="cache_precision"):
        torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "cache_precision": "fp16"})


def test_sharders_validate_knobs_up_front():
    with pytest.raises(ValueError, match="ftrl_l1_reg"):
        torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, "ftrl_l1_reg": -1.0})
    with pytest.raises(ValueError, match="learning_rate"):
        torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.0})


@pytest.mark.parametrize("key,value", [("ftrl_weights", "derived"), ("ftrl_accumulator", "rowwise"),
                                       ("ftrl_l1_reg", 0.01), ("state_dtype", "bf16"),
                                       ("optimizer_state_dtypes", {"accum": SparseType.BF16})])
def test_sharders_refuse_ftrl_keys_with_another_optimizer(key, value):
    """FTRL-only fused_params with a non-FTRL optimizer would reach no FTRL table (routing drops them
    from the group): refused when the sharders are built, naming the key, the value and the
    optimizer; the same keys are taken with FTRL, and refused with no optimizer named (tests/test_newcomer.py)."""
    adagrad = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    match = rf"{key}={value!r} is an FTRL option, but the optimizer is .*EXACT_ROWWISE_ADAGRAD"
    with pytest.raises(ValueError, match=match.replace("{", r"\{").replace("}", r"\}")):
        torchrec_ftrl.sharders({**adagrad, key: value})
    with pytest.raises(ValueError, match=key):
        sharders_mod.FTRLEmbeddingCollectionSharder(fused_params={**adagrad, key: value})
    torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, key: value})


def test_sharders_pass_a_stock_optimizers_own_state_dtypes_through():
    """A stock optimizer's own optimizer_state_dtypes (FBGEMM's state names) reach its sharders'
    fused_params as given, as without torchrec_ftrl: they are not FTRL's to check."""
    fp = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1,
          "optimizer_state_dtypes": {"momentum1": SparseType.BF16}}
    for sharder in torchrec_ftrl.sharders(fp):
        assert sharder.fused_params["optimizer_state_dtypes"] == {"momentum1": SparseType.BF16}


def test_sharder_refuses_ftrl_keys_in_another_optimizers_in_backward_kwargs(monkeypatch):
    """torchrec.optim.RowWiseAdagrad takes any kwargs, so apply_optimizer_in_backward accepts FTRL's
    there; the sharder refuses them before sharding, naming the table, key, value and class."""
    seen = []
    monkeypatch.setattr(EmbeddingBagCollectionSharder, "shard",
                        lambda self, module, params, env, device=None, module_fqn=None: seen.append(module))
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"]) for i in range(2)],
        device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.embedding_bags["t0"].parameters(),
                                {"lr": 0.1, "ftrl_weights": "derived"})
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.embedding_bags["t1"].parameters(),
                                {"lr": 0.1, "ftrl_accumulator": "rowwise"})
    plan = _plan_of({"t0": ("table_wise", "fused", [0]), "t1": ("table_wise", "fused", [0])})
    sharder = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})[0]
    with pytest.raises(ValueError, match=r"table 't1' in-backward kwargs: ftrl_accumulator='rowwise' is an "
                                         r"FTRL option, but the optimizer is RowWiseAdagrad"):
        sharder.shard(ebc, plan, None, torch.device("cpu"))
    assert seen == []
    ebc.embedding_bags["t1"].weight._optimizer_kwargs = [{"lr": 0.1}]
    sharder.shard(ebc, plan, None, torch.device("cpu"))
    assert seen == [ebc]


FTRL_KERNELS = ["fused", "fused_uvm", "fused_uvm_caching"]


def test_sharders_offer_ftrl_kernels_and_no_data_parallel():
    for sharder in torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}):
        assert "data_parallel" not in sharder.sharding_types("cuda")
        assert set(sharder.sharding_types("cuda")) >= {"table_wise", "row_wise", "column_wise"}
        for st in sharder.sharding_types("cuda"):
            assert sharder.compute_kernels(st, "cuda") == FTRL_KERNELS, (type(sharder), st)
        for st in sharder.sharding_types("cpu"):
            assert sharder.compute_kernels(st, "cpu") == ["fused"]
    stock_like = torchrec_ftrl.sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})[0]
    assert "data_parallel" in stock_like.sharding_types("cuda")
    assert {"fused_uvm_caching", "key_value"} <= set(stock_like.compute_kernels("table_wise", "cuda"))


def _config(*kernels, fused_params=None):
    """A grouped config of tables t0, t1, ... with these compute kernels (names or members)."""
    return SimpleNamespace(fused_params=fused_params, embedding_tables=[
        SimpleNamespace(name=f"t{i}", compute_kernel=EmbeddingComputeKernel(k)) for i, k in enumerate(kernels)])


REFUSED = [k.value for k in EmbeddingComputeKernel if k.value not in FTRL_KERNELS]


@pytest.mark.parametrize("kernel", REFUSED)
def test_non_ftrl_compute_kernels_are_refused(kernel):
    assert {"dense", "key_value", "ssd_virtual_table", "dram_virtual_table"} <= set(REFUSED)
    config = _config("fused", kernel)
    config.embedding_tables[1].name = "big"
    with pytest.raises(ValueError, match=f"table 'big' .* sharding type 'table_wise' and compute kernel '{kernel}'"):
        routing.check_ftrl_group(config, ShardingType.TABLE_WISE)
    shown = "'data_parallel'" if kernel == "dense" else "None"   # the dense kernel's one sharding type
    with pytest.raises(ValueError, match=f"table 'big' .* sharding type {shown} and compute kernel '{kernel}'"):
        routing.check_ftrl_group(config, device=torch.device("cuda"))


@pytest.mark.parametrize("kernel", FTRL_KERNELS)
def test_ftrl_compute_kernels_are_accepted(kernel):
    for device in (None, torch.device("cpu"), torch.device("cuda")):
        assert routing.check_ftrl_group(_config(kernel, kernel), "row_wise", device) is None


def test_one_group_of_several_placements_is_refused_on_cuda_only():
    config = _config("fused", "fused_uvm_caching", "fused_uvm_caching")
    with pytest.raises(ValueError, match=r"\{'t0': 'fused', 't1': 'fused_uvm_caching', 't2': 'fused_uvm_caching'\}"
                                         r".*one placement.*use_one_tbe_per_table"):
        routing.check_ftrl_group(config, "table_wise", torch.device("cuda", 0))
    routing.check_ftrl_group(config, "table_wise", torch.device("cpu"))   # all HOST on a CPU device


def test_torchrec_groups_ftrl_kernels_together_unless_one_tbe_per_table():
    """The premise of the sharders' use_one_tbe_per_table: TorchRec folds fused / fused_uvm /
    fused_uvm_caching into one group, and that fused param (dropped from the group's fused_params)
    gives each table its own group."""
    def table(name, kernel, fused_params):
        return ShardedEmbeddingTable(
            num_embeddings=100, embedding_dim=8, name=name, feature_names=[f"f_{name}"],
            data_type=DataType.FP32, pooling=PoolingType.SUM, compute_kernel=EmbeddingComputeKernel(kernel),
            local_rows=100, local_cols=8, fused_params=dict(fused_params))

    fp = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}
    for extra, groups in (({}, [["a", "b", "c"]]), ({"use_one_tbe_per_table": True}, [["a"], ["b"], ["c"]])):
        grouped = group_tables([[table("a", "fused", {**fp, **extra}), table("b", "fused_uvm", {**fp, **extra}),
                                 table("c", "fused_uvm_caching", {**fp, **extra})]])[0]
        assert [[t.name for t in g.embedding_tables] for g in grouped] == groups
        assert all(g.fused_params == fp for g in grouped)


def _plan_of(kernels_ranks: dict) -> dict:
    return {name: ParameterSharding(sharding_type=st, compute_kernel=kernel, ranks=ranks)
            for name, (st, kernel, ranks) in kernels_ranks.items()}


def test_mixed_ftrl_placements():
    ftrl = {"a", "b", "c"}
    mixed = sharders_mod.mixed_ftrl_placements
    # one rank, one sharding type, two kernels
    assert mixed(_plan_of({"a": ("table_wise", "fused", [0]), "b": ("table_wise", "fused_uvm_caching", [0])}), ftrl)
    # row-wise shards on every rank meet the table-wise one on rank 1
    assert mixed(_plan_of({"a": ("row_wise", "fused", [0, 1]), "b": ("row_wise", "fused_uvm", [1])}), ftrl)
    # different ranks, different sharding types, or one table not trained by FTRL: separate groups
    assert not mixed(_plan_of({"a": ("table_wise", "fused", [0]), "b": ("table_wise", "fused_uvm", [1]),
                               "c": ("row_wise", "fused_uvm_caching", [0, 1])}), ftrl)
    assert not mixed(_plan_of({"a": ("table_wise", "fused", [0]), "d": ("table_wise", "fused_uvm", [0])}), ftrl)


@pytest.mark.parametrize("how", ["fused_params", "in_backward"])
def test_sharder_shards_mixed_cuda_plans_with_one_tbe_per_table(monkeypatch, how):
    """On a CUDA device, a plan that gives one rank's FTRL tables different FTRL kernels is sharded with
    use_one_tbe_per_table; otherwise (or on CPU) with the sharder's own fused_params, which stay as
    they were."""
    seen = []
    monkeypatch.setattr(EmbeddingBagCollectionSharder, "shard",
                        lambda self, module, params, env, device=None, module_fqn=None:
                        seen.append(self.fused_params) or "sharded")
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"f{i}"]) for i in range(3)],
        device=torch.device("meta"))
    if how == "fused_params":
        fp = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}
    else:
        fp = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
        for i in (0, 1):
            apply_optimizer_in_backward(torchrec.optim.FTRL, ebc.embedding_bags[f"t{i}"].parameters(), {"lr": 0.1})
    sharder = torchrec_ftrl.sharders(fp)[0]
    mixed = _plan_of({"t0": ("table_wise", "fused", [0]), "t1": ("table_wise", "fused_uvm_caching", [0]),
                      "t2": ("table_wise", "fused", [1])})
    apart = _plan_of({"t0": ("table_wise", "fused_uvm_caching", [0]), "t1": ("table_wise", "fused_uvm_caching", [0]),
                      "t2": ("table_wise", "fused_uvm", [1])})
    t2_beside = _plan_of({"t0": ("table_wise", "fused_uvm_caching", [0]),
                          "t1": ("table_wise", "fused_uvm_caching", [0]), "t2": ("table_wise", "fused", [0])})
    cuda = torch.device("cuda", 0)
    assert sharder.shard(ebc, mixed, None, cuda) == "sharded"
    sharder.shard(ebc, mixed, None, torch.device("cpu"))
    sharder.shard(ebc, apart, None, cuda)
    sharder.shard(ebc, t2_beside, None, cuda)     # t2 is an FTRL table only under FTRL fused_params
    flagged = {**fp, "use_one_tbe_per_table": True}
    assert seen == [flagged, fp, fp, flagged if how == "fused_params" else fp]
    assert sharder.fused_params == fp


def test_routing_marks_uvm_caching_groups_for_prefetch():
    """TorchRec's sequence lookup prefetches only when its _create_embedding_kernel saw a
    fused_uvm_caching table; the routed factory sets that flag for FTRL groups too."""
    built = []

    def original(self, config, pg, device, env=None):
        raise AssertionError("FTRL groups never reach TorchRec's factory")

    factory = routing.routed_create_embedding_kernel(
        original, lambda **kw: built.append(kw) or "ftrl kernel")
    fp = {"optimizer": EmbOptimType.FTRL}
    for kernels, expected in ((["fused", "fused_uvm"], False), (["fused_uvm_caching"], True)):
        lookup = SimpleNamespace(_need_prefetch=False)
        assert factory(lookup, _config(*kernels, fused_params=fp), None, torch.device("cpu")) == "ftrl kernel"
        assert lookup._need_prefetch is expected
    pooled = SimpleNamespace()          # the pooled lookup decides in prefetch(), has no flag
    factory(pooled, _config("fused_uvm_caching", fused_params=fp), None, None)
    assert not hasattr(pooled, "_need_prefetch") and len(built) == 3


def test_tbe_placements_follow_the_compute_kernels_on_cuda():
    config = _config("fused_uvm_caching", "fused_uvm", "fused")
    assert kernels_mod.tbe_placements(config, torch.device("cuda", 1)) == [
        (EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA), (EmbeddingLocation.MANAGED, ComputeDevice.CUDA),
        (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)]
    for device in (torch.device("cpu"), None):
        assert kernels_mod.tbe_placements(config, device) == [(EmbeddingLocation.HOST, ComputeDevice.CPU)] * 3


@pytest.mark.parametrize("kernel", FTRL_KERNELS)
def test_cuda_tbe_gets_fbgemm_specs_and_cache_kwargs(monkeypatch, kernel):
    """What _build_tbe hands the TBE on a CUDA device (the TBE itself is not built: CUDA-only)."""
    got = {}
    monkeypatch.setattr(kernels_mod, "FTRLTableBatchedEmbeddingBags", lambda **kw: got.update(kw) or "tbe")
    config = _config(kernel, kernel, fused_params={"optimizer": EmbOptimType.FTRL, "learning_rate": 0.2,
                                                   "prefetch_pipeline": True})
    config.data_type = DataType.FP16
    kernel_like = SimpleNamespace(_local_rows=[10, 20], _local_cols=[8, 16], _feature_table_map=[0, 1, 1])
    assert kernels_mod._build_tbe(kernel_like, config, torch.device("cuda", 0), PoolingMode.SUM) == "tbe"
    location = {"fused": EmbeddingLocation.DEVICE, "fused_uvm": EmbeddingLocation.MANAGED,
                "fused_uvm_caching": EmbeddingLocation.MANAGED_CACHING}[kernel]
    assert got["embedding_specs"] == [(10, 8, location, ComputeDevice.CUDA), (20, 16, location, ComputeDevice.CUDA)]
    assert (got["feature_table_map"], got["weights_precision"], got["table_names"]) == ([0, 1, 1], SparseType.FP16,
                                                                                         ["t0", "t1"])
    assert got["learning_rate"] == 0.2 and got["prefetch_pipeline"] is True
    # a caching TBE is sized with the planner's default load factor unless fused_params give one
    assert got.get("cache_load_factor") == (UVM_CACHING_RATIO if kernel == "fused_uvm_caching" else None)


@pytest.fixture
def one_process_group():
    """A default gloo process group of this process alone (the fused optimizer builds ShardedTensors),
    destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _cpu_kernel(kernels_cls, compute_kernel, **fused_params):
    rows, dim = 10, 4
    md = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[rows, dim], placement="rank:0/cpu")
    gmd = ShardedTensorMetadata(shards_metadata=[md], size=torch.Size([rows, dim]),
                                tensor_properties=TensorProperties(dtype=torch.float32))
    fp = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, **fused_params}
    table = ShardedEmbeddingTable(
        num_embeddings=rows, embedding_dim=dim, name="t0", feature_names=["f0"], data_type=DataType.FP32,
        pooling=PoolingType.SUM, compute_kernel=EmbeddingComputeKernel(compute_kernel), local_rows=rows,
        local_cols=dim, local_metadata=md, global_metadata=gmd, fused_params=dict(fp))
    config = GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=False,
                                    has_feature_processor=False, compute_kernel=EmbeddingComputeKernel.FUSED,
                                    embedding_tables=[table], fused_params=dict(fp))
    return kernels_cls(config=config, pg=None, device=torch.device("cpu"))


@pytest.mark.parametrize("compute_kernel", FTRL_KERNELS)
def test_cpu_kernel_builds_a_host_tbe_and_flushes_before_optimizer_state_dict(one_process_group, compute_kernel):
    from torchrec_ftrl.integration.compute_kernels import FTRLBatchedFusedEmbeddingBag

    kernel = _cpu_kernel(FTRLBatchedFusedEmbeddingBag, compute_kernel)
    tbe = kernel._emb_module
    assert [spec[2:] for spec in tbe.embedding_specs] == [(EmbeddingLocation.HOST, ComputeDevice.CPU)]
    calls = []
    tbe.flush = lambda: calls.append("flush")
    with torch.no_grad():
        tbe.accum_dev.fill_(0.5)
    state = kernel.fused_optimizer.state_dict()["state"]["t0.weight"]
    assert calls == ["flush"]
    assert sorted(state) == ["t0.accum", "t0.linear", "t0.step"]
    assert torch.equal(state["t0.accum"].local_shards()[0].tensor, torch.full((10, 4), 0.5))


@pytest.mark.parametrize("compute_kernel", ["fused", "fused_uvm"])
def test_cpu_kernel_keeps_a_lean_layout_in_host_memory(one_process_group, compute_kernel):
    """On a CPU device every FTRL kernel, fused_uvm too, builds a HOST TBE (TorchRec keeps CPU tables
    in host memory) with the layout of its fused_params: derived weights (no weight array; the
    kernel's weight parameter computes them) and a row-wise accum of one value per row."""
    from torchrec_ftrl.tbe.derived_weight import DerivedWeight
    from torchrec_ftrl.integration.compute_kernels import FTRLBatchedFusedEmbeddingBag

    kernel = _cpu_kernel(FTRLBatchedFusedEmbeddingBag, compute_kernel, ftrl_weights="derived",
                         ftrl_accumulator="rowwise", ftrl_beta=0.5)
    tbe = kernel._emb_module
    assert [spec[2:] for spec in tbe.embedding_specs] == [(EmbeddingLocation.HOST, ComputeDevice.CPU)]
    assert tbe.weights_dev.numel() == 0 and tuple(tbe.accum_dev.shape) == (10,)
    weight = dict(kernel.named_parameters())["t0.weight"]
    assert isinstance(weight, DerivedWeight) and tuple(weight.shape) == (10, 4)


def test_enforce_hbm_refused_for_cached_ftrl_tables():
    """enforce_hbm=True (FBGEMM: a cached table's backing store in HBM) cannot be honoured by the FTRL
    cache, whose tables stay in unified memory: refused, naming the key; accepted where nothing is
    cached."""
    from torchrec_ftrl.fbgemm_enums import EmbeddingLocation
    from torchrec_ftrl.integration.compute_kernels import tbe_kwargs_from_fused_params
    fp = {"optimizer": EmbOptimType.FTRL, "enforce_hbm": True}
    with pytest.raises(ValueError, match="enforce_hbm"):
        tbe_kwargs_from_fused_params(fp, EmbeddingLocation.MANAGED_CACHING)
    assert "enforce_hbm" not in tbe_kwargs_from_fused_params(fp, EmbeddingLocation.DEVICE)
