"""The row-layout spec (torchrec_ftrl/row_layout.py): bytes per row by hand, names, validation."""

import pytest
import torch

from torchrec_ftrl.row_layout import RowLayout, require_kernel_layout

BF16 = torch.bfloat16


@pytest.mark.parametrize("layout,bytes_d128", [
    (RowLayout(), 128 * 4 + 128 * 4 + 128 * 4),                                  # w, n, z fp32
    (RowLayout(accum_dtype=BF16, linear_dtype=BF16), 512 + 256 + 256),
    (RowLayout(weights="derived"), 512 + 512),
    (RowLayout(weights="derived", accum_dtype=BF16, linear_dtype=BF16), 256 + 256),
    (RowLayout(weights="derived", accumulator="rowwise"), 4 + 512),
    (RowLayout(weights="derived", accumulator="rowwise", linear_dtype=BF16), 4 + 256),
])
def test_bytes_per_row_at_d128_fp32_weights(layout, bytes_d128):
    assert layout.bytes_per_row(128, 4) == bytes_d128


def test_from_options_reads_the_fused_params_keys():
    layout = RowLayout.from_options({"ftrl_weights": "derived", "ftrl_accumulator": "rowwise",
                                     "optimizer_state_dtypes": {"linear": "bf16"}, "optimizer": "x"})
    assert layout == RowLayout("derived", "rowwise", torch.float32, BF16)
    assert RowLayout.from_options(None) == RowLayout()
    assert layout.state_columns("accum", 64) == 1 and layout.state_columns("linear", 64) == 64


@pytest.mark.parametrize("options,message", [
    ({"ftrl_weights": "implicit"}, "fused_params: ftrl_weights must be one of ('stored', 'derived'), got 'implicit'"),
    ({"ftrl_accumulator": "row"}, "fused_params: ftrl_accumulator must be one of ('elementwise', 'rowwise'), got 'row'"),
])
def test_bad_values_name_key_and_value(options, message):
    with pytest.raises(ValueError) as e:
        RowLayout.from_options(options, where="fused_params")
    assert str(e.value) == message


def test_kernel_layouts():
    for weights in ("stored", "derived"):
        for accumulator in ("elementwise", "rowwise"):
            require_kernel_layout(RowLayout(weights, accumulator, accum_dtype=BF16), "t")


def test_tbe_takes_the_layout_and_refuses_what_its_kernels_lack():
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    from torchrec_ftrl.kernels.pytorch import composite   # the "torch" backend's OPS and CAPABILITIES
    from torchrec_ftrl.kernels.capabilities import Capabilities
    tbe = FTRLTableBatchedEmbeddingBags([(10, 4)], optimizer_state_dtypes={"accum": BF16}, backend="torch")
    assert tbe.row_layout == RowLayout(accum_dtype=BF16)
    with pytest.raises(ValueError, match=r"^FTRLTableBatchedEmbeddingBags\(\.\.\.\): ftrl_weights must be one "
                                         r"of \('stored', 'derived'\), got 'bogus'$"):
        FTRLTableBatchedEmbeddingBags([(10, 4)], ftrl_weights="bogus", backend="torch")
    original = composite.CAPABILITIES
    try:   # a backend that declares only the default layout refuses the others before allocating
        composite.CAPABILITIES = Capabilities()
        with pytest.raises(ValueError, match=r"^FTRLTableBatchedEmbeddingBags\(\.\.\.\): the torch backend "
                                             r"implements .*got ftrl_weights='stored', ftrl_accumulator='rowwise'$"):
            FTRLTableBatchedEmbeddingBags([(10, 4)], ftrl_accumulator="rowwise", backend="torch")
    finally:
        composite.CAPABILITIES = original


def test_fused_params_layout_is_checked_by_the_sharders_before_any_kernel():
    import torchrec_ftrl
    from torchrec_ftrl.optim_type import EmbOptimType
    fused = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}
    torchrec_ftrl.sharders({**fused, "ftrl_weights": "stored", "ftrl_accumulator": "elementwise"})
    torchrec_ftrl.sharders({**fused, "ftrl_weights": "derived", "ftrl_accumulator": "rowwise"})
    with pytest.raises(ValueError, match=r"ftrl_accumulator must be one of \('elementwise', 'rowwise'\), got 1"):
        torchrec_ftrl.sharders({**fused, "ftrl_accumulator": 1})


def test_update_hyper_parameters_cannot_change_the_layout():
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    tbe = FTRLTableBatchedEmbeddingBags([(10, 4)], backend="torch")
    with pytest.raises(ValueError, match="unknown FTRL key"):
        tbe.update_hyper_parameters({"ftrl_weights": "derived"})


@pytest.mark.parametrize("kernel,device,expected", [
    ("fused", "cuda", (1000 * (4 + 128 * 2), 0)),           # derived, rowwise fp32 n, bf16 z: HBM
    ("fused", "cpu", (0, 1000 * (4 + 128 * 2))),
    ("fused_uvm", "cuda", (0, 1000 * (4 + 128 * 2))),
])
def test_planner_counts_the_layout_bytes(kernel, device, expected):
    from torchrec_ftrl.integration.planner import ftrl_shard_storage
    layout = RowLayout(weights="derived", accumulator="rowwise", linear_dtype=BF16)
    assert ftrl_shard_storage(1000, 128, 4, kernel, device, layout=layout) == expected
