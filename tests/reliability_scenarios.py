"""Worker bodies of tests/test_reliability_sharded.py (spawned gloo processes, ``conftest.run_distributed``).

Reuses the small DMP model and the float64 reference of tests/dist_scenarios.py. Expected values come
from ``ftrl_reference_rows`` fed with float64 row gradients computed here from the global batch.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

import dist_scenarios as sc
import torchrec_ftrl  # noqa: F401  (registers FTRL)
from conftest import bits
from torchrec_ftrl.checkpoint import _local_pieces


def local_snapshot(dmp, prefix="embedding_bags"):
    """Bytes of every local shard of every FTRL table's weight, accum and linear."""
    msd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    snap = {}
    for key, t in msd.items():
        if not key.startswith(prefix):
            continue
        snap[key] = [bits(local) for _, local in _local_pieces(t)]
        for slot, st in osd.get(key, {}).items():
            if isinstance(st, torch.Tensor) or hasattr(st, "local_shards"):
                snap[f"{key}/{slot}"] = [bits(local) for _, local in _local_pieces(st)]
    return snap


def assert_same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])), f"{what}: {k}"


# ------------------------------------------------------------------------------ NaN/Inf gradients
def nonfinite_sharded(rank: int, ws: int, sharding: str, out_dir: str) -> None:
    """One FTRL step through DMP with NaN/+Inf/-Inf in the upstream gradient of a few (sample,
    feature) pairs: every row whose summed gradient is non-finite keeps its bits and is counted once
    (on its owner), every other touched row matches the float64 reference."""
    dmp = sc._ck_model(ws, sharding)
    ref = sc.Reference({n: (sc.ROWS, sc.DIM) for n in sc.CK_TABLES})
    msd = dmp.state_dict()
    for n in sc.CK_TABLES:
        sc.copy_global_into(msd[f"embedding_bags.{n}.weight"], ref.w[n])
    sc._ck_train(dmp, ref, rank, ws, range(1))        # non-trivial accum/linear first
    before = {n: (ref.w[n].copy(), ref.z[n].copy(), ref.n[n].copy()) for n in sc.CK_TABLES}

    step = 1
    gb = sc.batch(step, sc.CK_FEATS, rank, ws)
    up = sc.upstream(step, ws, len(sc.CK_FEATS))
    rng = np.random.default_rng(77)
    # global sample, feature, column -> bad value (same on every rank)
    for k, bad in enumerate([np.nan, np.inf, -np.inf]):
        up[rng.integers(ws * sc.B_LOCAL), k % len(sc.CK_FEATS), rng.integers(sc.DIM)] = bad
    out = dmp(sc.local_kjt(gb, sc.CK_FEATS, rank))
    local_up = torch.from_numpy(up[rank * sc.B_LOCAL:(rank + 1) * sc.B_LOCAL]).float().to(sc.device())
    (out.values().view(sc.B_LOCAL, len(sc.CK_FEATS), sc.DIM) * local_up).sum().backward()

    flagged_total = 0
    for j, (n, f) in enumerate(zip(sc.CK_TABLES, sc.CK_FEATS)):
        ids, grads = sc.pooled_row_grads(gb[f], up[:, j], ws)
        summed = {}
        for r, g in zip(ids, grads):
            summed[r] = summed.get(r, 0) + np.asarray(g, dtype=np.float64)
        flagged = sorted(r for r, g in summed.items() if not np.isfinite(g).all())
        flagged_total += len(flagged)
        ok = [(r, g) for r, g in zip(ids, grads) if r not in flagged]
        if ok:
            ref.step(n, [r for r, _ in ok], [g for _, g in ok])
        for r in flagged:                               # skipped: pre-step values
            ref.w[n][r], ref.z[n][r], ref.n[n][r] = before[n][0][r], before[n][1][r], before[n][2][r]
    sc.check_tables(dmp, ref, "embedding_bags", sc.CK_TABLES)
    # Skipped rows bitwise: the local shard's row equals the pre-step value re-read from the model
    # after the first step (fp32), which the reference float64 copy cannot tell apart at TOL.
    counted = sum(int(k._emb_module.nonfinite_grad_rows) for k in sc.ftrl_kernels(dmp))
    total = torch.tensor([counted], dtype=torch.int64)
    dist.all_reduce(total)
    assert flagged_total > 0
    assert int(total) == flagged_total, (int(total), flagged_total)


def nonfinite_sharded_bitwise(rank: int, ws: int, sharding: str, out_dir: str) -> None:
    """Skipped rows keep their exact bits: snapshot the rows before the step, compare after."""
    dmp = sc._ck_model(ws, sharding)
    sc._ck_train(dmp, None, rank, ws, range(1))
    gb = sc.batch(1, sc.CK_FEATS, rank, ws)
    up = sc.upstream(1, ws, len(sc.CK_FEATS))
    up[:, 0, 0] = np.nan                                 # every bag of feature 0: all its rows skipped
    msd = dmp.state_dict()
    osd = dmp.fused_optimizer.state_dict()["state"]
    key = f"embedding_bags.{sc.CK_TABLES[0]}.weight"
    tensors = [msd[key]] + ([osd[key][f"{sc.CK_TABLES[0]}.{s}"] for s in ("accum", "linear")] if key in osd else [])
    before = [[bits(local) for _, local in _local_pieces(t)] for t in tensors]
    out = dmp(sc.local_kjt(gb, sc.CK_FEATS, rank))
    local_up = torch.from_numpy(up[rank * sc.B_LOCAL:(rank + 1) * sc.B_LOCAL]).float()
    (out.values().view(sc.B_LOCAL, len(sc.CK_FEATS), sc.DIM) * local_up).sum().backward()
    after = [[bits(local) for _, local in _local_pieces(t)] for t in tensors]
    for b, a in zip(before, after):
        assert all(torch.equal(x, y) for x, y in zip(b, a))


# ------------------------------------------------------------------------------ corrupt imports
def _corrupt_file(kind: str, good: str, path: str) -> None:
    arrays = dict(np.load(good))
    t0, t1 = sc.CK_TABLES
    if kind == "missing_accum":
        del arrays[f"{t1}/accum"]
    elif kind == "missing_weight":
        del arrays[t0]
    elif kind == "weight_shape":
        arrays[t0] = arrays[t0][:-1]
    elif kind == "linear_shape":
        arrays[f"{t1}/linear"] = arrays[f"{t1}/linear"][:, :-1]
    elif kind == "other_table_names":
        arrays = {k.replace(t1, "c_other"): v for k, v in arrays.items()}
    elif kind == "garbage":
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 this is not a zip archive" * 4)
        return
    elif kind == "empty_file":
        open(path, "wb").close()
        return
    with open(path, "wb") as f:
        np.savez(f, **arrays)


IMPORT_CORRUPTIONS = {
    # kind: text the ValueError must contain
    "missing_accum": "c_b/accum",
    "missing_weight": "'c_a'",
    "weight_shape": "c_a",
    "linear_shape": "c_b/linear",
    "other_table_names": "c_b",
    "garbage": "corrupt.npz",
    "empty_file": "corrupt.npz",
}


def corrupt_import(rank: int, ws: int, sharding: str, out_dir: str) -> None:
    """Every corrupt/mismatched file: ValueError naming the table/slot (or the file); local shards of
    every weight, accum and linear bitwise unchanged; then the good file still imports."""
    import pytest
    from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables
    dmp = sc._ck_model(ws, sharding)
    sc._ck_train(dmp, None, rank, ws, range(2))
    good = os.path.join(out_dir, "good.npz")
    export_ftrl_tables(dmp, good)
    sc._ck_train(dmp, None, rank, ws, range(2, 3))       # the model now differs from the file
    for kind, text in IMPORT_CORRUPTIONS.items():
        path = os.path.join(out_dir, f"{kind}-corrupt.npz")
        if rank == 0:
            _corrupt_file(kind, good, path)
        dist.barrier()
        before = local_snapshot(dmp)
        with pytest.raises(ValueError) as e:
            import_ftrl_tables(dmp, path)
        assert text in str(e.value), (kind, str(e.value))
        assert_same(before, local_snapshot(dmp), kind)
    import_ftrl_tables(dmp, good)
    saved = np.load(good)
    msd = dmp.state_dict()
    for n in sc.CK_TABLES:
        for offsets, local in _local_pieces(msd[f"embedding_bags.{n}.weight"]):
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            assert np.array_equal(local.numpy(), saved[n][sl])


# ------------------------------------------------------------------ DCP into other tables
def _model(ws, tables):
    """DMP over an EBC of ``tables`` = [(name, rows)], row-wise, FTRL."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=sc.DIM, num_embeddings=rows, feature_names=[f"f_{n}"]) for n, rows in tables],
        device=torch.device("meta"))
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **sc.FUSED_KNOBS})
    plan = construct_module_sharding_plan(ebc, per_param_sharding={n: row_wise() for n, _ in tables},
                                          sharder=sharders[0], local_size=ws, world_size=ws,
                                          device_type=sc.device_type())
    for ps in plan.values():
        ps.compute_kernel = "fused"
    return DistributedModelParallel(ebc, device=sc.device(), sharders=sharders, plan=ShardingPlan({"": plan}))


def _train(dmp, names, rank, ws):
    feats = [f"f_{n}" for n in names]
    gb = sc.batch(0, feats, rank, ws)
    up = sc.upstream(0, ws, len(feats))
    out = dmp(sc.local_kjt(gb, feats, rank))
    local_up = torch.from_numpy(up[rank * sc.B_LOCAL:(rank + 1) * sc.B_LOCAL]).float()
    (out.values().view(sc.B_LOCAL, len(feats), sc.DIM) * local_up).sum().backward()


DCP_MISMATCHES = {
    # kind: (tables of the loading model, text the error must contain)
    "other_table_name": ([("c_a", sc.ROWS), ("c_x", sc.ROWS)], "c_x"),
    "other_rows": ([("c_a", sc.ROWS), ("c_b", sc.ROWS + 8)], "c_b"),
    "extra_table": ([("c_a", sc.ROWS), ("c_b", sc.ROWS), ("c_c", sc.ROWS)], "c_c"),
}


def dcp_into_other_tables(rank: int, ws: int, out_dir: str) -> None:
    """A DCP checkpoint of tables (c_a, c_b) loaded into models with other tables or sizes: DCP's
    load raises (CheckpointException naming the key) before reading; nothing is modified."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    src = _model(ws, [("c_a", sc.ROWS), ("c_b", sc.ROWS)])
    _train(src, ["c_a", "c_b"], rank, ws)
    ckpt = os.path.join(out_dir, "dcp")
    dcp.save({"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()}, checkpoint_id=ckpt)
    for kind, (tables, text) in DCP_MISMATCHES.items():
        dst = _model(ws, tables)
        _train(dst, [n for n, _ in tables], rank, ws)
        before = local_snapshot(dst)
        state = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
        try:
            dcp.load(state, checkpoint_id=ckpt)
        except CheckpointException as e:
            msg = str(e)
        else:
            raise AssertionError(f"{kind}: DCP load into other tables did not raise")
        assert text in msg, (kind, msg[-2000:])
        assert_same(before, local_snapshot(dst), kind)


# ------------------------------------------------------------------------------ grouped workers
def all_nonfinite(rank: int, ws: int, out_dir: str) -> None:
    for sharding in ("tw", "rw"):
        nonfinite_sharded(rank, ws, sharding, out_dir)
        nonfinite_sharded_bitwise(rank, ws, sharding, out_dir)


def all_checkpoints(rank: int, ws: int, out_dir: str) -> None:
    corrupt_import(rank, ws, "rw", out_dir)
    dcp_into_other_tables(rank, ws, out_dir)
