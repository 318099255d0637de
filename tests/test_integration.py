"""``torchrec_ftrl.integration``: the patch list (``import torchrec_ftrl`` installs it into stock
fbgemm_gpu / torchrec, idempotently; ``uninstall()`` gives back the stock objects), the supported
torchrec versions, the lookup routing, the sharders and the fused_params -> TBE keyword mapping.
(The planner's storage estimator: tests/test_planner.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import utils as dist_utils
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology, enumerators, planners
from torchrec.distributed.planner import shard_estimators

import torchrec_ftrl
from conftest import STOCK, stock_snapshot
from torchrec_ftrl import integration, optim_type
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode
from torchrec_ftrl.integration import patches, routing
from torchrec_ftrl.integration.kernels import tbe_kwargs_from_fused_params
from torchrec_ftrl.integration.versions import check_torchrec_version

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
    assert len(patches.PATCHES) == 4 + len(routing.ROUTES)
    for patch in patches.PATCHES:
        assert patch.target and patch.change and patch.verified and callable(patch.apply)
    targets = " ".join(p.target for p in patches.PATCHES)
    for name in ("EmbOptimType", "torchrec.optim.FTRL", *MAPS, "GroupedPooledEmbeddingsLookup",
                 "GroupedEmbeddingsLookup", "torchrec.distributed.planner."):
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
                                       "ftrl_l1_reg": 0.1, "cache_precision": "fp32",
                                       "stochastic_rounding": True})
    # every knob (the documented defaults where not given); FBGEMM-only keys dropped; WARNING default
    defaults = {"ftrl_learning_rate_power": -0.5, "ftrl_l1_reg": 0.0, "ftrl_l2_reg": 0.0, "ftrl_beta": 0.0,
                "ftrl_l2_shrinkage": 0.0, "ftrl_initial_accumulator_value": 0.0,
                "ftrl_l2_convention": "tensorflow"}
    assert kw == {**defaults, "learning_rate": 0.3, "ftrl_l1_reg": 0.1,
                  "bounds_check_mode": BoundsCheckMode.WARNING}
    kw = tbe_kwargs_from_fused_params({"lr": 0.3, "bounds_check_mode": BoundsCheckMode.FATAL})
    assert kw == {**defaults, "learning_rate": 0.3, "bounds_check_mode": BoundsCheckMode.FATAL}
    assert tbe_kwargs_from_fused_params(None)["learning_rate"] == 0.01
    with pytest.raises(ValueError, match="ftrl_l1_regg"):
        tbe_kwargs_from_fused_params({"ftrl_l1_regg": 0.1})
    with pytest.raises(ValueError, match="ftrl_beta.*-1.0"):
        tbe_kwargs_from_fused_params({"ftrl_beta": -1.0})
    with pytest.raises(ValueError, match="fused_params has lr=0.1 and learning_rate=0.2"):
        tbe_kwargs_from_fused_params({"lr": 0.1, "learning_rate": 0.2})


def test_sharders_validate_knobs_up_front():
    with pytest.raises(ValueError, match="ftrl_l1_reg"):
        torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, "ftrl_l1_reg": -1.0})
    with pytest.raises(ValueError, match="learning_rate"):
        torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.0})


def test_sharders_restrict_ftrl_to_fused_kernel_and_no_data_parallel():
    ebc_sharder = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})[0]
    assert "data_parallel" not in ebc_sharder.sharding_types("cuda")
    for st in ebc_sharder.sharding_types("cuda"):
        assert ebc_sharder.compute_kernels(st, "cuda") == ["fused"]
    stock_like = torchrec_ftrl.sharders({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})[0]
    assert "data_parallel" in stock_like.sharding_types("cuda")
    assert "fused_uvm_caching" in stock_like.compute_kernels("table_wise", "cuda")


@pytest.mark.parametrize("kernel", ["fused_uvm_caching", "fused_uvm", "key_value"])
def test_unsupported_compute_kernels_are_refused(kernel):
    from types import SimpleNamespace

    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    config = SimpleNamespace(embedding_tables=[
        SimpleNamespace(name="ok", compute_kernel=EmbeddingComputeKernel.FUSED),
        SimpleNamespace(name="big", compute_kernel=EmbeddingComputeKernel(kernel))])
    with pytest.raises(ValueError, match=f"table 'big'.*{kernel}"):
        routing.check_ftrl_group(config)
