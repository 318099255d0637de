"""Compact (bf16) FTRL optimizer state, the glue side: the dense ``torchrec_ftrl.FTRL(state_dtype=...)``,
``optimizer_state_dtypes`` / ``state_dtype`` in fused_params (hashable form, sharders, TBE kwargs,
stock groups), in-backward kwargs, export / import of bf16 states, the job's ``--ftrl-state-dtype``.

Expected values are independent of the code under test: the float64 rule of tests/reference.py,
a NumPy transcription of the documented rounding hash (``torchrec_ftrl/state_dtype.py`` docstring of
``sr_bits``), and hand-computed bf16 / fp32 values.

Tests marked ``needs_tbe_state_dtypes`` build an FTRL TBE with ``optimizer_state_dtypes=`` and wait
for that keyword in ``torchrec_ftrl/tbe/module.py``; every other test runs on the current TBE.
"""

from __future__ import annotations

import inspect
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType

import torchrec_ftrl
from conftest import bits, run_job
from reference import ftrl_reference_step

BF16 = SparseType.BF16.as_int()
FTRL_FUSED = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1}
KNOBS = dict(lr=0.1, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.5)
REF_KNOBS = dict(lr=0.1, l1=0.01, l2=0.02, beta=0.5)

_TBE_HAS_KEYWORD = "optimizer_state_dtypes" in inspect.signature(
    torchrec_ftrl.FTRLTableBatchedEmbeddingBags.__init__).parameters
needs_tbe_state_dtypes = pytest.mark.skipif(
    not _TBE_HAS_KEYWORD, reason="needs FTRLTableBatchedEmbeddingBags(optimizer_state_dtypes=...) (TBE side of #29)")


# --------------------------------------------------------------- independent transcriptions

_M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """C. Wellons' lowbias32, as the docstring of ``torchrec_ftrl.state_dtype.sr_bits`` states it."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _sr_bits(row: int, col: int, step: int, state: int) -> int:
    h = _lowbias32(step * 0x9E3779B9 + state)
    h = _lowbias32(h ^ (row & _M32) ^ ((row >> 32) & _M32))
    return ((h + col * 0x9E3779B9) & _M32) >> 16


def _round_bf16_sr(x32: np.float32, r: int) -> np.float32:
    """Add the 16 random bits to the fp32 pattern, truncate to the top 16 bits (finite ``x32``)."""
    u = int(np.array(x32, dtype=np.float32).view(np.uint32))
    u = ((u + r) & 0xFFFF0000) & _M32
    return np.array(u, dtype=np.uint32).view(np.float32)


def _bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 (8 significant bits) at |x| (normal range; 2^-133 at 0)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 2.0 ** -126)))
    return 2.0 ** (e - 7)


def _f64(t):
    return t.detach().double().cpu().numpy()


# --------------------------------------------------------------------------- dense FTRL, bf16


def _grad(kind: str, shape, step: int, zero_rows=(1,)):
    g = torch.from_numpy(np.random.default_rng(100 + step).normal(size=shape)).float()
    for r in zero_rows:
        g[r] = 0
    if kind == "sparse":
        rows = [r for r in range(shape[0]) if r not in zero_rows]
        idx = torch.tensor([rows + rows[:1]])            # a duplicate of the first row: summed first
        vals = torch.cat([g[rows], torch.full((1,) + tuple(shape[1:]), 0.25)])
        g[rows[0]] += 0.25
        return torch.sparse_coo_tensor(idx, vals, size=shape), g
    return g, g


@pytest.mark.parametrize("kind", ["dense", "sparse", "dense_all_rows"])
def test_dense_bf16_state_follows_the_float64_rule_within_one_bf16_ulp(kind):
    """Each step from the optimizer's current (bf16) state: the weight within fp32 tolerance of the
    float64 rule, each stored state within 1 bf16 ulp of the float64 value (+ fp32 tolerance); rows
    with a zero gradient keep their bits (skip_zero_grad_rows), unless skip_zero_grad_rows=False."""
    shape = (5, 3)
    p = torch.nn.Parameter(torch.from_numpy(np.random.default_rng(0).uniform(-0.1, 0.1, shape)).float())
    skip = kind != "dense_all_rows"
    opt = torchrec_ftrl.FTRL([p], state_dtype=torch.bfloat16, skip_zero_grad_rows=skip,
                             ftrl_initial_accumulator_value=0.1, **KNOBS)
    for step in range(4):
        grad, dense = _grad("sparse" if kind == "sparse" else "dense", shape, step)
        st = opt.state.get(p)
        w0 = _f64(p)
        n0 = _f64(st["accum"]) if st else np.full(shape, float(torch.tensor(0.1, dtype=torch.bfloat16)))
        z0 = _f64(st["linear"]) if st else np.zeros(shape)
        before = [bits(p), bits(st["accum"]), bits(st["linear"])] if st else None
        p.grad = grad
        opt.step()
        n, z = opt.state[p]["accum"], opt.state[p]["linear"]
        assert n.dtype == z.dtype == torch.bfloat16 and p.dtype == torch.float32
        w_ref, z_ref, n_ref = ftrl_reference_step(w0, z0, n0, _f64(dense), **REF_KNOBS)
        touched = np.ones(shape[0], bool) if not skip else (_f64(dense) != 0).any(axis=1)
        assert not touched.all() or not skip
        t = touched
        np.testing.assert_allclose(_f64(p)[t], w_ref[t], rtol=1e-5, atol=1e-6)
        for got, ref in ((_f64(n), n_ref), (_f64(z), z_ref)):
            err = np.abs(got[t] - ref[t])
            assert (err <= _bf16_ulp(ref[t]) + 1e-5 * np.abs(ref[t]) + 1e-7).all(), (step, err.max())
        if before is not None and skip:
            for tensor, b in zip((p, n, z), before):
                rows = ~t
                assert torch.equal(bits(tensor[torch.from_numpy(rows)]),
                                   b.view(tensor.dtype).view(shape)[torch.from_numpy(rows)].contiguous()
                                   .view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("shape", [(4, 3), (6,), (2, 2, 3)])
def test_dense_bf16_rounding_is_keyed_by_row_column_step_and_state(shape):
    """The stored bf16 state is the fp32 rule's value rounded with the documented hash of (row index
    along dim 0 (1-D: the element index), flattened column within the row (1-D: 0), the step before
    the update, state 0 accum / 1 linear): bit for bit, at step 0 and at step 1. The fp32 value is
    the fp32-state optimizer's, started from the same (bf16-exact) state."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.uniform(-0.1, 0.1, shape)).float()
    p16, p32 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    o16 = torchrec_ftrl.FTRL([p16], state_dtype="bf16", **KNOBS)
    o32 = torchrec_ftrl.FTRL([p32], **KNOBS)
    rows = shape[0]
    cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    for step in range(2):
        g = torch.from_numpy(rng.normal(size=shape)).float()
        if step == 1:   # start the fp32 optimizer from the bf16 optimizer's state and weight
            with torch.no_grad():
                p32.copy_(p16)
            o32.state[p32]["accum"] = o16.state[p16]["accum"].float()
            o32.state[p32]["linear"] = o16.state[p16]["linear"].float()
        p16.grad, p32.grad = g.clone(), g.clone()
        o16.step()
        o32.step()
        assert torch.equal(bits(p16), bits(p32))     # the weight comes from the fp32 math: equal
        for key, state in (("accum", 0), ("linear", 1)):
            x32 = o32.state[p32][key].reshape(rows, cols).numpy()
            got = o16.state[p16][key].float().reshape(rows, cols).numpy()
            want = np.array([[_round_bf16_sr(x32[r, c], _sr_bits(r, c, step, state)) for c in range(cols)]
                             for r in range(rows)], dtype=np.float32)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (key, step)


def test_dense_bf16_state_is_bitwise_reproducible():
    def run():
        torch.manual_seed(3)
        p = torch.nn.Parameter(torch.randn(8, 4))
        opt = torchrec_ftrl.FTRL([p], state_dtype=SparseType.BF16, **KNOBS)
        for step in range(3):
            torch.manual_seed(10 + step)
            p.grad = torch.randn(8, 4)
            opt.step()
        return [bits(p), bits(opt.state[p]["accum"]), bits(opt.state[p]["linear"])]
    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_dense_state_dtype_spellings_and_default():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    for value in (torch.bfloat16, SparseType.BF16, "bf16", "BF16", BF16,
                  {"accum": SparseType.BF16, "linear": SparseType.BF16}):
        key = "optimizer_state_dtypes" if isinstance(value, dict) else "state_dtype"
        opt = torchrec_ftrl.FTRL([p], **{key: value})
        assert opt.param_groups[0]["state_dtype"] == "bf16"
        p.grad = torch.ones(2, 2)
        opt.step()
        assert opt.state[p]["accum"].dtype == torch.bfloat16
    opt = torchrec_ftrl.FTRL([p])
    p.grad = torch.ones(2, 2)
    opt.step()
    assert opt.param_groups[0]["state_dtype"] == "fp32" and opt.state[p]["accum"].dtype == torch.float32
    p64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torchrec_ftrl.FTRL([p64], state_dtype="fp32")
    p64.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    assert opt.state[p64]["linear"].dtype == torch.float64


@pytest.mark.parametrize("kwargs, match", [
    ({"state_dtype": torch.float16}, r"state_dtype must be fp32 or bf16.*torch.float16"),
    ({"state_dtype": "fp64"}, r"state_dtype must be fp32 or bf16.*'fp64'"),
    ({"state_dtype": 1.5}, r"state_dtype must be fp32 or bf16.*1.5"),
    ({"optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.FP32}},
     r"different dtypes.*pass state_dtype"),
    ({"optimizer_state_dtypes": {"momentum1": SparseType.BF16}}, r"FTRL's state names.*'momentum1'"),
    ({"state_dtype": "fp32", "optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.BF16}},
     r"state_dtype='fp32' and optimizer_state_dtypes=.*differ"),
])
def test_dense_bad_state_dtype_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        torchrec_ftrl.FTRL([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_dense_bf16_refused_for_fp64_params_and_for_a_changed_group():
    with pytest.raises(ValueError, match=r"state_dtype='bf16' but parameter 1 is torch.float64"):
        torchrec_ftrl.FTRL([torch.nn.Parameter(torch.zeros(2)),
                            torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], state_dtype="bf16")
    opt = torchrec_ftrl.FTRL([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"parameter 0 is torch.float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))],
                             "state_dtype": torch.bfloat16})
    assert len(opt.param_groups) == 1
    p = torch.nn.Parameter(torch.ones(3))
    opt = torchrec_ftrl.FTRL([p])
    p.grad = torch.ones(3)
    opt.step()
    before = [bits(p), bits(opt.state[p]["accum"])]
    opt.param_groups[0]["state_dtype"] = "bf16"
    with pytest.raises(ValueError, match=r"state dtype cannot change once the state exists"):
        opt.step()
    assert torch.equal(before[0], bits(p)) and torch.equal(before[1], bits(opt.state[p]["accum"]))


def test_dense_bf16_state_dict_round_trip_and_mismatch_refused():
    p = torch.nn.Parameter(torch.randn(4, 2))
    opt = torchrec_ftrl.FTRL([p], state_dtype="bf16", **KNOBS)
    for _ in range(2):
        p.grad = torch.randn(4, 2)
        opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    same = torchrec_ftrl.FTRL([q], state_dtype="bf16", **KNOBS)
    same.load_state_dict(sd)
    for key in ("accum", "linear"):
        assert same.state[q][key].dtype == torch.bfloat16
        assert torch.equal(bits(same.state[q][key]), bits(opt.state[p][key]))
    fp32 = torchrec_ftrl.FTRL([torch.nn.Parameter(p.detach().clone())], **KNOBS)
    with pytest.raises(ValueError, match=r"saved param group 0 has state_dtype='bf16' but this optimizer's "
                                         r"group 0 has state_dtype='fp32'"):
        fp32.load_state_dict(sd)
    assert fp32.param_groups[0]["state_dtype"] == "fp32" and not fp32.state
    # a saved fp32 state dict (also one written before the knob: no state_dtype in its groups)
    old = torchrec_ftrl.FTRL([p], **KNOBS).state_dict()
    old["param_groups"][0].pop("state_dtype")
    with pytest.raises(ValueError, match=r"saved param group 0 has state_dtype='fp32'"):
        torchrec_ftrl.FTRL([torch.nn.Parameter(p.detach().clone())], state_dtype="bf16").load_state_dict(old)
    forged = {"state": {0: {**sd["state"][0], "accum": sd["state"][0]["accum"].float()}},
              "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match=r"saved accum of parameter 0 is torch.float32"):
        torchrec_ftrl.FTRL([torch.nn.Parameter(p.detach().clone())], state_dtype="bf16").load_state_dict(forged)


def test_in_backward_state_dtype_builds_bf16_dense_state():
    """``apply_optimizer_in_backward(torchrec.optim.FTRL, ..., {"state_dtype": ...})``: the per-parameter
    dense optimizer it builds keeps bf16 state, and the kwargs reach the fused_params as the TBE's
    row layout's state dtypes."""
    import torchrec
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec_ftrl.integration.compute_kernels import tbe_kwargs_from_fused_params
    emb = torch.nn.Embedding(6, 4)
    apply_optimizer_in_backward(torchrec.optim.FTRL, emb.parameters(), {"lr": 0.1, "state_dtype": torch.bfloat16})
    emb(torch.tensor([1, 2])).sum().backward()
    (inner,) = emb.weight._in_backward_optimizers
    assert inner.state[emb.weight]["accum"].dtype == torch.bfloat16
    # TorchRec merges sharder fused_params with the in-backward kwargs (the latter win)
    merged = {**FTRL_FUSED, "optimizer_state_dtypes": frozenset(), **emb.weight._optimizer_kwargs[0]}
    assert tbe_kwargs_from_fused_params(merged)["row_layout"].state_dtypes == {
        "accum": torch.bfloat16, "linear": torch.bfloat16}


# ---------------------------------------------------------------------------- fused_params


def test_sharders_turn_the_fbgemm_dict_into_the_hashable_form():
    given = {**FTRL_FUSED, "optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.BF16}}
    for sharder in torchrec_ftrl.sharders(given):
        fp = sharder.fused_params
        assert fp["optimizer_state_dtypes"] == frozenset({("accum", BF16), ("linear", BF16)})
        hash(tuple(sorted(fp.items())))   # TorchRec's grouping key must hash
    assert isinstance(given["optimizer_state_dtypes"], dict)   # the caller's dict is not modified
    one = torchrec_ftrl.sharders({**FTRL_FUSED, "optimizer_state_dtypes": {"linear": torch.bfloat16}})
    assert one[0].fused_params["optimizer_state_dtypes"] == frozenset({("linear", BF16)})
    both = torchrec_ftrl.sharders({**FTRL_FUSED, "state_dtype": "bf16"})
    assert both[1].fused_params["optimizer_state_dtypes"] == frozenset({("accum", BF16), ("linear", BF16)})
    assert "state_dtype" not in both[1].fused_params
    fp32 = torchrec_ftrl.sharders({**FTRL_FUSED, "optimizer_state_dtypes": {"accum": SparseType.FP32}})
    assert "optimizer_state_dtypes" not in fp32[0].fused_params
    hashable = frozenset({("accum", BF16), ("linear", BF16)})
    assert torchrec_ftrl.sharders({**FTRL_FUSED, "optimizer_state_dtypes": hashable})[0].fused_params[
        "optimizer_state_dtypes"] == hashable
    # the sharder classes themselves take the dict too
    from torchrec_ftrl.integration.sharders import FTRLEmbeddingBagCollectionSharder
    direct = FTRLEmbeddingBagCollectionSharder(fused_params={**FTRL_FUSED, "state_dtype": torch.bfloat16})
    assert direct.fused_params["optimizer_state_dtypes"] == hashable


@pytest.mark.parametrize("extra, match", [
    ({"optimizer_state_dtypes": {"accum": SparseType.FP16}},
     r"fused_params optimizer_state_dtypes\['accum'\] must be SparseType.FP32 or SparseType.BF16.*FP16"),
    ({"optimizer_state_dtypes": {"momentum1": SparseType.BF16}},
     r"optimizer_state_dtypes keys must be FTRL's state names.*'momentum1'"),
    ({"optimizer_state_dtypes": "bf16"}, r"optimizer_state_dtypes must be a dict.*'bf16'"),
    ({"state_dtype": "fp16"}, r"fused_params state_dtype must be fp32 or bf16.*'fp16'"),
    ({"state_dtype": "bf16", "optimizer_state_dtypes": {"accum": SparseType.BF16}},
     r"both state_dtype='bf16' and optimizer_state_dtypes=.*give one of them"),
])
def test_sharders_refuse_bad_state_dtypes_naming_key_and_value(extra, match):
    with pytest.raises(ValueError, match=match):
        torchrec_ftrl.sharders({**FTRL_FUSED, **extra})


def test_tbe_kwargs_get_the_state_dtypes_only_when_compact():
    from torchrec_ftrl.integration.compute_kernels import tbe_kwargs_from_fused_params
    from torchrec_ftrl.row_layout import RowLayout
    from torchrec_ftrl.state_dtype import state_dtypes_from_options
    kw = tbe_kwargs_from_fused_params({**FTRL_FUSED, "optimizer_state_dtypes": frozenset({("accum", BF16)})})
    assert kw["row_layout"] == RowLayout(accum_dtype=torch.bfloat16)
    assert "optimizer_state_dtypes" not in kw
    assert tbe_kwargs_from_fused_params(dict(FTRL_FUSED))["row_layout"] == RowLayout()
    assert tbe_kwargs_from_fused_params(
        {**FTRL_FUSED, "optimizer_state_dtypes": frozenset()})["row_layout"] == RowLayout()
    # a table's own state_dtype (its in-backward kwargs) wins over the sharder's optimizer_state_dtypes
    assert state_dtypes_from_options({"optimizer_state_dtypes": frozenset({("accum", BF16), ("linear", BF16)}),
                               "state_dtype": "fp32"}) == {"accum": torch.float32, "linear": torch.float32}
    assert state_dtypes_from_options({"state_dtype": None, "optimizer_state_dtypes": {"linear": "bf16"}}) == {
        "accum": torch.float32, "linear": torch.bfloat16}


def test_stock_groups_never_receive_ftrl_state_dtypes():
    """A non-FTRL group under the routed ``_create_embedding_kernel`` reaches TorchRec's original
    without FTRL's ``optimizer_state_dtypes`` (FBGEMM asserts it is None for its other optimizers)
    and without ``ftrl_*`` knobs; another optimizer's own state names are left alone."""
    from torchrec_ftrl.integration.routing import routed_create_embedding_kernel
    seen = []

    def original(self, config, device=None, pg=None, sharding_type=None):
        seen.append(dict(config.fused_params))
        return "stock"

    routed = routed_create_embedding_kernel(original, kernel_cls=None)
    ours = frozenset({("accum", BF16), ("linear", BF16)})
    config = SimpleNamespace(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1,
                                           "optimizer_state_dtypes": ours, "ftrl_l1_reg": 0.1})
    assert routed(object(), config) == "stock"
    assert seen[-1] == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    theirs = frozenset({("momentum1", BF16)})
    config = SimpleNamespace(fused_params={"optimizer": EmbOptimType.PARTIAL_ROWWISE_ADAM,
                                           "optimizer_state_dtypes": theirs})
    routed(object(), config)
    assert seen[-1]["optimizer_state_dtypes"] == theirs


def test_in_backward_kwargs_become_hashable_at_shard():
    """The FBGEMM dict in ``apply_optimizer_in_backward`` kwargs is made hashable by the sharder
    before TorchRec groups the tables (the caller's dict untouched); a bad one names the table."""
    import torchrec
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=10,
                                                            feature_names=[f"f{n}"]) for n in ("a", "b", "c")])
    given = {"lr": 0.1, "optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.BF16}}
    apply_optimizer_in_backward(torchrec.optim.FTRL, [ebc.embedding_bags["a"].weight], given)
    apply_optimizer_in_backward(torchrec.optim.FTRL, [ebc.embedding_bags["b"].weight],
                                {"lr": 0.1, "state_dtype": "fp32"})
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, [ebc.embedding_bags["c"].weight], {"lr": 0.1})
    sharder = torchrec_ftrl.sharders()[0]
    sharder._canonical_in_backward_kwargs(ebc)
    kw = {n: ebc.embedding_bags[n].weight._optimizer_kwargs[0] for n in "abc"}
    assert kw["a"] == {"lr": 0.1, "optimizer_state_dtypes": frozenset({("accum", BF16), ("linear", BF16)})}
    assert kw["b"] == {"lr": 0.1, "optimizer_state_dtypes": frozenset()}   # explicit fp32 overrides a sharder's
    assert kw["c"] == {"lr": 0.1}
    assert isinstance(given["optimizer_state_dtypes"], dict)
    ebc.embedding_bags["a"].weight._optimizer_kwargs = [{"lr": 0.1, "optimizer_state_dtypes": {"accum": "fp16"}}]
    with pytest.raises(ValueError, match=r"table 'a' in-backward FTRL kwargs optimizer_state_dtypes\['accum'\]"):
        sharder._canonical_in_backward_kwargs(ebc)


# ----------------------------------------------------------------------- export / import


class _FakeModel(torch.nn.Module):
    """The two state dicts export/import read, with given tensors (no TBE involved)."""

    def __init__(self, weight, accum, linear):
        super().__init__()
        self._w = weight
        self.fused_optimizer = SimpleNamespace(state_dict=lambda: {
            "state": {"ebc.t.weight": {"t.accum": accum, "t.linear": linear}}})

    def state_dict(self, *args, **kwargs):
        return {"ebc.t.weight": self._w}


def test_export_upcasts_bf16_state_exactly_and_import_rounds_to_nearest_even(tmp_path):
    from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables
    # bf16-exact values (8 significant bits) and their fp32 equals, written by hand
    accum_vals = [1.0078125, 3.0, 0.0, 1e-3]   # 1e-3 is not bf16-exact: its bf16 is 0.00099945068359375
    accum = torch.tensor([accum_vals], dtype=torch.bfloat16)
    linear = torch.tensor([[-0.5, 256.0, -1.5, 2.0 ** -20]], dtype=torch.bfloat16)
    model = _FakeModel(torch.zeros(1, 4), accum, linear)
    path = str(tmp_path / "t.npz")
    export_ftrl_tables(model, path)
    saved = np.load(path)
    assert saved["t/accum"].dtype == np.float32
    assert saved["t/accum"].tolist() == [[1.0078125, 3.0, 0.0, 0.00099945068359375]]
    assert saved["t/linear"].tolist() == [[-0.5, 256.0, -1.5, 2.0 ** -20]]
    # import into bf16 state: round to nearest, ties to even
    arrays = {k: saved[k] for k in saved.files}
    arrays["t/accum"] = np.array([[1.00390625,                # 1 + 2^-8: tie between 1 and 1 + 2^-7 -> 1.0
                                   1.01171875,                # 1 + 3*2^-8: tie -> 1 + 2^-6 (even)
                                   1.0 + 2.0 ** -8 + 2.0 ** -20,   # above the tie -> 1 + 2^-7
                                   3.0078125]], np.float32)   # 3 + 2^-7: tie -> 3.0 (even)
    np.savez(path, **arrays)
    target = _FakeModel(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bfloat16),
                        torch.zeros(1, 4, dtype=torch.bfloat16))
    import_ftrl_tables(target, path)
    acc = target.fused_optimizer.state_dict()["state"]["ebc.t.weight"]["t.accum"]
    assert acc.dtype == torch.bfloat16
    assert acc.float().tolist() == [[1.0, 1.015625, 1.0078125, 3.0]]


# ------------------------------------------------------------------------------- the job


def test_cli_state_dtype_flag_maps_to_the_hashable_fused_param():
    from torchrec_ftrl.job import cli
    from torchrec_ftrl.job.train import summary_fused_params
    a = cli.parse_args([])
    assert a.ftrl_state_dtype == "fp32" and "optimizer_state_dtypes" not in cli.sparse_fused_params(a)
    fp = cli.sparse_fused_params(cli.parse_args(["--ftrl-state-dtype", "bf16"]))
    assert fp["optimizer_state_dtypes"] == frozenset({("accum", BF16), ("linear", BF16)})
    assert summary_fused_params(fp)["optimizer_state_dtypes"] == "accum=bf16, linear=bf16"
    json.dumps(summary_fused_params(fp))
    for bad in (["--ftrl-state-dtype", "fp16"],
                ["--ftrl-state-dtype", "bf16", "--sparse-optimizer", "rowwise_adagrad"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


def test_resume_refuses_another_state_dtype():
    from torchrec_ftrl.job.atomic_checkpoint import CheckpointError, check_ftrl_state_dtype
    check_ftrl_state_dtype("p", {"args": {"ftrl_state_dtype": "bf16"}}, "bf16", "ftrl")
    check_ftrl_state_dtype("p", {"args": {}}, "fp32", "ftrl")   # a checkpoint from before the flag: fp32
    with pytest.raises(CheckpointError, match=r"holds FTRL state in fp32 .* asks for --ftrl-state-dtype bf16"):
        check_ftrl_state_dtype("p", {"args": {}}, "bf16", "ftrl")
    with pytest.raises(CheckpointError, match=r"holds FTRL state in bf16 .*resume with --ftrl-state-dtype bf16"):
        check_ftrl_state_dtype("p", {"args": {"ftrl_state_dtype": "bf16"}}, "fp32", "ftrl")
    check_ftrl_state_dtype("p", {"args": {"sparse_optimizer": "rowwise_adagrad"}}, "fp32", "rowwise_adagrad")


def test_job_resume_with_another_state_dtype_fails_in_one_line(tmp_path):
    small = ["--num-embeddings", "200", "--no-progress", "--batch-size", "32", "--steps", "2",
             "--eval-every", "2", "--val-batches", "1", "--checkpoint-dir", str(tmp_path / "ck"),
             "--output-dir", str(tmp_path / "out")]
    p = run_job(small)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sparse=ftrl (state fp32)" in p.stdout
    with open(tmp_path / "out" / "train_ctr_summary.json") as f:
        assert json.load(f)["ftrl_state_dtype"] == "fp32"
    p = run_job([*small, "--steps", "3", "--resume", "--ftrl-state-dtype", "bf16"])
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert "train_ctr: error: --resume: checkpoint" in p.stderr and "holds FTRL state in fp32" in p.stderr
    assert "Traceback" not in p.stderr


# ----------------------------------------------------------- needs the TBE keyword (#29 TBE side)


@needs_tbe_state_dtypes
def test_kernel_builds_a_bf16_state_tbe_from_fused_params():
    from torchrec_ftrl.integration.compute_kernels import tbe_kwargs_from_fused_params
    kwargs = tbe_kwargs_from_fused_params(torchrec_ftrl.sharders(
        {**FTRL_FUSED, "optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.BF16}})[0]
        .fused_params)
    tbe = torchrec_ftrl.FTRLTableBatchedEmbeddingBags([(10, 4)], **kwargs)
    assert tbe.accum_dev.dtype == tbe.linear_dev.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for pair in tbe.split_optimizer_states() for t in pair)


@needs_tbe_state_dtypes
def test_dmp_bf16_state_trains_and_round_trips_through_dcp(run_distributed, tmp_path):
    import state_dtype_scenarios as sc
    run_distributed(sc.bf16_state_train_and_dcp, 2, str(tmp_path))
