"""Worker bodies of the DMP tests (run in spawned gloo processes by tests/test_distributed.py and
tests/test_checkpoint.py through ``conftest.run_distributed``).

Expected values come from the float64 FTRL reference (tests/reference.py) applied to
gradients computed here in float64 from the global batch; the sharded model never feeds them.
"""

from __future__ import annotations

import numpy as np
import torch

import torchrec_ftrl  # noqa: F401  (registers FTRL)
from conftest import device_type
from reference import ftrl_reference_rows

KNOBS = dict(lr=0.1, l1=0.01, l2=0.02, beta=0.5, lr_power=-0.5, l2_shrinkage=0.0)
FUSED_KNOBS = {"learning_rate": 0.1, "ftrl_l1_reg": 0.01, "ftrl_l2_reg": 0.02, "ftrl_beta": 0.5}
ROWS, DIM, B_LOCAL, STEPS = 24, 8, 3, 3
TOL = dict(rtol=1e-5, atol=2e-6)


def device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_init(name: str, rows: int, dim: int) -> np.ndarray:
    seed = sum(map(ord, name))
    return np.random.default_rng(seed).uniform(-0.05, 0.05, size=(rows, dim))


def copy_global_into(sharded, global_np: np.ndarray) -> None:
    from torchrec_ftrl.checkpoint import _local_pieces
    with torch.no_grad():
        for offsets, local in _local_pieces(sharded):
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            local.copy_(torch.from_numpy(global_np[sl]).to(local.dtype).to(local.device))


def assert_sharded_close(sharded, expected: np.ndarray, what: str) -> None:
    from torchrec_ftrl.checkpoint import _local_pieces
    for offsets, local in _local_pieces(sharded):
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
        np.testing.assert_allclose(local.double().cpu().numpy(), expected[sl], err_msg=what, **TOL)


def batch(step: int, features: list[str], rank: int, ws: int, rows: int = ROWS, max_len: int = 4):
    """The global batch of one step (same on every rank): per feature, per global sample, ids."""
    rng = np.random.default_rng(1000 + step)
    return {f: [rng.integers(0, rows, size=rng.integers(0, max_len + 1)).tolist()
                for _ in range(ws * B_LOCAL)] for f in features}


def local_kjt(gbatch, features, rank, weights=None):
    from torchrec import KeyedJaggedTensor
    lengths, values, w = [], [], []
    for f in features:
        for b in range(rank * B_LOCAL, (rank + 1) * B_LOCAL):
            ids = gbatch[f][b]
            lengths.append(len(ids))
            values.extend(ids)
            if weights is not None:
                w.extend(weights[f][b])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=features, values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=torch.tensor(w, dtype=torch.float32) if weights is not None else None).to(device())


def upstream(step: int, ws: int, n_features: int, dim: int = DIM) -> np.ndarray:
    """dLoss/d(pooled output) for the global batch: [ws*B_LOCAL, n_features, dim] (float64)."""
    return np.random.default_rng(5000 + step).normal(size=(ws * B_LOCAL, n_features, dim))


class Reference:
    """Float64 FTRL over full tables, fed with row gradients from the global batch. With ``derived``
    the tables derive their weights: the initial weights w0 are held as z0 = -(q(0) w0 + l1 sign(w0))
    (docs/row-layouts.md), so w0 = prox(z0, 0)."""

    def __init__(self, tables: dict[str, tuple[int, int]], derived: bool = False):
        self.w = {t: global_init(t, r, d) for t, (r, d) in tables.items()}
        self.z = {t: np.zeros((r, d)) for t, (r, d) in tables.items()}
        self.n = {t: np.zeros((r, d)) for t, (r, d) in tables.items()}
        if derived:
            q0 = (KNOBS["beta"] + 0.0) / KNOBS["lr"] + 2.0 * KNOBS["l2"]
            self.z = {t: -(q0 * w + KNOBS["l1"] * np.sign(w)) for t, w in self.w.items()}

    def step(self, table: str, row_ids, row_grads) -> None:
        if len(row_ids) == 0:
            return
        self.w[table], self.z[table], self.n[table] = ftrl_reference_rows(
            self.w[table], self.z[table], self.n[table], row_ids, row_grads, **KNOBS)


def pooled_row_grads(gbatch_f, up_f, ws, weights_f=None):
    """Row ids and gradients of one feature, SUM pooling, gradient divided by world size."""
    ids, grads = [], []
    for b, bag in enumerate(gbatch_f):
        for j, r in enumerate(bag):
            scale = weights_f[b][j] if weights_f is not None else 1.0
            ids.append(r)
            grads.append(up_f[b] * scale / ws)
    return ids, grads


def check_tables(model, ref: Reference, prefix: str, tables) -> None:
    msd = model.state_dict()
    osd = model.fused_optimizer.state_dict()["state"]
    for t in tables:
        key = f"{prefix}.{t}.weight"
        assert_sharded_close(msd[key], ref.w[t], f"weight of {t}")
        if key not in osd:  # no shard of this table on this rank
            assert not msd[key].local_shards(), key
            continue
        assert_sharded_close(osd[key][f"{t}.accum"], ref.n[t], f"accum of {t}")
        assert_sharded_close(osd[key][f"{t}.linear"], ref.z[t], f"linear of {t}")


# ----------------------------------------------------------------------------- scenarios
SHARDINGS = ["tw", "rw", "cw", "twrw", "twcw"]


def _ebc_plan(ebc, sharder, ws):
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    row_wise, table_row_wise, table_wise)
    gens = {"tw": table_wise(rank=ws - 1), "rw": row_wise(), "cw": column_wise(ranks=list(range(ws))),
            "twrw": table_row_wise(host_index=0), "twcw": column_wise(ranks=list(range(ws)))}
    names = [n for n in ebc.embedding_bags] if hasattr(ebc, "embedding_bags") else list(ebc.embeddings)
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={n: gens[n.split("_", 1)[1]] for n in names}, sharder=sharder,
        local_size=ws, world_size=ws, device_type=device_type())
    for name, ps in plan.items():
        ps.compute_kernel = "fused"
        if name.endswith("twcw"):
            ps.sharding_type = "table_column_wise"
    return plan


def ftrl_kernels(dmp):
    """Our kernel objects inside the sharded modules of ``dmp``."""
    from torchrec_ftrl.integration.compute_kernels import FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag
    found = []
    for m in dmp.modules():
        for lookup in getattr(m, "_lookups", []) or []:
            lookup = getattr(lookup, "module", lookup)  # DDP-wrapped lookups
            for k in getattr(lookup, "_emb_modules", []):
                if isinstance(k, (FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag)):
                    found.append(k)
    return found


def assert_kernels_are_ftrl(dmp):
    kinds = {type(k).__name__ for k in ftrl_kernels(dmp)}
    assert kinds == {"FTRLBatchedFusedEmbedding", "FTRLBatchedFusedEmbeddingBag"}, kinds


class TwoCollections(torch.nn.Module):
    def __init__(self, ebc, ec):
        super().__init__()
        self.ebc, self.ec = ebc, ec

    def forward(self, bags, seqs):
        return self.ebc(bags), self.ec(seqs)


def every_sharding_type(rank: int, ws: int, layout: dict | None = None) -> None:
    """EBC (SUM) and EC, one FTRL table per sharding type, vs the float64 reference, 3 steps
    (``layout``: row-layout fused_params, e.g. ``{"ftrl_weights": "derived"}``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    names = [f"t_{s}" for s in SHARDINGS]
    feats = [f"f_{s}" for s in SHARDINGS]
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f]) for n, f in zip(names, feats)],
        device=torch.device("meta"))
    seq_names, seq_feats = ["s_tw", "s_rw", "s_cw"], ["g_tw", "g_rw", "g_cw"]
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
        for n, f in zip(seq_names, seq_feats)], device=torch.device("meta"))
    layout = layout or {}
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS, **layout})
    plan = ShardingPlan({"ebc": _ebc_plan(ebc, sharders[0], ws), "ec": _ebc_plan(ec, sharders[1], ws)})
    dmp = DistributedModelParallel(TwoCollections(ebc, ec), device=device(),
                                   sharders=sharders, plan=plan)

    assert_kernels_are_ftrl(dmp)

    ref = Reference({n: (ROWS, DIM) for n in names + seq_names},
                    derived=layout.get("ftrl_weights") == "derived")
    msd = dmp.state_dict()
    for n in names:
        copy_global_into(msd[f"ebc.embedding_bags.{n}.weight"], ref.w[n])
    for n in seq_names:
        copy_global_into(msd[f"ec.embeddings.{n}.weight"], ref.w[n])

    for step in range(STEPS):
        gb = batch(step, feats, rank, ws)
        gs = batch(100 + step, seq_feats, rank, ws)
        up = upstream(step, ws, len(feats))
        pooled, seq = dmp(local_kjt(gb, feats, rank), local_kjt(gs, seq_feats, rank))
        local_up = torch.from_numpy(up[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
        loss = (pooled.values().view(B_LOCAL, len(feats), DIM) * local_up).sum()
        seq_up = {}
        for j, f in enumerate(seq_feats):
            n_local = seq[f].values().shape[0]
            g = np.random.default_rng(7000 + 10 * step + j).normal(size=(sum(len(x) for x in gs[f]), DIM))
            start = sum(len(x) for x in gs[f][: rank * B_LOCAL])
            loss = loss + (seq[f].values() * torch.from_numpy(g[start:start + n_local]).float().to(device())).sum()
            seq_up[f] = g
        loss.backward()
        for j, (n, f) in enumerate(zip(names, feats)):
            ids, grads = pooled_row_grads(gb[f], up[:, j], ws)
            ref.step(n, ids, grads)
        for n, f in zip(seq_names, seq_feats):
            ids = [r for bag in gs[f] for r in bag]
            ref.step(n, ids, seq_up[f] / ws)
    check_tables(dmp, ref, "ebc.embedding_bags", names)
    check_tables(dmp, ref, "ec.embeddings", seq_names)


# ----------------------------------------------------------------------------- data-parallel paths
def train_pooled(dmp, ref, rank, ws, tables, feats, steps, step_fn=None):
    """Steps ``steps`` of SUM-pooled lookups on ``tables`` (one feature each); the float64 reference
    (unless None) is fed with the global batch's row gradients (divided by world size); ``step_fn``
    runs after each backward."""
    for step in steps:
        gb = batch(step, feats, rank, ws)
        up = upstream(step, ws, len(feats))
        out = dmp(local_kjt(gb, feats, rank))
        local_up = torch.from_numpy(up[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float().to(device())
        (out.values().view(B_LOCAL, len(feats), DIM) * local_up).sum().backward()
        if step_fn is not None:
            step_fn()
        if ref is not None:
            for j, (n, f) in enumerate(zip(tables, feats)):
                ref.step(n, *pooled_row_grads(gb[f], up[:, j], ws))


def data_parallel_paths(rank: int, ws: int) -> None:
    """FTRL is never trained by another optimizer, whatever the configuration path:
    (1) apply_optimizer_in_backward(FTRL) with torchrec_ftrl.sharders() and DMP's default planner:
        small tables are not planned data-parallel; they run our fused kernel and match float64;
    (2) the data-parallel recipe (a stock sharder, a data-parallel plan, the dense torchrec_ftrl.FTRL
        with its defaults): matches float64 with row-sparse semantics (rows absent from every batch
        keep weight, accum and linear bit for bit);
    (3) a plan that puts an in-backward FTRL table on data-parallel: DMP construction raises a
        ValueError naming the table, its sharding type and its compute kernel."""
    import pytest
    import torchrec
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    tables, feats = ["d_a", "d_b"], ["df_a", "df_b"]

    def ebc():
        return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
            for n, f in zip(tables, feats)], device=torch.device("meta"))

    ftrl_kwargs = {"lr": KNOBS["lr"], "ftrl_l1_reg": KNOBS["l1"], "ftrl_l2_reg": KNOBS["l2"],
                   "ftrl_beta": KNOBS["beta"]}

    # (1) in backward, default planner
    m1 = ebc()
    apply_optimizer_in_backward(torchrec.optim.FTRL, m1.parameters(), ftrl_kwargs)
    dmp = DistributedModelParallel(m1, device=device(), sharders=torchrec_ftrl.sharders())
    planned = {n: (ps.sharding_type, ps.compute_kernel) for n, ps in dmp.plan.plan[""].items()}
    assert all(st != "data_parallel" and k == "fused" for st, k in planned.values()), planned
    import torch.distributed as dist
    local = sorted(t.name for k in ftrl_kernels(dmp) for t in k.config.embedding_tables)
    everywhere = [None] * ws
    dist.all_gather_object(everywhere, local)
    assert sorted(set(sum(everywhere, []))) == tables, everywhere   # every table on our kernel
    ref = Reference({n: (ROWS, DIM) for n in tables})
    msd = dmp.state_dict()
    for n in tables:
        copy_global_into(msd[f"embedding_bags.{n}.weight"], ref.w[n])
    train_pooled(dmp, ref, rank, ws, tables, feats, range(STEPS))
    check_tables(dmp, ref, "embedding_bags", tables)

    # (2) the data-parallel recipe: stock sharder, data-parallel plan, dense FTRL (defaults)
    sharder = EmbeddingBagCollectionSharder()
    m2 = ebc()
    plan = ShardingPlan({"": construct_module_sharding_plan(
        m2, per_param_sharding={n: data_parallel() for n in tables}, sharder=sharder, local_size=ws,
        world_size=ws, device_type=device_type())})
    dmp = DistributedModelParallel(m2, device=device(), sharders=[sharder], plan=plan)
    params = {n: p for n, p in dmp.named_parameters() if n.split(".")[-2] in tables}
    assert sorted(n.split(".")[-2] for n in params) == tables, list(params)
    ref = Reference({n: (ROWS, DIM) for n in tables})
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(ref.w[n.split(".")[-2]]).to(p.dtype).to(p.device))
    opt = torchrec_ftrl.FTRL(list(params.values()), **ftrl_kwargs)

    def step_fn():
        opt.step()
        opt.zero_grad()
    train_pooled(dmp, ref, rank, ws, tables, feats, range(STEPS), step_fn)
    touched = {n: set() for n in tables}
    for step in range(STEPS):
        gb = batch(step, feats, rank, ws)
        for n, f in zip(tables, feats):
            touched[n].update(r for bag in gb[f] for r in bag)
    for name, p in params.items():
        t = name.split(".")[-2]
        state = opt.state[p]
        for got, want, what in ((p, ref.w[t], "weight"), (state["accum"], ref.n[t], "accum"),
                                (state["linear"], ref.z[t], "linear")):
            np.testing.assert_allclose(got.detach().double().cpu().numpy(), want, err_msg=f"{what} of {t}",
                                       **TOL)
        absent = sorted(set(range(ROWS)) - touched[t])
        assert absent, "the batches touch every row: the test needs absent rows"
        start = torch.from_numpy(global_init(t, ROWS, DIM)).to(p.dtype)
        assert torch.equal(p.detach().cpu()[absent], start[absent])
        assert not state["accum"][absent].any() and not state["linear"][absent].any()

    # (3) in backward, forced onto data-parallel: refused at DMP construction
    m3 = ebc()
    apply_optimizer_in_backward(torchrec.optim.FTRL, m3.parameters(), ftrl_kwargs)
    sharders = torchrec_ftrl.sharders()
    plan = ShardingPlan({"": construct_module_sharding_plan(
        m3, per_param_sharding={n: data_parallel() for n in tables}, sharder=sharders[0],
        local_size=ws, world_size=ws, device_type=device_type())})
    with pytest.raises(ValueError, match=r"table 'd_[ab]'.*sharding type 'data_parallel'.*kernel 'dense'"):
        DistributedModelParallel(m3, device=device(), sharders=sharders, plan=plan)


# ----------------------------------------------------------------------------- checkpoints
CK_TABLES = ["c_a", "c_b"]
CK_FEATS = ["cf_a", "cf_b"]


def _ck_model(ws: int, sharding: str, layout: dict | None = None):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
        for n, f in zip(CK_TABLES, CK_FEATS)], device=torch.device("meta"))
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS, **(layout or {})})
    gens = {n: (table_wise(rank=i % ws) if sharding == "tw" else row_wise())
            for i, n in enumerate(CK_TABLES)}
    plan = construct_module_sharding_plan(ebc, per_param_sharding=gens, sharder=sharders[0],
                                          local_size=ws, world_size=ws, device_type=device_type())
    for ps in plan.values():
        ps.compute_kernel = "fused"
    return DistributedModelParallel(ebc, device=device(), sharders=sharders,
                                    plan=ShardingPlan({"": plan}))


def _ck_train(dmp, ref, rank, ws, steps):
    train_pooled(dmp, ref, rank, ws, CK_TABLES, CK_FEATS, steps)


def _ck_reference(phases):
    """Reference after the given (world_size, steps) phases."""
    ref = Reference({n: (ROWS, DIM) for n in CK_TABLES})
    for ws, steps in phases:
        for step in steps:
            gb = batch(step, CK_FEATS, 0, ws)
            up = upstream(step, ws, len(CK_FEATS))
            for j, (n, f) in enumerate(zip(CK_TABLES, CK_FEATS)):
                ref.step(n, *pooled_row_grads(gb[f], up[:, j], ws))
    return ref


def _ck_state(dmp):
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def checkpoint_save(rank: int, ws: int, ckpt_dir: str) -> None:
    """Table-wise plan, 2 steps, then a DCP checkpoint and a plain .npz export."""
    import torch.distributed.checkpoint as dcp
    from torchrec_ftrl.checkpoint import export_ftrl_tables
    dmp = _ck_model(ws, "tw")
    ref = Reference({n: (ROWS, DIM) for n in CK_TABLES})
    msd = dmp.state_dict()
    for n in CK_TABLES:
        copy_global_into(msd[f"embedding_bags.{n}.weight"], ref.w[n])
    _ck_train(dmp, ref, rank, ws, range(2))
    check_tables(dmp, ref, "embedding_bags", CK_TABLES)
    dcp.save(_ck_state(dmp), checkpoint_id=f"{ckpt_dir}/dcp")
    export_ftrl_tables(dmp, f"{ckpt_dir}/tables.npz")


def checkpoint_load(rank: int, ws: int, ckpt_dir: str, sharding: str, source: str) -> None:
    """Load (DCP or .npz) into a fresh model with another plan / world size, then 2 more steps."""
    import torch.distributed.checkpoint as dcp
    from torchrec_ftrl.checkpoint import _local_pieces, import_ftrl_tables
    dmp = _ck_model(ws, sharding)
    if source == "dcp":
        state = _ck_state(dmp)
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/dcp")
        dmp.load_state_dict(state["model"])
        dmp.fused_optimizer.load_state_dict(state["optim"])
    else:
        import_ftrl_tables(dmp, f"{ckpt_dir}/tables.npz")
    # Bitwise round trip: every loaded value equals the exported fp32 value exactly.
    saved = np.load(f"{ckpt_dir}/tables.npz")
    msd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
    for n in CK_TABLES:
        key = f"embedding_bags.{n}.weight"
        pairs = [(msd[key], n)]
        if key in osd:
            pairs += [(osd[key][f"{n}.accum"], f"{n}/accum"), (osd[key][f"{n}.linear"], f"{n}/linear")]
        for tensor, name in pairs:
            for offsets, local in _local_pieces(tensor):
                sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
                assert np.array_equal(local.cpu().numpy(), saved[name][sl]), f"{name} not bitwise equal"
    _ck_train(dmp, None, rank, ws, range(2, 4))
    ref = _ck_reference([(2, range(2)), (ws, range(2, 4))])
    check_tables(dmp, ref, "embedding_bags", CK_TABLES)


def derived_checkpoint_round_trip(rank: int, ws: int, ckpt_dir: str) -> None:
    """Derived weights with a row-wise accum: DCP save after 2 steps, one more step, DCP load into
    the model: ``accum`` and ``linear`` come back bit for bit (whatever order the load writes the
    weights and the states in), and so do the weights; the ``.npz`` export holds prox(z, n)."""
    import torch.distributed.checkpoint as dcp
    from torchrec_ftrl.checkpoint import _local_pieces, export_ftrl_tables
    from conftest import bits
    layout = {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}
    for sharding in ("tw", "rw"):
        dmp = _ck_model(ws, sharding, layout)
        _ck_train(dmp, None, rank, ws, range(2))
        dcp.save(_ck_state(dmp), checkpoint_id=f"{ckpt_dir}/{sharding}")

        def snapshot():
            msd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]
            out = {}
            for n in CK_TABLES:
                key = f"embedding_bags.{n}.weight"
                tensors = {"w": msd[key]}
                if key in osd:
                    tensors.update(n=osd[key][f"{n}.accum"], z=osd[key][f"{n}.linear"])
                for slot, t in tensors.items():
                    for offsets, local in _local_pieces(t):
                        out[(n, slot, offsets)] = bits(local.clone())
            return out
        saved = snapshot()
        assert any(slot == "n" and v.numel() == 4 * (ROWS if sharding == "tw" else ROWS // ws)
                   for (_, slot, _), v in saved.items()), "row-wise accum is one fp32 per row"
        _ck_train(dmp, None, rank, ws, range(2, 3))
        moved = snapshot()
        assert any(not torch.equal(moved[k], v) for k, v in saved.items()), "the extra step changed nothing"
        state = _ck_state(dmp)
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/{sharding}")
        dmp.load_state_dict(state["model"])
        dmp.fused_optimizer.load_state_dict(state["optim"])
        after = snapshot()
        for key, value in saved.items():
            assert torch.equal(after[key], value), f"{sharding} {key} not restored bitwise"
        export_ftrl_tables(dmp, f"{ckpt_dir}/{sharding}.npz")
        if rank == 0:
            arrays = np.load(f"{ckpt_dir}/{sharding}.npz")
            for n in CK_TABLES:
                assert arrays[n].shape == (ROWS, DIM) and arrays[f"{n}/accum"].shape == (ROWS,)
                L2 = 2.0 * KNOBS["l2"]
                q = (KNOBS["beta"] + np.sqrt(arrays[f"{n}/accum"].astype(np.float64)))[:, None] / KNOBS["lr"] + L2
                z = arrays[f"{n}/linear"].astype(np.float64)
                want = np.where(np.abs(z) > KNOBS["l1"], (KNOBS["l1"] * np.sign(z) - z) / q, 0.0)
                np.testing.assert_allclose(arrays[n], want, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- mixed / weighted / VBE
class TwoBags(torch.nn.Module):
    def __init__(self, weighted, vbe):
        super().__init__()
        self.weighted, self.vbe = weighted, vbe

    def forward(self, wkjt, vkjt):
        return self.weighted(wkjt), self.vbe(vkjt)


VBE_STRIDES = {"vf_tw": B_LOCAL, "vf_rw": 2}


def _vbe_inverse(step: int, ws: int):
    """Global inverse indices: sample b of rank r uses bag inv[f][r][b] of that rank's bags."""
    rng = np.random.default_rng(9000 + step)
    return {f: rng.integers(0, s, size=(ws, B_LOCAL)) for f, s in VBE_STRIDES.items()}


def _vbe_bags(step: int, ws: int):
    rng = np.random.default_rng(9100 + step)
    return {f: [[rng.integers(0, ROWS, size=rng.integers(0, 4)).tolist() for _ in range(s)]
                for _ in range(ws)] for f, s in VBE_STRIDES.items()}


def mixed_weighted_vbe(rank: int, ws: int) -> None:
    """apply_optimizer_in_backward: FTRL and row-wise Adagrad tables side by side (weighted EBC), and a
    VBE EBC of FTRL tables; FTRL tables vs the float64 reference, the Adagrad table on FBGEMM."""
    import torchrec
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ftrl_kwargs = {"lr": 0.1, "ftrl_l1_reg": 0.01, "ftrl_l2_reg": 0.02, "ftrl_beta": 0.5}
    webc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="w_ftrl", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["wf_ftrl"]),
        EmbeddingBagConfig(name="w_ada", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["wf_ada"])],
        is_weighted=True, device=torch.device("meta"))
    vebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"v_{s}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"vf_{s}"])
        for s in ("tw", "rw")], device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.FTRL, [webc.embedding_bags["w_ftrl"].weight], ftrl_kwargs)
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, [webc.embedding_bags["w_ada"].weight],
                                {"lr": 0.1})
    apply_optimizer_in_backward(torchrec.optim.FTRL, vebc.parameters(), ftrl_kwargs)
    sharders = torchrec_ftrl.sharders()
    plan = ShardingPlan({
        "weighted": construct_module_sharding_plan(
            webc, per_param_sharding={"w_ftrl": row_wise(), "w_ada": table_wise(rank=0)},
            sharder=sharders[0], local_size=ws, world_size=ws, device_type=device_type()),
        "vbe": construct_module_sharding_plan(
            vebc, per_param_sharding={"v_tw": table_wise(rank=ws - 1), "v_rw": row_wise()},
            sharder=sharders[0], local_size=ws, world_size=ws, device_type=device_type())})
    dmp = DistributedModelParallel(TwoBags(webc, vebc), device=device(), sharders=sharders,
                                   plan=plan)
    kernels = [k for k in ftrl_kernels(dmp)]
    tables_in_ours = {t.name for k in kernels for t in k.config.embedding_tables}
    assert tables_in_ours and tables_in_ours <= {"w_ftrl", "v_tw", "v_rw"}, tables_in_ours
    ftrl_tables = ["w_ftrl", "v_tw", "v_rw"]
    ref = Reference({n: (ROWS, DIM) for n in ftrl_tables})
    msd = dmp.state_dict()
    copy_global_into(msd["weighted.embedding_bags.w_ftrl.weight"], ref.w["w_ftrl"])
    for n in ("v_tw", "v_rw"):
        copy_global_into(msd[f"vbe.embedding_bags.{n}.weight"], ref.w[n])
    ada_before = [t.clone() for _, t in _pieces(msd["weighted.embedding_bags.w_ada.weight"])]

    for step in range(STEPS):
        gb = batch(step, ["wf_ftrl", "wf_ada"], rank, ws)
        wrng = np.random.default_rng(8000 + step)
        gw = {f: [wrng.uniform(0.5, 2.0, size=len(bag)).tolist() for bag in gb[f]] for f in gb}
        up = upstream(step, ws, 2)
        inv, bags = _vbe_inverse(step, ws), _vbe_bags(step, ws)
        vfeats = list(VBE_STRIDES)
        vkjt = KeyedJaggedTensor(
            keys=vfeats,
            values=torch.tensor([r for f in vfeats for bag in bags[f][rank] for r in bag], dtype=torch.int64),
            lengths=torch.tensor([len(bag) for f in vfeats for bag in bags[f][rank]], dtype=torch.int64),
            stride_per_key_per_rank=[[VBE_STRIDES[f]] for f in vfeats],
            # int64: FBGEMM 1.6's CUDA group_index_select_dim0 backward rejects int32 inverse indices.
            inverse_indices=(vfeats, torch.tensor(np.stack([inv[f][rank] for f in vfeats]),
                                                  dtype=torch.int64))).to(device())
        vup = upstream(500 + step, ws, 2)
        wout, vout = dmp(local_kjt(gb, ["wf_ftrl", "wf_ada"], rank, weights=gw), vkjt)
        sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        loss = (wout.values().view(B_LOCAL, 2, DIM) * torch.from_numpy(up[sl]).float().to(device())).sum()
        loss = loss + (vout.values().view(B_LOCAL, 2, DIM) * torch.from_numpy(vup[sl]).float().to(device())).sum()
        loss.backward()
        ref.step("w_ftrl", *pooled_row_grads(gb["wf_ftrl"], up[:, 0], ws, gw["wf_ftrl"]))
        for j, (n, f) in enumerate(zip(("v_tw", "v_rw"), vfeats)):
            ids, grads = [], []
            for r in range(ws):
                for k, bag in enumerate(bags[f][r]):
                    g = sum(vup[r * B_LOCAL + b, j] for b in range(B_LOCAL) if inv[f][r][b] == k)
                    for row in bag:
                        ids.append(row)
                        grads.append(np.asarray(g, dtype=np.float64) / ws + np.zeros(DIM))
            ref.step(n, ids, grads)
    check_tables(dmp, ref, "weighted.embedding_bags", ["w_ftrl"])
    check_tables(dmp, ref, "vbe.embedding_bags", ["v_tw", "v_rw"])
    # The row-wise Adagrad table ran on FBGEMM's kernel and trained.
    stock = [k for m in dmp.modules() for lk in getattr(m, "_lookups", []) or []
             for k in getattr(getattr(lk, "module", lk), "_emb_modules", [])
             if type(k) is BatchedFusedEmbeddingBag]
    after = [t for _, t in _pieces(dmp.state_dict()["weighted.embedding_bags.w_ada.weight"])]
    if rank == 0:
        assert stock and any(not torch.equal(a, b) for a, b in zip(ada_before, after))


def _pieces(t):
    from torchrec_ftrl.checkpoint import _local_pieces
    return list(_local_pieces(t))
