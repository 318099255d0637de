"""Worker bodies of tests/test_state_paths.py (spawned gloo processes, ``conftest.run_distributed``):
TorchRec paths that move or sync optimizer state, with FTRL tables.

Full tables are assembled from every rank's local shards (:func:`full_state`), as raw bits, so
"bitwise" compares bytes (NaN == NaN, -0.0 != 0.0).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torchrec_ftrl
from conftest import device_type
from dist_scenarios import B_LOCAL, DIM, FUSED_KNOBS, ROWS, batch, copy_global_into, device, global_init, \
    local_kjt, upstream

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def full_state(module) -> dict[str, np.ndarray]:
    """Every ShardedTensor of the sharded ``module`` (weights and fused optimizer states, keys of
    :func:`torchrec_ftrl.integration.resharding.sharded_state`) as a full array of its raw bits,
    the same on every rank."""
    from torchrec_ftrl.integration.resharding import sharded_state
    state = sharded_state(module)
    mine = {k: [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu().contiguous()) for s in t.local_shards()]
            for k, t in state.items()}
    shapes = {k: (tuple(t.metadata().size), t.metadata().tensor_properties.dtype) for k, t in state.items()}
    parts, shape_parts = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: [(o, t.view(_INT_OF_SIZE[t.element_size()]).numpy()) for o, t in v]
                                   for k, v in mine.items()})
    dist.all_gather_object(shape_parts, shapes)
    out: dict[str, np.ndarray] = {}
    for sp in shape_parts:
        for k, (shape, dtype) in sp.items():
            out.setdefault(k, np.zeros(shape, dtype=np.dtype(f"int{8 * torch.empty(0, dtype=dtype).element_size()}")))
    filled = {k: np.zeros(v.shape, dtype=bool) for k, v in out.items()}
    for part in parts:
        for k, pieces in part.items():
            for offsets, arr in pieces:
                sl = tuple(slice(o, o + s) for o, s in zip(offsets, arr.shape))
                out[k][sl] = arr.view(out[k].dtype)
                filled[k][sl] = True
    assert all(f.all() for f in filled.values()), [k for k, f in filled.items() if not f.all()]
    return out


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert sorted(a) == sorted(b), (what, sorted(a), sorted(b))
    differ = [k for k in sorted(a) if not np.array_equal(a[k], b[k])]
    assert not differ, f"{what}: {differ} differ"


class SparseDense(torch.nn.Module):
    """An EBC and one dense Linear (DMP wraps the dense part in DDP, which dynamic sharding needs)."""

    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, kjt):
        return self.ebc(kjt), self.dense


RESHARD_TABLES = {"a": "tw0", "b": "tw1", "c": "cw", "s": "tw0"}   # s: stock row-wise Adagrad


def _reshard_model(rank, ws, placements, kernel="fused", state_dtype=None):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    ebc = _meta_ebc(list(placements))
    if "s" in placements:
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.embedding_bags["s"].parameters(), {"lr": 0.05})
    sharders = _sharders(state_dtype)
    model = SparseDense(ebc)
    plan = ShardingPlan({"ebc": module_plan(ebc, sharders[0], ws, placements, kernel)})
    dmp = DistributedModelParallel(model, device=device(), sharders=sharders, plan=plan)
    msd = dmp.state_dict()
    for t in placements:
        copy_global_into(msd[f"ebc.embedding_bags.{t}.weight"], global_init(t, ROWS, DIM))
    with torch.no_grad():
        dmp.module.dense.weight.fill_(0.5)
        dmp.module.dense.bias.zero_()
    return dmp


def module_plan(ebc, sharder, ws, placements, kernel="fused"):
    """``placements``: table -> "tw<rank>" | "cw" (ranks 0, 1) | "cw10" (ranks 1, 0) | "cw:<rank>,..."
    (one column shard per listed rank); every table on compute kernel ``kernel``."""
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    cw_ranks = {"cw": [0, 1], "cw10": [1, 0]}
    gens = {t: (table_wise(rank=int(p[2:])) if p.startswith("tw") else
                column_wise(ranks=cw_ranks.get(p) or [int(r) for r in p[3:].split(",")]))
            for t, p in placements.items()}
    plan = construct_module_sharding_plan(ebc, per_param_sharding=gens, sharder=sharder, local_size=ws,
                                          world_size=ws, device_type=device_type())
    for ps in plan.values():
        ps.compute_kernel = kernel
    return plan


def _train(dmp, rank, ws, steps):
    feats = [f"f_{t}" for t in dmp.module.ebc.module_sharding_plan]
    for step in steps:
        gb = batch(step, feats, rank, ws)
        up = upstream(step, ws, len(feats))
        pooled, dense = dmp(local_kjt(gb, feats, rank))
        local_up = torch.from_numpy(up[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
        emb = torch.stack([pooled[f] for f in feats], 1)   # a reshard may change the key order
        loss = (emb * local_up).sum() + 0.0 * dense(emb.detach()[:, 0]).sum()
        loss.backward()


def reshard_carries_ftrl_state(rank: int, ws: int) -> None:
    """DistributedModelParallel.reshard of a module with FTRL tables (a, b, c) and a stock row-wise
    Adagrad table (s): after 2 steps, a moves rank 0 -> 1 and b rank 1 -> 0 (a swap), c's column
    shards swap ranks and s moves rank 0 -> 1. Every weight and optimizer state is bitwise what it
    was, and 2 more steps give bitwise the state of a model that never moved. A refused reshard (a
    sharding type change) leaves the model, its plan and its training bitwise unchanged."""
    from torchrec.distributed.sharding.dynamic_sharding import output_sharding_plan_delta_single

    moved = _reshard_model(rank, ws, RESHARD_TABLES)
    still = _reshard_model(rank, ws, RESHARD_TABLES)
    _train(moved, rank, ws, range(2))
    _train(still, rank, ws, range(2))
    before = full_state(moved.module.ebc)
    assert_same_state(before, full_state(still.module.ebc), "two identical models")
    keys = sorted(before)
    assert any(k.endswith("/a.accum") for k in keys) and any(k.endswith("/a.linear") for k in keys), keys
    assert any(k.endswith("/s.momentum1") for k in keys), keys

    # a refused move: nothing changes
    sharder = _sharders()[0]
    old_plan = moved.plan.plan["ebc"]
    bad = module_plan(_meta_ebc(), sharder, ws, {**RESHARD_TABLES, "a": "cw"})
    _, bad_delta = output_sharding_plan_delta_single(old_plan, bad)
    lookups = list(moved.module.ebc._lookups)
    with pytest.raises(ValueError, match=r"table 'a' would change sharding type from 'table_wise' to 'column_wise'"):
        moved.reshard({"ebc": (0.0, bad_delta)}, sharded_module_fqn="ebc")
    assert list(moved.module.ebc._lookups) == lookups
    assert moved.module.ebc.module_sharding_plan["a"].sharding_type == "table_wise"
    assert_same_state(before, full_state(moved.module.ebc), "after a refused reshard")

    # the move
    new_placements = {"a": "tw1", "b": "tw0", "c": "cw10", "s": "tw1"}
    _, delta = output_sharding_plan_delta_single(old_plan, module_plan(_meta_ebc(), sharder, ws, new_placements))
    assert sorted(delta) == ["a", "b", "c", "s"], sorted(delta)
    moved.reshard({"ebc": (0.0, delta)}, sharded_module_fqn="ebc")
    plan_now = moved.module.ebc.module_sharding_plan
    assert plan_now["a"].ranks == [1] and plan_now["b"].ranks == [0] and plan_now["c"].ranks == [1, 0]
    assert moved.plan.plan["ebc"]["a"].ranks == [1]
    local_tables = {t.name for k in _kernels(moved) for t in k.config.embedding_tables}
    assert ("b" in local_tables) == (rank == 0) and ("a" in local_tables) == (rank == 1), local_tables
    assert_same_state(before, full_state(moved.module.ebc), "right after the reshard")

    _train(moved, rank, ws, range(2, 4))
    _train(still, rank, ws, range(2, 4))
    assert_same_state(full_state(still.module.ebc), full_state(moved.module.ebc), "2 steps after the reshard")

    # a swap from the identity feature order: TorchRec keeps _has_features_permute False
    placements = {"a": "tw0", "b": "tw1"}
    moved, still = _reshard_model(rank, ws, placements), _reshard_model(rank, ws, placements)
    _train(moved, rank, ws, range(1))
    _train(still, rank, ws, range(1))
    assert not moved.module.ebc._has_features_permute                   # features already in order
    _, delta = output_sharding_plan_delta_single(
        moved.plan.plan["ebc"], module_plan(_meta_ebc(["a", "b"]), sharder, ws, {"a": "tw1", "b": "tw0"}))
    moved.reshard({"ebc": (0.0, delta)}, sharded_module_fqn="ebc")
    _train(moved, rank, ws, range(1, 3))
    _train(still, rank, ws, range(1, 3))
    assert_same_state(full_state(still.module.ebc), full_state(moved.module.ebc), "after a swap")


def reshard_merges_column_shards(rank: int, ws: int) -> None:
    """Any world size (1 on one GPU): FTRL table c, column-wise over ranks [0, ws - 1] (two shards),
    becomes one shard on rank ws - 1, next to table-wise a; fp32 and bf16 states; on CUDA with each
    FTRL compute kernel. Every state is bitwise what it was, and 2 more steps give bitwise the
    never-moved model's."""
    from torchrec.distributed.sharding.dynamic_sharding import output_sharding_plan_delta_single
    kernels = ["fused", "fused_uvm", "fused_uvm_caching"] if device_type() == "cuda" else ["fused"]
    last = ws - 1
    for kernel, state_dtype in [(k, d) for k in kernels for d in (None, "bf16")]:
        placements = {"a": "tw0", "c": f"cw:0,{last}"}
        moved = _reshard_model(rank, ws, placements, kernel, state_dtype)
        still = _reshard_model(rank, ws, placements, kernel, state_dtype)
        _train(moved, rank, ws, range(2))
        _train(still, rank, ws, range(2))
        before = full_state(moved.module.ebc)
        new_plan = module_plan(_meta_ebc(["a", "c"]), _sharders(state_dtype)[0], ws, {"a": "tw0", "c": f"cw:{last}"},
                               kernel)
        _, delta = output_sharding_plan_delta_single(moved.plan.plan["ebc"], new_plan)
        assert sorted(delta) == ["c"], sorted(delta)
        moved.reshard({"ebc": (0.0, delta)}, sharded_module_fqn="ebc")
        assert len(moved.module.ebc.module_sharding_plan["c"].sharding_spec.shards) == 1
        assert any(v.dtype == np.int16 for v in before.values()) == (state_dtype == "bf16")
        assert_same_state(before, full_state(moved.module.ebc), f"{kernel}: right after the reshard")
        _train(moved, rank, ws, range(2, 4))
        _train(still, rank, ws, range(2, 4))
        want, got = full_state(still.module.ebc), full_state(moved.module.ebc)
        if state_dtype == "bf16":
            # c's shards change their columns, which key the stochastic rounding of bf16 states:
            # the same values up to rounding; a keeps its keys and its bits
            rerounded = [k for k in want if k.startswith("embedding_bags.c.")]
            for k in rerounded:
                np.testing.assert_allclose(_values(got[k]), _values(want[k]), rtol=2.0 ** -6, atol=1e-6, err_msg=k)
            want = {k: v for k, v in want.items() if k not in rerounded}
            got = {k: v for k, v in got.items() if k not in rerounded}
        assert_same_state(want, got, f"{kernel} {state_dtype}: 2 steps after")


def _values(bits: np.ndarray) -> np.ndarray:
    """float64 values of raw bits from :func:`full_state` (int32: fp32, int16: bf16)."""
    dtype = {np.dtype(np.int32): torch.float32, np.dtype(np.int16): torch.bfloat16}[bits.dtype]
    return torch.from_numpy(bits).view(dtype).double().numpy()


def _sharders(state_dtype=None):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    extra = {"state_dtype": state_dtype} if state_dtype else {}
    return torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS, **extra})


def _meta_ebc(tables=tuple(RESHARD_TABLES)):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{t}"]) for t in tables],
        device=torch.device("meta"))


def _kernels(dmp):
    from dist_scenarios import ftrl_kernels
    return ftrl_kernels(dmp)


# ------------------------------------------------------------------------------ 2D parallel
def _recompiled(fn, edits: list[tuple[str, str]], module):
    """``fn`` compiled from its own source with each regex edit applied exactly once."""
    src = textwrap.dedent(inspect.getsource(fn))
    for pattern, repl in edits:
        src, n = re.subn(pattern, repl, src)
        assert n == 1, f"{fn.__qualname__} changed ({pattern!r}): update the shim"
    namespace: dict = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), vars(module), namespace)
    return namespace[fn.__name__]


@contextlib.contextmanager
def dmp_collection_on_cpu():
    """Test-only shim for DMPCollection on CPU. Its constructor asserts a CUDA or MTIA device, and its
    ``_remap_sharding_plan`` writes placements ``rank:R/<device type>:<local rank>`` (a CUDA device
    index); the code around both (a DeviceMesh of the given device type and its process groups, DMP
    construction, grouping of the sharded modules, ``sync``) is device-neutral. Inside this context
    the stock constructor runs without that assert and the placements read ``rank:R/cpu``, both
    compiled from TorchRec's own source, the constructor still under torchrec_ftrl's wrapper."""
    from torchrec.distributed import model_parallel
    from torchrec_ftrl.integration.replica_sync import ftrl_dmp_collection_init

    cls = model_parallel.DMPCollection
    installed = {name: cls.__dict__[name] for name in ("__init__", "_remap_sharding_plan")}
    init = _recompiled(installed["__init__"].__wrapped__, [
        (r'assert \(\s*device\.type == "cuda" or device\.type == "mtia"\s*\),\s*'
         r'"DMPCollection only supports CUDA or MTIA"', "pass"),
        (r"super\(\)\.__init__\(", "DistributedModelParallel.__init__(self, ")], model_parallel)
    remap = _recompiled(installed["_remap_sharding_plan"], [
        (r'\{self\._device\.type\}:\{shard_rank % get_local_size\(\)\}', "{self._device.type}")],
        model_parallel)
    cls.__init__ = ftrl_dmp_collection_init(init)
    cls._remap_sharding_plan = remap
    try:
        yield cls
    finally:
        for name, fn in installed.items():
            setattr(cls, name, fn)


@contextlib.contextmanager
def _stock_dmp_collection():
    from torchrec.distributed.model_parallel import DMPCollection
    yield DMPCollection


def _prox64(z: np.ndarray, n: np.ndarray) -> np.ndarray:
    """w = prox(z, n) in float64, transcribed from docs/ftrl.md (p = -0.5, "tensorflow" L2 = 2·λ2)."""
    lr, l1, l2, beta = (FUSED_KNOBS[k] for k in ("learning_rate", "ftrl_l1_reg", "ftrl_l2_reg", "ftrl_beta"))
    q = (beta + np.sqrt(n)) / lr + 2.0 * l2
    return np.where(np.abs(z) > l1, (l1 * np.sign(z) - z) / q, 0.0)


def _tables64(dmpc) -> list[dict[str, np.ndarray]]:
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    out = []
    for tbe in ftrl_tbes(dmpc):
        for w, st in zip(tbe.split_embedding_weights(), tbe.get_optimizer_state()):
            out.append({"w": w.double().cpu().numpy(), "n": st["accum"].double().cpu().numpy(),
                        "z": st["linear"].double().cpu().numpy(),
                        "bits": [bits_of(t) for t in (w, st["accum"], st["linear"])]})
    return out


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(_INT_OF_SIZE[t.element_size()]).numpy().copy()


def dmp_collection_syncs_ftrl(rank: int, ws: int) -> None:
    """DMPCollection, sharding groups of 1 rank, 2 replicas, FTRL tables a and b with fp32 and with
    bf16 states: each replica trains 2 steps on its own data; after sync() the replicas are bitwise
    equal, every state is the float64 mean of the replicas' stored states (fp32 within 1e-5, bf16
    within its rounding) and every weight is the float64 prox(z, n) of the stored states; after one
    more step, sync(include_optimizer_state=False) makes them bitwise equal too."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from torchrec.distributed.types import ShardingPlan

    for state_dtypes, rtol in (({}, 1e-5), ({"accum": SparseType.BF16, "linear": SparseType.BF16}, 2.0 ** -8)):
        fused = {"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS}
        if state_dtypes:
            fused["optimizer_state_dtypes"] = state_dtypes
        sharders = torchrec_ftrl.sharders(fused)
        ebc = _meta_ebc(["a", "b"])
        plan = ShardingPlan({"": module_plan(ebc, sharders[0], 1, {"a": "tw0", "b": "tw0"})})
        with (dmp_collection_on_cpu() if device_type() == "cpu" else _stock_dmp_collection()) as DMPCollection:
            dmpc = DMPCollection(module=ebc, device=device(), plan=plan, world_size=ws, sharding_group_size=1,
                                 global_pg=dist.group.WORLD, sharders=sharders)
        with torch.no_grad():   # (DMPCollection's state_dict holds DTensors: set the TBEs directly)
            for kernel in _kernels(dmpc):
                for table, w in zip(kernel.config.embedding_tables, kernel._emb_module.split_embedding_weights()):
                    w.copy_(torch.from_numpy(global_init(table.name, ROWS, DIM)).to(w.device))
        feats = ["f_a", "f_b"]
        for step in range(2):
            out = dmpc(local_kjt(batch(step, feats, rank, ws), feats, rank))
            up = torch.from_numpy(upstream(step, ws, 2)[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
            (torch.stack([out[f] for f in feats], 1) * up).sum().backward()
        mine = _tables64(dmpc)
        replicas: list = [None] * ws
        dist.all_gather_object(replicas, mine)
        assert ws == 1 or not np.array_equal(replicas[0][0]["n"], replicas[1][0]["n"]), "replicas trained alike"
        dmpc.sync()
        synced = _tables64(dmpc)
        everyone: list = [None] * ws
        dist.all_gather_object(everyone, synced)
        for i, table in enumerate(synced):
            for j in range(3):
                assert all(np.array_equal(table["bits"][j], other[i]["bits"][j]) for other in everyone), (i, j)
            for s in ("n", "z"):
                mean = np.mean([r[i][s] for r in replicas], axis=0)
                np.testing.assert_allclose(table[s], mean, rtol=rtol, atol=1e-7, err_msg=f"{state_dtypes} {s}")
            np.testing.assert_allclose(table["w"], _prox64(table["z"], table["n"]), rtol=1e-5, atol=2e-7,
                                       err_msg=f"{state_dtypes} w")
        # FTRL's state defines its weight: sync(include_optimizer_state=False) syncs it too
        out = dmpc(local_kjt(batch(2, feats, rank, ws), feats, rank))
        up = torch.from_numpy(upstream(2, ws, 2)[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
        (torch.stack([out[f] for f in feats], 1) * up).sum().backward()
        dmpc.sync(include_optimizer_state=False)
        everyone = [None] * ws
        dist.all_gather_object(everyone, [t["bits"] for t in _tables64(dmpc)])
        assert all(all(np.array_equal(a, b) for ta, tb in zip(everyone[0], other) for a, b in zip(ta, tb))
                   for other in everyone), "replicas differ after sync(include_optimizer_state=False)"
