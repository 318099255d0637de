"""A derived-weights model (``ftrl_weights="derived"``: no weight array, w = prox(z, n)) through
TorchRec's inference path and our export: the sharded model's ``state_dict`` gathered into an unsharded
``EmbeddingBagCollection`` (``torchrec.inference.state_dict_transform.state_dict_gather``), quantized
by ``torchrec.inference.modules.quantize_inference_model`` (int8 row-wise, and fp16 for one table),
and looked up by the ``QuantEmbeddingBagCollection``; ``export_ftrl_tables`` writes w beside z and n.

Expected weights are the float64 ``prox(z, n)`` of the trained states (tests/reference.py), one
process (gloo, CPU), 3 training steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torchrec_ftrl
from dist_scenarios import FUSED_KNOBS, KNOBS, copy_global_into, global_init
from reference import ftrl_reference_weight

ROWS, DIM, TABLES = 20, 8, ("t_int8", "t_fp16")
FEATURES = tuple(f"f_{t}" for t in TABLES)
LAYOUTS = [{"ftrl_accumulator": "elementwise"},
           {"ftrl_accumulator": "rowwise", "state_dtype": "bf16"}]


@pytest.fixture
def one_process_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt)


def _ebc(device: str):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f]) for t, f in zip(TABLES, FEATURES)],
        device=torch.device(device))


def _kjt(ids_per_bag: list[list[int]]):
    """One bag list per feature (the same bags for both)."""
    from torchrec import KeyedJaggedTensor
    values = [r for _ in FEATURES for bag in ids_per_bag for r in bag]
    lengths = [len(bag) for _ in FEATURES for bag in ids_per_bag]
    return KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=torch.tensor(values),
                                               lengths=torch.tensor(lengths))


def _trained_derived_model(layout: dict):
    """A table-wise DMP model of two derived-weights FTRL tables, initialised with global_init (encoded
    into z: ftrl_beta > 0), then 3 SUM-pooled steps of random bags and upstream gradients."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    ebc = _ebc("meta")
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **FUSED_KNOBS, "ftrl_weights": "derived",
                                       **layout})
    plan = construct_module_sharding_plan(ebc, per_param_sharding={t: table_wise(rank=0) for t in TABLES},
                                          sharder=sharders[0], local_size=1, world_size=1, device_type="cpu")
    for ps in plan.values():
        ps.compute_kernel = "fused"
    dmp = DistributedModelParallel(_Model(ebc), device=torch.device("cpu"), sharders=sharders,
                                   plan=ShardingPlan({"ebc": plan}))
    msd = dmp.state_dict()
    for t in TABLES:
        copy_global_into(msd[f"ebc.embedding_bags.{t}.weight"], global_init(t, ROWS, DIM))
    rng = np.random.default_rng(3)
    for _ in range(3):
        out = dmp(_kjt([rng.integers(0, ROWS, size=rng.integers(1, 5)).tolist() for _ in range(4)]))
        up = torch.from_numpy(rng.normal(size=tuple(out.values().shape))).float()
        (out.values() * up).sum().backward()
    return dmp


def _prox_of_states(dmp) -> dict[str, np.ndarray]:
    """float64 prox(z, n) of each table's trained states (``n`` ``[rows]`` when row-wise)."""
    osd = dmp.fused_optimizer.state_dict()["state"]
    out = {}
    for t in TABLES:
        states = osd[f"ebc.embedding_bags.{t}.weight"]
        z = states[f"{t}.linear"].local_shards()[0].tensor.double().numpy()
        n = states[f"{t}.accum"].local_shards()[0].tensor.double().numpy()
        out[t] = ftrl_reference_weight(z, n if n.ndim == 2 else n[:, None], **KNOBS)
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(map(str, lay.values())))
def test_quantized_inference_model_looks_up_prox_of_the_states(one_process_group, layout):
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.inference.state_dict_transform import state_dict_gather
    dmp = _trained_derived_model(layout)
    want = _prox_of_states(dmp)
    init = {t: global_init(t, ROWS, DIM) for t in TABLES}
    assert all(not np.allclose(want[t], init[t], atol=1e-4) for t in TABLES), "training moved no weight"

    model = _Model(_ebc("cpu"))
    state_dict_gather(dmp.state_dict(), model.state_dict())
    quant = quantize_inference_model(model, per_table_weight_dtype={"t_fp16": torch.float16})
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
    assert isinstance(quant.ebc, QuantEmbeddingBagCollection)
    assert [c.data_type for c in quant.ebc.embedding_bag_configs()] == [DataType.INT8, DataType.FP16]
    # One bag per row: the lookup returns each row's dequantised weight.
    got = quant(_kjt([[r] for r in range(ROWS)])).to_dict()
    for t, f in zip(TABLES, FEATURES):
        deq = got[f].double().numpy()
        if t == "t_fp16":   # fp16 rounding of w (and w's fp32 rounding before it)
            tol = np.abs(want[t]) * 2.0 ** -11 + 1e-7
        else:               # int8 row-wise: half a step of (max - min) / 255, fp16 scale and bias
            span = want[t].max(axis=1, keepdims=True) - want[t].min(axis=1, keepdims=True)
            tol = span / 255.0 * 0.5 + (span + np.abs(want[t]).max(axis=1, keepdims=True)) * 2.0 ** -10
        assert np.all(np.abs(deq - want[t]) <= tol), (t, np.abs(deq - want[t]).max())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(map(str, lay.values())))
def test_export_writes_prox_of_the_states(one_process_group, layout, tmp_path):
    from torchrec_ftrl.checkpoint import export_ftrl_tables
    dmp = _trained_derived_model(layout)
    export_ftrl_tables(dmp, tmp_path / "tables.npz")
    arrays = np.load(tmp_path / "tables.npz")
    for t, w in _prox_of_states(dmp).items():
        accum = arrays[f"{t}/accum"].astype(np.float64)
        assert accum.shape == ((ROWS,) if layout["ftrl_accumulator"] == "rowwise" else (ROWS, DIM))
        from_file = ftrl_reference_weight(arrays[f"{t}/linear"], accum if accum.ndim == 2 else accum[:, None],
                                          **KNOBS)
        np.testing.assert_allclose(from_file, w, rtol=0, atol=0)   # the file's states are the model's
        np.testing.assert_allclose(arrays[t], w, rtol=2e-6, atol=1e-9)
