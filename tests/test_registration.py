"""import torchrec_ftrl registers FTRL into stock fbgemm_gpu / torchrec, idempotently."""

import pytest
import torch
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import utils as dist_utils

import torchrec_ftrl
from torchrec_ftrl.compat import check_torchrec_version
from torchrec_ftrl.distributed.kernels import tbe_kwargs_from_fused_params
from torchrec_ftrl.registration import is_ftrl, register
from torchrec_ftrl.tbe_compat import BoundsCheckMode


def test_enum_member_and_lookups():
    assert EmbOptimType.FTRL.value == "ftrl"
    assert EmbOptimType("ftrl") is EmbOptimType.FTRL
    assert EmbOptimType["FTRL"] is EmbOptimType.FTRL
    assert EmbOptimType.FTRL in list(EmbOptimType)
    assert torchrec.optim.FTRL is torchrec_ftrl.FTRL
    assert dist_utils.optimizer_type_to_emb_opt_type(torchrec.optim.FTRL) is EmbOptimType.FTRL


def test_register_is_idempotent():
    members = list(EmbOptimType)
    register()
    register()
    assert list(EmbOptimType) == members
    assert sum(m.value == "ftrl" for m in EmbOptimType) == 1


@pytest.mark.parametrize("value, expected", [
    (EmbOptimType.FTRL, True), ("ftrl", True), ("FTRL", True), (torchrec_ftrl.FTRL, True),
    (EmbOptimType.ADAM, False), (torch.optim.Adam, False), (None, False), ("adam", False)])
def test_is_ftrl(value, expected):
    assert is_ftrl(value) is expected


@pytest.mark.parametrize("version", ["1.6.1", "1.7.0", "1.8.0", "1.8.0+cpu"])
def test_supported_torchrec_versions(version):
    check_torchrec_version(version)


@pytest.mark.parametrize("version", ["1.5.0", "1.9.0", "2.0.0", "", "nightly"])
def test_unsupported_torchrec_version_names_the_range(version):
    with pytest.raises(ImportError, match=r"1\.6\.x to 1\.8\.x.*" + (version if version else "")):
        check_torchrec_version(version)


def test_fused_params_to_tbe_kwargs():
    kw = tbe_kwargs_from_fused_params({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.3,
                                       "ftrl_l1_reg": 0.1, "cache_precision": "fp32",
                                       "stochastic_rounding": True})
    assert kw == {"learning_rate": 0.3, "ftrl_l1_reg": 0.1, "bounds_check_mode": BoundsCheckMode.WARNING}
    kw = tbe_kwargs_from_fused_params({"learning_rate": 0.3, "bounds_check_mode": BoundsCheckMode.FATAL})
    assert kw["bounds_check_mode"] == BoundsCheckMode.FATAL
    with pytest.raises(ValueError, match="ftrl_l1_regg"):
        tbe_kwargs_from_fused_params({"ftrl_l1_regg": 0.1})


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

    from torchrec_ftrl.distributed.lookup import check_ftrl_group
    config = SimpleNamespace(embedding_tables=[
        SimpleNamespace(name="ok", compute_kernel=EmbeddingComputeKernel.FUSED),
        SimpleNamespace(name="big", compute_kernel=EmbeddingComputeKernel(kernel))])
    with pytest.raises(ValueError, match=f"table 'big'.*{kernel}"):
        check_ftrl_group(config)
