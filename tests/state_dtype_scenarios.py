"""Worker body of the DMP test of bf16 FTRL state (tests/test_state_dtype_glue.py, 2 gloo processes
through ``conftest.run_distributed``). NEEDS the TBE keyword ``optimizer_state_dtypes``.

One EBC: two FTRL tables (table-wise, row-wise) from the sharders' fused_params in FBGEMM's dict form
``{"accum": SparseType.BF16, "linear": SparseType.BF16}``, and one stock row-wise Adagrad table in
backward, sharing the sharders. Expected values: the float64 reference (tests/reference.py) of the
global batch, within bf16 tolerances; the DCP round trip must be bitwise.
"""

from __future__ import annotations

import numpy as np
import torch

import torchrec_ftrl  # noqa: F401  (registers FTRL)
from dist_scenarios import (B_LOCAL, DIM, FUSED_KNOBS, ROWS, Reference, batch, copy_global_into, device,
                            local_kjt, pooled_row_grads, upstream)
from conftest import bits, device_type

TABLES, FEATS = ["s_tw", "s_rw"], ["sf_tw", "sf_rw"]
ADA = "s_ada"
# bf16 keeps 8 significant bits: a state is within 2^-8 relative of the value its fp32 math produced,
# and the weights (computed in fp32 from those states) inherit that per step.
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


def _model(ws: int):
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
        for n, f in zip([*TABLES, ADA], [*FEATS, "sf_ada"])], device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, [ebc.embedding_bags[ADA].weight], {"lr": 0.1})
    sharders = torchrec_ftrl.sharders({
        "optimizer": EmbOptimType.FTRL, **FUSED_KNOBS,
        "optimizer_state_dtypes": {"accum": SparseType.BF16, "linear": SparseType.BF16}})
    gens = {"s_tw": table_wise(rank=ws - 1), "s_rw": row_wise(), ADA: table_wise(rank=0)}
    plan = construct_module_sharding_plan(ebc, per_param_sharding=gens, sharder=sharders[0],
                                          local_size=ws, world_size=ws, device_type=device_type())
    for ps in plan.values():
        ps.compute_kernel = "fused"
    return DistributedModelParallel(ebc, device=device(), sharders=sharders, plan=ShardingPlan({"": plan}))


def _train(dmp, ref, rank, ws, steps):
    feats = [*FEATS, "sf_ada"]
    for step in steps:
        gb = batch(step, feats, rank, ws)
        up = upstream(step, ws, len(feats))
        out = dmp(local_kjt(gb, feats, rank)).to_dict()   # keys in the sharded module's order
        local_up = torch.from_numpy(up[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
        sum((out[f] * local_up[:, j]).sum() for j, f in enumerate(feats)).backward()
        if ref is not None:
            for j, (n, f) in enumerate(zip(TABLES, FEATS)):
                ref.step(n, *pooled_row_grads(gb[f], up[:, j], ws))


def _pieces(t):
    from torchrec_ftrl.checkpoint import _local_pieces
    return list(_local_pieces(t))


def _close(sharded, expected, what):
    for offsets, local in _pieces(sharded):
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
        np.testing.assert_allclose(local.double().cpu().numpy(), expected[sl], err_msg=what, **BF16_TOL)


def _state(dmp):
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _flat_bits(dmp) -> dict:
    out = {}
    msd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    for key, t in msd.items():
        out[key] = [(o, x.dtype, bits(x).numpy().tobytes()) for o, x in _pieces(t)]
    for pkey, states in osd.items():
        for skey, t in states.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out[skey] = [(o, x.dtype, bits(x).numpy().tobytes()) for o, x in _pieces(t)]
    return out


def bf16_state_train_and_dcp(rank: int, ws: int, ckpt_dir: str) -> None:
    """3 steps vs the reference, bf16 ShardedTensors in the optimizer state dict, the stock table on
    FBGEMM with fp32 state, then DCP save -> fresh model load bitwise, and one more step equal."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    from torchrec_ftrl.integration.compute_kernels import FTRLBatchedFusedEmbeddingBag

    dmp = _model(ws)
    ref = Reference({n: (ROWS, DIM) for n in TABLES})
    msd = dmp.state_dict()
    for n in TABLES:
        copy_global_into(msd[f"embedding_bags.{n}.weight"], ref.w[n])
    _train(dmp, ref, rank, ws, range(3))

    kernels = [k for m in dmp.modules() for lk in getattr(m, "_lookups", []) or []
               for k in getattr(getattr(lk, "module", lk), "_emb_modules", [])]
    for k in kernels:
        if isinstance(k, FTRLBatchedFusedEmbeddingBag):
            assert {s: d.name for s, d in k._emb_module.optimizer_state_dtypes.items()} == \
                {"accum": "BF16", "linear": "BF16"}
            assert k._emb_module.accum_dev.dtype == torch.bfloat16
        else:   # the in-backward row-wise Adagrad table: FBGEMM's TBE, never given FTRL's state dtypes
            assert type(k) is BatchedFusedEmbeddingBag, type(k)
            assert "optimizer_state_dtypes" not in (k._config.fused_params or {})
            assert k._emb_module.momentum1_dev.dtype == torch.float32

    msd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    for n in TABLES:
        key = f"embedding_bags.{n}.weight"
        _close(msd[key], ref.w[n], f"weight of {n}")
        if key in osd:
            for slot, expected in (("accum", ref.n[n]), ("linear", ref.z[n])):
                t = osd[key][f"{n}.{slot}"]
                assert t.dtype == torch.bfloat16, (n, slot, t.dtype)
                assert all(x.dtype == torch.bfloat16 for _, x in _pieces(t))
                _close(t, expected, f"{slot} of {n}")

    dcp.save(_state(dmp), checkpoint_id=f"{ckpt_dir}/dcp")
    fresh = _model(ws)
    state = _state(fresh)
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/dcp")
    fresh.load_state_dict(state["model"])
    fresh.fused_optimizer.load_state_dict(state["optim"])
    assert _flat_bits(fresh) == _flat_bits(dmp)
    # TorchRec does not checkpoint the TBE's step, which seeds the stochastic rounding
    fresh.fused_optimizer.set_optimizer_step(3)
    _train(dmp, None, rank, ws, range(3, 4))
    _train(fresh, None, rank, ws, range(3, 4))
    assert _flat_bits(fresh) == _flat_bits(dmp)
