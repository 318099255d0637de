"""The production-shape job (issue: MLPerf DLRM-DCNv2): ``--preset mlperf-dcnv2``, ``--plan-only``,
the FTRL layout flags, the device multi-hot generator and the kernel warm-up. Sizes are transcribed
here from the MLPerf DLRM-DCNv2 configuration, not read from the code under test."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import cuda, needs_cuda, run_job

from torchrec_ftrl.job import cli, train, warmup
from torchrec_ftrl.job import layout_flags as layout

# MLPerf DLRM-DCNv2 (Criteo 1TB multi-hot), as listed in the issue.
ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
        11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
D = 128


def _plan_only(capsys, *flags) -> dict:
    train.run(["--preset", "mlperf-dcnv2", "--plan-only", *flags])
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.parametrize("state, fits", [("fp32", False), ("bf16", True)])
def test_plan_only_preset_per_ftrl_state_layout(capsys, state, fits):
    lines, out = _plan_only(capsys, "--ftrl-state-dtype", state)
    state_bytes = {"fp32": 4, "bf16": 2}[state]
    rows = sum(ROWS)
    assert rows == 204_184_588
    assert out["weight_bytes"] == rows * D * 4                       # 104.5 GB
    assert out["optimizer_state_bytes"] == rows * D * 2 * state_bytes
    assert out["sparse_bytes"] == out["weight_bytes"] + out["optimizer_state_bytes"]
    assert out["fits"] is fits and out["fits_in_hbm"] is False       # 209 GB > 139 GiB of HBM
    assert sum(1 for ln in lines if ln.startswith("t_C")) == 26
    if not fits:   # 313.6 GB > 139 GiB HBM + 128 GiB host
        assert any("the sparse tables do not fit: 313.6 GB" in ln for ln in lines)
    else:          # the planner moves what HBM cannot hold to fused_uvm_caching
        assert "fused_uvm_caching" in out["compute_kernels"]


@pytest.mark.parametrize("flags, bytes_per_row", [
    (["--ftrl-weights", "derived", "--ftrl-state-dtype", "bf16"], 2 * D * 2),           # 512 B
    (["--ftrl-weights", "derived", "--ftrl-accumulator", "rowwise"], D * 4 + 4),         # 516 B
    (["--ftrl-weights", "derived", "--ftrl-accumulator", "rowwise", "--ftrl-state-dtype", "bf16"],
     D * 2 + 2),                                                                         # 258 B
    (["--ftrl-accumulator", "rowwise"], D * 4 + D * 4 + 4),                              # 1,028 B
])
def test_plan_only_preset_lean_layouts(capsys, flags, bytes_per_row):
    _, out = _plan_only(capsys, *flags)
    assert out["sparse_bytes"] == sum(ROWS) * bytes_per_row
    if "derived" in flags:   # no weight array: all of it is optimizer state, and it fits one H200
        assert out["weight_bytes"] == 0 and out["fits_in_hbm"] is True
        assert out["compute_kernels"] == ["fused"]


def test_plan_caches_a_lean_layout_that_does_not_fit_hbm(capsys):
    """Derived weights with bf16 state (512 B a row, 104.5 GB) do not fit 40 GiB of HBM: the planner
    moves what HBM cannot hold to fused_uvm_caching, whose cache rows hold the layout's arrays."""
    _, out = _plan_only(capsys, "--ftrl-weights", "derived", "--ftrl-state-dtype", "bf16", "--hbm-gib", "40")
    assert out["fits_in_hbm"] is False and out["fits"] is True
    assert "fused_uvm_caching" in out["compute_kernels"]


def test_plan_only_rowwise_adagrad_fits_one_h200(capsys):
    _, out = _plan_only(capsys, "--sparse-optimizer", "rowwise_adagrad")
    assert out["sparse_bytes"] == sum(ROWS) * (D * 4 + 4)
    assert out["fits_in_hbm"] is True and out["compute_kernels"] == ["fused"]


def test_job_refuses_a_layout_that_does_not_fit_before_allocating(tmp_path):
    p = run_job(["--preset", "mlperf-dcnv2", "--device", "cpu", "--host-gib", "128", "--output-dir",
                 str(tmp_path), "--no-progress"], module=True)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        "train_ctr: error: the sparse tables do not fit: 313.6 GB (104.5 GB weights + 209.1 GB "
        "optimizer state")
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())   # nothing written


def test_preset_values_and_overrides():
    a = cli.parse_args(["--preset", "mlperf-dcnv2", "--embedding-dim", "64", "--batch-size", "8192"])
    assert a.num_embeddings_list == ROWS and a.embedding_dim == 64 and a.batch_size == 8192
    assert a.multi_hot_list == [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27,
                                10, 3, 1, 1]
    assert (a.dense_arch_list, a.over_arch_list) == ([512, 256], [1024, 1024, 512, 256])
    assert (a.dcn_layers, a.dcn_rank, a.synthetic) == (3, 512, "uniform")
    scaled = cli.parse_args(["--preset", "mlperf-dcnv2", "--rows-scale", "0.001"])
    assert scaled.num_embeddings_list == [math.ceil(n / 1000) for n in ROWS]
    plain = cli.parse_args([])
    assert (plain.embedding_dim, plain.dcn_layers, plain.multi_hot_list) == (16, 0, None)


@pytest.mark.parametrize("flags, needle", [
    (["--rows-scale", "0"], "--rows-scale must be in (0, 1], got 0.0"),
    (["--multi-hot-sizes", "2"], "--multi-hot-sizes needs --synthetic uniform or zipf"),
    (["--world-size", "2"], "--world-size 2 needs --plan-only"),
])
def test_bad_flags_are_refused_naming_flag_and_value(capsys, flags, needle):
    with pytest.raises(SystemExit):
        cli.parse_args(flags)
    assert needle in capsys.readouterr().err


def test_layout_flags_follow_the_kernel_layouts():
    import argparse
    a = argparse.Namespace(sparse_optimizer="ftrl", ftrl_weights="derived", ftrl_accumulator="rowwise")
    assert layout.layout_error(a) == ""
    assert layout.layout_error(a, kernel_layouts={("stored", "elementwise")}) == (
        "--ftrl-weights derived --ftrl-accumulator rowwise is not supported by the FTRL TBE kernels; "
        "supported: --ftrl-weights stored --ftrl-accumulator elementwise")
    assert layout.fused_layout_params(a) == {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}
    a.sparse_optimizer = "rowwise_adagrad"
    assert "needs --sparse-optimizer ftrl" in layout.layout_error(a)


@pytest.mark.parametrize("args, expected", [
    (("ftrl", "stored", "elementwise", "fp32"), (512, 1024)),    # 1,536 B a row: 313.6 GB
    (("ftrl", "stored", "elementwise", "bf16"), (512, 512)),     # 209 GB
    (("ftrl", "derived", "elementwise", "bf16"), (0, 512)),      # the 512 B lean layout
    (("ftrl", "derived", "rowwise", "fp32"), (0, 516)),          # the 516 B lean layout
    (("ftrl", "derived", "rowwise", "bf16"), (0, 258)),          # bf16 z and bf16 row-wise n
    (("rowwise_adagrad", "stored", "elementwise", "fp32"), (512, 4)),
])
def test_bytes_per_row(args, expected):
    assert layout.bytes_per_row(D, *args) == expected


def test_device_multi_hot_batches():
    from torchrec_ftrl.data.device_synthetic import DeviceSyntheticSource
    src = DeviceSyntheticSource([5, 1000, 7], [2, 3, 1], seed=3)
    b = src.batch("train", 4, 16)
    kjt = b.sparse_features
    assert kjt.keys() == ["C1", "C2", "C3"] and kjt.length_per_key() == [32, 48, 16]
    assert kjt.lengths().tolist() == [2] * 16 + [3] * 16 + [1] * 16
    per = kjt.to_dict()
    assert per["C1"].values().max() < 5 and per["C3"].values().max() < 7
    assert per["C2"].values().min() >= 0 and per["C2"].values().max() < 1000
    assert b.dense_features.shape == (16, 13) and set(b.labels.tolist()) <= {0.0, 1.0}
    again = src.batch("train", 4, 16)
    assert torch.equal(again.sparse_features.values(), kjt.values())
    assert not torch.equal(src.batch("train", 5, 16).sparse_features.values(), kjt.values())
    steps = src.train_batches(rank=0, world_size=2, batch_size=16, start_step=2)   # batch 2 * 2 + 0
    assert torch.equal(next(steps).sparse_features.values(), kjt.values())


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.3])
def test_zipf_ids_follow_the_power_law(alpha):
    from torchrec_ftrl.data.device_synthetic import DeviceSyntheticSource
    n, draws = 1000, 400_000
    src = DeviceSyntheticSource([n], [draws // 1000], distribution="zipf", alpha=alpha, seed=1)
    ids = src.batch("train", 0, 1000).sparse_features.values()
    assert ids.min() >= 0 and ids.max() < n

    def cdf(x):   # the continuous power law on [1, n + 1): P(X < x)
        if alpha == 1.0:
            return math.log(x) / math.log(n + 1)
        return (x ** (1 - alpha) - 1) / ((n + 1) ** (1 - alpha) - 1)
    for r in (0, 1, 9, 99):
        expected = cdf(r + 2) - cdf(r + 1)
        got = (ids == r).double().mean().item()
        assert abs(got - expected) < 5 * math.sqrt(expected * (1 - expected) / draws) + 1e-4


def test_kernel_warmup_restores_tables_bit_for_bit(monkeypatch):
    from torchrec_ftrl.tbe import FTRLTableBatchedEmbeddingBags
    tbe = FTRLTableBatchedEmbeddingBags([(50, 8), (200, 8)], feature_table_map=[0, 1, 1],
                                        backend="torch", learning_rate=0.1, ftrl_l1_reg=1e-4,
                                        optimizer_state_dtypes={"accum": torch.bfloat16,
                                                                "linear": torch.bfloat16})
    holder = torch.nn.Module()
    holder.tbe = tbe

    def state():
        return ([w.clone() for w in tbe.split_embedding_weights()],
                [(a.clone(), z.clone()) for a, z in tbe.split_optimizer_states()], tbe.iter.clone())

    def same(x, y):
        return all(torch.equal(p, q) for p, q in zip(torch.utils._pytree.tree_leaves(x),
                                                       torch.utils._pytree.tree_leaves(y)))
    before = state()
    assert warmup.warm_up(holder, batch_size=16, multi_hot=[2, 3, 1]) == 1
    assert same(state(), before)
    monkeypatch.setattr(warmup, "_restore", lambda tbe, snap: None)   # without the restore ...
    warmup.warm_up(holder, batch_size=16, multi_hot=[2, 3, 1])
    assert not same(state(), before)                                  # ... the update shows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, needs_cuda])])
def test_kernel_warmup_restores_fbgemm_tables_bit_for_bit(monkeypatch, device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    where = ((EmbeddingLocation.HOST, ComputeDevice.CPU) if device == "cpu" else
             (EmbeddingLocation.DEVICE, ComputeDevice.CUDA))
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(50, 8, *where), (200, 8, *where)], feature_table_map=[0, 1, 1],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
    holder = torch.nn.Module()
    holder.tbe = tbe
    tbe.step, _ = 7, tbe.iter.fill_(7)   # as after 7 training steps

    def state():
        return ([w.clone() for w in tbe.split_embedding_weights()],
                [[s.clone() for s in table] for table in tbe.split_optimizer_states()],
                tbe.iter.clone(), tbe.iter_cpu.clone(), torch.tensor(tbe.step))
    before = state()
    assert warmup.warm_up(holder, batch_size=16, multi_hot=[2, 3, 1]) == 1
    after = state()
    assert all(torch.equal(p, q) for p, q in zip(torch.utils._pytree.tree_leaves(after),
                                                   torch.utils._pytree.tree_leaves(before)))
    assert int(after[2]) == 7 and int(after[4]) == 7
    monkeypatch.setattr(warmup, "_restore", lambda tbe, snap: None)   # without the restore ...
    warmup.warm_up(holder, batch_size=16, multi_hot=[2, 3, 1])
    assert not torch.equal(state()[1][0][0], before[1][0][0])         # ... the momentum shows the step
    assert int(tbe.iter) == 8 and tbe.step == 8


def test_kernel_warmup_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert warmup.enabled("auto", cuda) and not warmup.enabled("auto", cpu)
    assert warmup.enabled("on", cpu) and warmup.enabled("on", cuda)
    assert not warmup.enabled("off", cuda) and not warmup.enabled("off", cpu)


@pytest.mark.parametrize("optimizer", ["ftrl", "rowwise_adagrad"])
def test_job_with_kernel_warmup_trains_as_without(tmp_path, optimizer):
    runs = {}
    for mode in ("on", "off"):
        p = run_job(["--kernel-warmup", mode, "--steps", "4", "--log-every", "1", "--eval-every", "4",
                     "--no-progress", "--data-workers", "0", "--output-dir", str(tmp_path),
                     "--sparse-optimizer", optimizer, "--run-name", mode], module=True)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[mode] = json.loads((tmp_path / f"{mode}_summary.json").read_text())
    assert runs["on"]["kernel_warmup_tbes"] == 1   # the job's one TBE (26 tables), inside the DMP
    assert runs["off"]["kernel_warmup_tbes"] == 0
    for key in ("loss_history", "final_validation", "sparsity"):
        assert runs["on"][key] == runs["off"][key]
