"""Loads that are all or nothing: the TBE's ``load_state_dict`` and ``load_weights``,
``import_ftrl_tables``, and DCP checkpoints (plain ``dcp.load`` and the staged
``torchrec_ftrl.checkpoint.load_dcp``), with the TBE's step counter carried by the fused optimizer's
state. Every bad input raises naming the key, with every buffer bitwise unchanged.

The DMP cases run in this process on a one-process gloo group (tests/dist_scenarios.py's models)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torchrec_ftrl
from conftest import assert_same_bits, bits, cuda, needs_cuda, tbe_state

SPECS = [(10, 4), (6, 8)]


def _tbe(**kw):
    return torchrec_ftrl.FTRLTableBatchedEmbeddingBags(SPECS, learning_rate=0.05, ftrl_l1_reg=1e-3,
                                                        device="cpu", **kw)


def _trained_tbe(**kw):
    tbe = _tbe(**kw)
    indices, offsets = torch.tensor([1, 3, 3, 9, 0, 5]), torch.tensor([0, 2, 4, 5, 6])
    for _ in range(2):
        tbe(indices, offsets).sum().backward()
    return tbe


def _set(key, value):
    return lambda sd: sd.__setitem__(key, value(sd[key]))


def _poke(key, index, value):
    def edit(sd):
        sd[key] = sd[key].clone()
        sd[key].view(-1)[index] = value
    return edit


BAD_STATES = {
    # name: (edit of a good state dict, the key the message names, a word of the message)
    "wrong_shape": (_set("accum_dev", lambda t: t[:-1].clone()), "accum_dev", "shape"),
    "missing_key": (lambda sd: sd.pop("linear_dev"), "linear_dev", "no"),
    "meta_tensor": (_set("linear_dev", lambda t: torch.empty_like(t, device="meta")), "linear_dev", "meta"),
    "accum_negative": (_poke("accum_dev", -1, -1.0), "accum_dev", "-1.0"),
    "accum_nan": (_poke("accum_dev", 5, float("nan")), "accum_dev", "NaN"),
    "linear_inf": (_poke("linear_dev", -1, float("inf")), "linear_dev", "inf"),
    "linear_beyond_fp32": (_set("linear_dev", lambda t: t.double().index_fill(0, torch.tensor([3]), 1e39)),
                           "linear_dev", "1e+39"),
    "weights_complex": (_set("weights_dev", lambda t: t.to(torch.complex64)), "weights_dev", "complex"),
    "iter_negative": (_set("iter", lambda t: torch.tensor([-2])), "iter", "-2"),
    "iter_float": (_set("iter", lambda t: t.double()), "iter", "integer dtype"),
}


@pytest.mark.parametrize("name", sorted(BAD_STATES))
def test_bad_tbe_state_dict_raises_naming_the_key_and_changes_nothing(name):
    tbe = _trained_tbe()
    good = {k: v.clone() for k, v in tbe.state_dict().items()}
    sd = {k: v.clone() for k, v in good.items()}
    sd["weights_dev"].fill_(0.25)       # every other entry differs from the TBE's
    sd["accum_dev"].fill_(2.0)
    sd["iter"].fill_(7)
    edit, key, word = BAD_STATES[name]
    edit(sd)
    before = tbe_state(tbe)
    with pytest.raises(ValueError, match=f"'{key}'") as e:
        tbe.load_state_dict(sd)
    assert word in str(e.value)
    assert_same_bits(before, tbe_state(tbe))


def test_good_tbe_state_dict_loads_every_buffer():
    src, dst = _trained_tbe(), _tbe()
    dst.load_state_dict(src.state_dict())
    assert_same_bits(tbe_state(src), tbe_state(dst))
    assert int(dst.iter) == 2          # two backward steps


def test_tbe_inside_a_parent_module():
    parent = torch.nn.ModuleDict({"tbe": _trained_tbe(), "dense": torch.nn.Linear(2, 2)})
    before = tbe_state(parent["tbe"])
    # A parent's non-strict load without the TBE's keys leaves the TBE as it is.
    parent.load_state_dict({"dense.weight": torch.zeros(2, 2), "dense.bias": torch.zeros(2)}, strict=False)
    assert_same_bits(before, tbe_state(parent["tbe"]))
    # Some of its keys but not all: refused, nothing of the TBE changed.
    sd = {k: v.clone() for k, v in parent.state_dict().items() if k != "tbe.linear_dev"}
    sd["tbe.weights_dev"].fill_(0.5)
    with pytest.raises(ValueError, match="'tbe.linear_dev'"):
        parent.load_state_dict(sd, strict=False)
    assert_same_bits(before, tbe_state(parent["tbe"]))


def test_tbe_non_strict_load_of_some_buffers():
    tbe = _trained_tbe()
    weights = torch.full_like(tbe.weights_dev, 0.125)
    before = tbe_state(tbe)
    result = tbe.load_state_dict({"weights_dev": weights}, strict=False)
    assert "linear_dev" in result.missing_keys
    assert torch.equal(tbe.weights_dev, weights)
    assert_same_bits(before[1:], tbe_state(tbe)[1:])


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_load_weights_refuses_values_beyond_the_weights_dtype(precision):
    from fbgemm_gpu.split_embedding_configs import SparseType
    tbe = _trained_tbe(weights_precision=SparseType.FP16 if precision == "fp16" else SparseType.FP32)
    big = 1e5 if precision == "fp16" else 1e39            # beyond fp16's 65504 / fp32's 3.4e38
    w = torch.zeros(6, 8, dtype=torch.float64)
    w[5, 7] = big
    before = tbe_state(tbe)
    with pytest.raises(ValueError, match="weights of table"):
        tbe.load_weights(1, w)
    assert_same_bits(before, tbe_state(tbe))


def test_load_weights_refuses_a_derived_weight_whose_linear_overflows():
    """A derived table stores linear = prox's inverse of the weight, about -w (beta + sqrt(n)) / lr:
    3e38 is a finite fp32 weight whose linear is not finite. Refused, nothing written (the chunked
    encoding is checked before any chunk is written)."""
    tbe = _trained_tbe(ftrl_weights="derived")
    with torch.no_grad():
        tbe.accum_dev.fill_(4.0)       # sqrt(n) = 2: linear ~ -w (beta + 2) / 0.05, beyond fp32 at 3e38
    w = torch.zeros(6, 8)
    w[4] = 3.0e38
    before = tbe_state(tbe)
    with pytest.raises(ValueError, match="weights row 4 of table 1: its linear .* not finite"):
        tbe.load_weights(1, w)
    assert_same_bits(before, tbe_state(tbe))


# ------------------------------------------------------------------ DMP: one gloo process


def _dmp_bits(dmp) -> list[torch.Tensor]:
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    return [bits(getattr(t, n)) for t in ftrl_tbes(dmp) for n in ("weights_dev", "accum_dev", "linear_dev", "iter")]


def _steps(dmp) -> list[int]:
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    return [int(t.iter) for t in ftrl_tbes(dmp)]


def test_fused_optimizer_state_holds_the_step(one_process):
    sc = one_process
    dmp = sc._ck_model(1, "tw")
    sc._ck_train(dmp, None, 0, 1, range(3))
    state = dmp.fused_optimizer.state_dict()["state"]
    for n in sc.CK_TABLES:
        per_table = state[f"embedding_bags.{n}.weight"]
        assert sorted(per_table) == [f"{n}.accum", f"{n}.linear", f"{n}.step"]
        assert per_table[f"{n}.step"].tolist() == [3]      # three backward steps


def test_import_with_a_bad_last_slot_changes_nothing(one_process, tmp_path):
    from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables
    sc = one_process
    dmp = sc._ck_model(1, "tw")
    sc._ck_train(dmp, None, 0, 1, range(2))
    good = str(tmp_path / "good.npz")
    export_ftrl_tables(dmp, good)
    sc._ck_train(dmp, None, 0, 1, range(2, 3))     # the model now differs from the file
    last = sorted(sc.CK_TABLES)[-1]
    for slot, value, word in (("linear", np.nan, "NaN"), ("accum", -1.0, "-1.0"), ("accum", np.inf, "inf")):
        arrays = dict(np.load(good))
        arrays[f"{last}/{slot}"][-1, -1] = value
        path = str(tmp_path / f"bad-{slot}.npz")
        np.savez(path, **arrays)
        before = _dmp_bits(dmp)
        with pytest.raises(ValueError, match=f"'{last}/{slot}'") as e:
            import_ftrl_tables(dmp, path)
        assert word in str(e.value)
        assert all(torch.equal(a, b) for a, b in zip(before, _dmp_bits(dmp)))


def test_import_shape_error_names_the_row_layout(one_process, tmp_path):
    from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables
    sc = one_process
    elementwise = sc._ck_model(1, "tw")
    path = str(tmp_path / "elementwise.npz")
    export_ftrl_tables(elementwise, path)
    lean = sc._ck_model(1, "tw", {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"})
    before = _dmp_bits(lean)
    with pytest.raises(ValueError) as e:
        import_ftrl_tables(lean, path)
    msg = str(e.value)
    assert f"has shape ({sc.ROWS}, {sc.DIM})" in msg and "row layout 'derived-rowwise'" in msg
    assert f"row-wise accum of shape ({sc.ROWS},)" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, _dmp_bits(lean)))


def test_plain_dcp_resume_with_bf16_linear_is_bitwise(one_process, tmp_path):
    """Plain ``dcp.save`` / ``dcp.load`` of the model and fused optimizer state dicts, no
    ``set_optimizer_step``: the resumed run (stochastic rounding keyed by the step) equals the
    uninterrupted one bit for bit, and so does one resumed by ``load_dcp``, staged on the tensors'
    device or in host memory."""
    _resume_bitwise(one_process, tmp_path, ("plain", "device", "host"))


def _resume_bitwise(sc, tmp_path, hows):
    import torch.distributed.checkpoint as dcp
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec_ftrl.checkpoint import load_dcp
    layout = {"optimizer_state_dtypes": {"linear": SparseType.BF16}}
    full = sc._ck_model(1, "tw", layout)
    sc._ck_train(full, None, 0, 1, range(3))
    dcp.save(sc._ck_state(full), checkpoint_id=str(tmp_path / "ck"))
    sc._ck_train(full, None, 0, 1, range(3, 6))
    for how in hows:
        resumed = sc._ck_model(1, "tw", layout)
        if how == "plain":
            state = sc._ck_state(resumed)
            dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
            resumed.load_state_dict(state["model"])
            resumed.fused_optimizer.load_state_dict(state["optim"])
        else:
            load_dcp(resumed, resumed.fused_optimizer, str(tmp_path / "ck"), stage_on=how)
        assert _steps(resumed) == [3]
        sc._ck_train(resumed, None, 0, 1, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(_dmp_bits(full), _dmp_bits(resumed))), how


@cuda
@needs_cuda
def test_cuda_load_dcp_staged_in_host_memory_resumes_bitwise(monkeypatch, tmp_path):
    """As above with the tables on the GPU (one NCCL rank): ``load_dcp`` staged in host memory (the
    ShardedTensors' placements moved to the CPU) and on the device both resume bit for bit."""
    monkeypatch.setenv("FTRL_TEST_DEVICE", "cuda")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    try:
        _resume_bitwise(__import__("dist_scenarios"), tmp_path, ("host", "device"))
    finally:
        dist.destroy_process_group()


def test_load_dcp_refuses_an_unknown_staging_place(one_process, tmp_path):
    from torchrec_ftrl.checkpoint import load_dcp
    dmp = one_process._ck_model(1, "tw")
    with pytest.raises(ValueError, match="stage_on must be one of .*got 'disk'"):
        load_dcp(dmp, dmp.fused_optimizer, str(tmp_path / "none"), stage_on="disk")


@pytest.mark.parametrize("slot,index,value,word", [("accum", (3, 2), -1.0, "-1.0"),
                                                   ("accum", (0, 0), float("nan"), "NaN"),
                                                   ("linear", (5, 1), float("inf"), "inf"),
                                                   ("step", (0,), -4, "-4")])
def test_load_dcp_refuses_a_corrupted_checkpoint(one_process, tmp_path, slot, index, value, word):
    import torch.distributed.checkpoint as dcp
    from torchrec_ftrl.checkpoint import _local_pieces, load_dcp
    sc = one_process
    src = sc._ck_model(1, "tw")
    sc._ck_train(src, None, 0, 1, range(1))
    state = src.fused_optimizer.state_dict()["state"]["embedding_bags.c_b.weight"][f"c_b.{slot}"]
    with torch.no_grad():
        _, local = next(iter(_local_pieces(state)))
        local[index] = value
    dcp.save(sc._ck_state(src), checkpoint_id=str(tmp_path / "bad"))
    dst = sc._ck_model(1, "tw")
    sc._ck_train(dst, None, 0, 1, range(2))
    before = _dmp_bits(dst)
    # (one TBE's tables share its step counter: the first table's names the problem)
    table = "c_a" if slot == "step" else "c_b"
    with pytest.raises(ValueError, match=f"embedding_bags.{table}.weight.{table}.{slot}'") as e:
        load_dcp(dst, dst.fused_optimizer, str(tmp_path / "bad"))
    assert word in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _dmp_bits(dst)))


def test_load_dcp_of_a_checkpoint_without_steps_keeps_the_steps(one_process, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torchrec_ftrl.checkpoint import load_dcp
    sc = one_process
    src = sc._ck_model(1, "tw")
    sc._ck_train(src, None, 0, 1, range(2))
    state = sc._ck_state(src)
    for per_param in state["optim"]["state"].values():
        for key in [k for k in per_param if k.endswith(".step")]:
            del per_param[key]
    dcp.save(state, checkpoint_id=str(tmp_path / "old"))
    dst = sc._ck_model(1, "tw")
    sc._ck_train(dst, None, 0, 1, range(5))
    load_dcp(dst, dst.fused_optimizer, str(tmp_path / "old"))
    assert _steps(dst) == [5]
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    for a, b in zip(ftrl_tbes(src), ftrl_tbes(dst)):
        for name in ("weights_dev", "accum_dev", "linear_dev"):
            assert torch.equal(bits(getattr(a, name)), bits(getattr(b, name))), name
