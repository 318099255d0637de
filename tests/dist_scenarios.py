"""Worker bodies of the DMP tests (run in spawned gloo processes by tests/test_distributed.py).

Expected values come from the float64 FTRL reference (torchrec_ftrl.kernels.reference) applied to
gradients computed here in float64 from the global batch; the sharded model never feeds them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import torchrec_ftrl  # noqa: F401  (registers FTRL)
from torchrec_ftrl.kernels.reference import ftrl_reference_rows

KNOBS = dict(lr=0.1, l1=0.01, l2=0.02, beta=0.5, lr_power=-0.5, l2_shrinkage=0.0)
FUSED_KNOBS = {"learning_rate": 0.1, "ftrl_l1_reg": 0.01, "ftrl_l2_reg": 0.02, "ftrl_beta": 0.5}
ROWS, DIM, B_LOCAL, STEPS = 24, 8, 3, 3
TOL = dict(rtol=1e-5, atol=2e-6)


def global_init(name: str, rows: int, dim: int) -> np.ndarray:
    seed = sum(map(ord, name))
    return np.random.default_rng(seed).uniform(-0.05, 0.05, size=(rows, dim))


def copy_global_into(sharded, global_np: np.ndarray) -> None:
    from torchrec_ftrl.checkpoint import _local_pieces
    with torch.no_grad():
        for offsets, local in _local_pieces(sharded):
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            local.copy_(torch.from_numpy(global_np[sl]).to(local.dtype))


def assert_sharded_close(sharded, expected: np.ndarray, what: str) -> None:
    from torchrec_ftrl.checkpoint import _local_pieces
    for offsets, local in _local_pieces(sharded):
        sl = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
        np.testing.assert_allclose(local.double().numpy(), expected[sl], err_msg=what, **TOL)


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
        weights=torch.tensor(w, dtype=torch.float32) if weights is not None else None)


def upstream(step: int, ws: int, n_features: int, dim: int = DIM) -> np.ndarray:
    """dLoss/d(pooled output) for the global batch: [ws*B_LOCAL, n_features, dim] (float64)."""
    return np.random.default_rng(5000 + step).normal(size=(ws * B_LOCAL, n_features, dim))


class Reference:
    """Float64 FTRL over full tables, fed with row gradients from the global batch."""

    def __init__(self, tables: dict[str, tuple[int, int]]):
        self.w = {t: global_init(t, r, d) for t, (r, d) in tables.items()}
        self.z = {t: np.zeros((r, d)) for t, (r, d) in tables.items()}
        self.n = {t: np.zeros((r, d)) for t, (r, d) in tables.items()}

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
        local_size=ws, world_size=ws, device_type="cpu")
    for name, ps in plan.items():
        ps.compute_kernel = "fused"
        if name.endswith("twcw"):
            ps.sharding_type = "table_column_wise"
    return plan


def ftrl_kernels(dmp):
    """Our kernel objects inside the sharded modules of ``dmp``."""
    from torchrec_ftrl.distributed.kernels import FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag
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


def every_sharding_type(rank: int, ws: int) -> None:
    """EBC (SUM) and EC, one FTRL table per sharding type, vs the float64 reference, 3 steps."""
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
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS})
    plan = ShardingPlan({"ebc": _ebc_plan(ebc, sharders[0], ws), "ec": _ebc_plan(ec, sharders[1], ws)})
    dmp = DistributedModelParallel(TwoCollections(ebc, ec), device=torch.device("cpu"),
                                   sharders=sharders, plan=plan)

    assert_kernels_are_ftrl(dmp)

    ref = Reference({n: (ROWS, DIM) for n in names + seq_names})
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
        local_up = torch.from_numpy(up[rank * B_LOCAL:(rank + 1) * B_LOCAL]).float()
        loss = (pooled.values().view(B_LOCAL, len(feats), DIM) * local_up).sum()
        seq_up = {}
        for j, f in enumerate(seq_feats):
            n_local = seq[f].values().shape[0]
            g = np.random.default_rng(7000 + 10 * step + j).normal(size=(sum(len(x) for x in gs[f]), DIM))
            start = sum(len(x) for x in gs[f][: rank * B_LOCAL])
            loss = loss + (seq[f].values() * torch.from_numpy(g[start:start + n_local]).float()).sum()
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
