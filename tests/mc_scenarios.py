"""Worker bodies of the managed-collision (ZCH) tests: TorchRec's ``ManagedCollisionEmbeddingBagCollection``
and ``ManagedCollisionEmbeddingCollection`` (``MCHManagedCollisionModule``, ``DistanceLFU_EvictionPolicy``,
eviction every step) with FTRL tables under DMP, row-wise (the only sharding TorchRec offers MC
modules). Run by tests/test_managed_collision.py through ``conftest.run_distributed`` (gloo on CPU;
NCCL with FTRL_TEST_DEVICE=cuda, where the ``fused_uvm_caching`` placement runs too).

Expected values: a float64 FTRL (tests/reference.py) over the slots, fed with the gradients of the
remapped ids that the model returns. Every slot TorchRec evicts (the rows it asks the TBE to reset)
restarts in the reference at FTRL's starting point, weight 0 (the tables' ``init_fn`` is zeros),
accum n0, linear 0; the sharded model never feeds the reference anything but those row ids.
"""

from __future__ import annotations

import numpy as np
import torch

import torchrec_ftrl
from conftest import device_type
from reference import ftrl_reference_rows

ZCH, DIM, RAW_IDS, B, MAX_LEN = 32, 8, 1000, 16, 3
N0 = 0.1
KNOBS = dict(lr=0.1, l1=0.01, l2=0.02, beta=0.5, lr_power=-0.5, l2_shrinkage=0.0)
FUSED = {"learning_rate": 0.1, "ftrl_l1_reg": 0.01, "ftrl_l2_reg": 0.02, "ftrl_beta": 0.5,
         "ftrl_initial_accumulator_value": N0}
TOL = dict(rtol=2e-5, atol=2e-6)


def _device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build(kind: str, kernel: str, layout: dict | None = None):
    """DMP over an MC-EBC (``kind="ebc"``, SUM pooling) or MC-EC (``"ec"``) of one FTRL table
    ``t`` of ``ZCH`` slots, feature ``f``, row-wise on ``kernel`` (``layout``: row-layout
    fused_params); weights zeroed, states reset."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)

    dev, meta = _device(), torch.device("meta")
    fused = {"optimizer": EmbOptimType.FTRL, **FUSED, **(layout or {})}
    if kernel == "fused_uvm_caching":
        fused["cache_load_factor"] = 0.5
    sharders = torchrec_ftrl.sharders(fused)
    if kind == "ebc":
        tables = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=ZCH, feature_names=["f"],
                                     init_fn=torch.nn.init.zeros_)]
        inner, mc_cls = EmbeddingBagCollection(tables=tables, device=meta), ManagedCollisionEmbeddingBagCollection
        sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=sharders[0])
    else:
        tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=ZCH, feature_names=["f"],
                                  init_fn=torch.nn.init.zeros_)]
        inner, mc_cls = EmbeddingCollection(tables=tables, device=meta), ManagedCollisionEmbeddingCollection
        sharder = ManagedCollisionEmbeddingCollectionSharder(ec_sharder=sharders[1])
    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(zch_size=ZCH, device=dev, eviction_policy=DistanceLFU_EvictionPolicy(),
                                        eviction_interval=1)}, embedding_configs=tables)
    module = mc_cls(inner, mcc, return_remapped_features=True)
    ws = torch.distributed.get_world_size()
    plan = construct_module_sharding_plan(module, per_param_sharding={"t": row_wise(compute_kernel=kernel)},
                                          sharder=sharder, local_size=ws, world_size=ws,
                                          device_type=device_type())
    dmp = DistributedModelParallel(module, device=dev, sharders=[sharder], plan=ShardingPlan({"": plan}))
    tbe = ftrl_tbe(dmp)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].zero_()
        tbe.reset_optimizer_state()
    tbe.reset_cache_states()
    return dmp, tbe


def ftrl_tbe(dmp):
    """The one FTRL TBE inside ``dmp``."""
    from dist_scenarios import ftrl_kernels
    found = [k._emb_module for k in ftrl_kernels(dmp)]
    assert len(found) == 1, found
    return found[0]


def spy_resets(tbe) -> list:
    """Record the rows TorchRec asks ``tbe`` to reset (TorchRec's call arguments, not our results)."""
    calls = []
    real = tbe.reset_embedding_weight_momentum

    def spy(pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids):
        calls.append(pruned_indices.detach().cpu().numpy().copy())
        return real(pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids)
    tbe.reset_embedding_weight_momentum = spy
    return calls


def kjt(step: int):
    """The batch of ``step``: ``B`` samples of 1..``MAX_LEN`` raw ids in ``[0, RAW_IDS)``."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(100 + step)
    lengths = rng.integers(1, MAX_LEN + 1, size=B)
    values = rng.integers(0, RAW_IDS, size=int(lengths.sum()))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64)).to(_device()), lengths


def train_step(dmp, kind: str, step: int):
    """One step; returns the remapped slot ids ``[N]`` and their gradient rows ``[N, DIM]`` (float64)."""
    batch, lengths = kjt(step)
    out, remapped = dmp(batch)
    ids = remapped["f"].values().cpu().numpy()
    rng = np.random.default_rng(5000 + step)
    if kind == "ebc":
        up = rng.normal(size=(B, DIM))
        values = out["f"]
        grads = np.repeat(up, lengths, axis=0)
    else:
        values = out["f"].values()
        up = rng.normal(size=(len(ids), DIM))
        grads = up
    (values * torch.from_numpy(up).to(values.dtype).to(values.device)).sum().backward()
    return ids, grads


def full_state(dmp, tbe) -> dict:
    """Every tensor of the model's state (MC remapping buffers included) and the FTRL table, on CPU."""
    from torchrec_ftrl.checkpoint import _local_pieces
    out = {}
    for k, v in dmp.state_dict().items():
        pieces = [p for _, p in _local_pieces(v)] if hasattr(v, "local_shards") else [v]
        for i, p in enumerate(pieces):
            out[f"{k}#{i}"] = p.detach().cpu().clone()
    (accum, linear), = tbe.split_optimizer_states()
    out["accum"], out["linear"] = accum.detach().cpu().clone(), linear.detach().cpu().clone()
    return out


def train_with_evictions_matches_reference(rank: int, ws: int, kind: str, kernel: str, steps: int,
                                           layout: dict | None = None) -> None:
    """Training with evictions every step: after each step the table equals a float64 FTRL in which
    every evicted slot restarted from (0, n0, 0); some evicted slot is taken again by a new id."""
    dmp, tbe = build(kind, kernel, layout)
    resets = spy_resets(tbe)
    W, Z, Nacc = np.zeros((ZCH, DIM)), np.zeros((ZCH, DIM)), np.full((ZCH, DIM), N0)
    reused = 0
    for step in range(steps):
        n_before = len(resets)
        ids, grads = train_step(dmp, kind, step)
        evicted = np.concatenate(resets[n_before:]) if len(resets) > n_before else np.zeros(0, np.int64)
        W[evicted], Z[evicted], Nacc[evicted] = 0.0, 0.0, N0
        reused += int(np.isin(ids, evicted).sum())
        W, Z, Nacc = ftrl_reference_rows(W, Z, Nacc, ids, grads, **KNOBS)
        weight, = tbe.split_embedding_weights()
        (accum, linear), = tbe.split_optimizer_states()
        for got, want, what in ((weight, W, "weight"), (accum, Nacc, "accum"), (linear, Z, "linear")):
            np.testing.assert_allclose(got.detach().double().cpu().numpy(), want, err_msg=f"{what} step {step}",
                                       **TOL)
    n_evicted = sum(len(r) for r in resets)
    assert n_evicted > 0 and reused > 0, (n_evicted, reused)
    print(f"MC-{kind.upper()} {kernel}: {steps} steps, {len(resets)} eviction calls, {n_evicted} slots "
          f"evicted, {reused} lookups of re-used slots")


def resume_is_bitwise(rank: int, ws: int, kind: str, kernel: str, ckpt_dir: str,
                      layout: dict | None = None) -> None:
    """6 steps uninterrupted against 3 steps, a DCP checkpoint (model state with MC's remapping
    buffers, and the fused optimizer's), a fresh model loaded from it, and 3 more steps: bitwise equal."""
    import torch.distributed.checkpoint as dcp
    dmp, tbe = build(kind, kernel, layout)
    for step in range(6):
        train_step(dmp, kind, step)
    want = full_state(dmp, tbe)

    dmp, tbe = build(kind, kernel, layout)
    for step in range(3):
        train_step(dmp, kind, step)
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
             checkpoint_id=f"{ckpt_dir}/dcp_{kind}")

    dmp, tbe = build(kind, kernel, layout)
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/dcp_{kind}")
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])
    dmp.fused_optimizer.set_optimizer_step(3)
    for step in range(3, 6):
        train_step(dmp, kind, step)
    got = full_state(dmp, tbe)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    mc_keys = [k for k in got if "managed_collision" in k]
    assert mc_keys, sorted(got)   # MC's remapping state is part of the checkpoint
    for k in got:
        assert torch.equal(got[k], want[k]), f"{k} differs after resume"
