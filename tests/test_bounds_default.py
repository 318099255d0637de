"""The TBE's default bounds check is FBGEMM's: ``BoundsCheckMode.WARNING`` (issue 53, item 5).

A default-constructed TBE, and one a TorchRec sharder builds without ``bounds_check_mode`` in its
``fused_params``, read an out-of-range index as row 0 (forward and update) and count it in
``bounds_check_warning``, with no host read; ``FATAL`` stays an explicit choice (a bad batch raises
and changes nothing), from the constructor or from ``fused_params``. Expected values are computed
here in float64 (``torch.nn.functional.embedding_bag`` on the repaired ids, ``ftrl_reference_rows``
for the update), not by the code under test.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import tbe_harness as H
from conftest import assert_same_bits, bits, tbe_state
from reference import ftrl_reference_rows, reference_knobs
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode

HP = dict(learning_rate=0.1, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.5)
ROWS, DIMS = (10, 6), (4, 3)


def _i64(x):
    return torch.tensor(x, dtype=torch.int64)


def _repaired(ids, rows):
    """FBGEMM's WARNING repair of one table's ids, written independently: out of [0, rows) -> 0."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.where((ids >= 0) & (ids < rows), ids, 0)


def test_default_bounds_check_mode_is_warning():
    default = inspect.signature(FTRLTableBatchedEmbeddingBags).parameters["bounds_check_mode"].default
    assert default == BoundsCheckMode.WARNING
    assert FTRLTableBatchedEmbeddingBags([(4, 2)]).bounds_check_mode == BoundsCheckMode.WARNING


@pytest.mark.parametrize("backend", H.CPU_BACKENDS)
def test_default_tbe_reads_a_bad_index_as_row_0_counts_it_and_trains_row_0(backend):
    """Two tables (10 x 4, 6 x 3), SUM, B=2: feature 0 bags [1, 12] and [-3]; feature 1 bags [2] and
    [6, 5]. The three bad ids (12, -3, 6) read row 0 of their table and are counted once each; the
    update gives row 0 their gradients, as FBGEMM's WARNING does (the ids are repaired in place)."""
    torch.manual_seed(0)
    m = FTRLTableBatchedEmbeddingBags(list(zip(ROWS, DIMS)), backend=backend, **HP)
    W0 = [w.detach().double().clone() for w in m.split_embedding_weights()]
    ids = [[1, 12, -3], [2, 6, 5]]                   # per feature, bags of lengths [2, 1] and [1, 2]
    lengths = [[2, 1], [1, 2]]
    out = m(_i64(ids[0] + ids[1]), _i64([0, 2, 3, 4, 6]))
    assert int(m.bounds_check_warning) == 3
    expected = torch.cat([
        torch.nn.functional.embedding_bag(torch.from_numpy(_repaired(ids[t], ROWS[t])), W0[t],
                                          torch.tensor([0, lengths[t][0]]), mode="sum")
        for t in range(2)], dim=1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    assert int(m.bounds_check_warning) == 3          # the backward reads the forward's repaired batch
    col = [0, DIMS[0]]
    acc, lin = zip(*m.split_optimizer_states())
    for t in range(2):
        bag_of = np.repeat([0, 1], lengths[t])
        grads = g.double().numpy()[bag_of, col[t]:col[t] + DIMS[t]]
        rows = _repaired(ids[t], ROWS[t])
        w, z, n = ftrl_reference_rows(W0[t].numpy(), np.zeros((ROWS[t], DIMS[t])), np.zeros((ROWS[t], DIMS[t])),
                                      rows, grads, **reference_knobs(m.hyperparams))
        assert 0 in rows.tolist()
        got = m.split_embedding_weights()[t].double()
        torch.testing.assert_close(got, torch.from_numpy(w), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(acc[t].double(), torch.from_numpy(n), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lin[t].double(), torch.from_numpy(z), rtol=1e-5, atol=1e-5)
        untouched = np.setdiff1d(np.arange(ROWS[t]), rows)
        assert torch.equal(bits(got[untouched].float()), bits(W0[t][untouched].float()))


@pytest.mark.parametrize("backend", H.CPU_BACKENDS)
def test_default_tbe_repairs_offsets_like_fbgemm(backend):
    torch.manual_seed(0)
    H.check_warning_repairs(FTRLTableBatchedEmbeddingBags(list(zip(ROWS, DIMS)), backend=backend, **HP))


@pytest.mark.parametrize("backend", H.CPU_BACKENDS)
def test_explicit_fatal_still_raises_and_changes_nothing(backend):
    torch.manual_seed(0)
    m = FTRLTableBatchedEmbeddingBags(list(zip(ROWS, DIMS)), backend=backend,
                                      bounds_check_mode=BoundsCheckMode.FATAL, **HP)
    before = tbe_state(m)
    with pytest.raises(ValueError, match="out of range"):
        m(_i64([1, 12, -3, 2, 6, 5]), _i64([0, 2, 3, 4, 6]))
    assert_same_bits(before, tbe_state(m))
    assert int(m.bounds_check_warning) == 0


# ---------------------------------------------------------------- under TorchRec (DMP, one CPU rank)
def _dmp(fused_params):
    """A one-table EBC (t0: 10 x 4, feature f0) sharded table-wise on this CPU rank by our sharders."""
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    import torchrec_ftrl
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes

    tables = [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharders = torchrec_ftrl.sharders(fused_params)
    plan = construct_module_sharding_plan(ebc, per_param_sharding={"t0": table_wise(rank=0)}, sharder=sharders[0],
                                          local_size=1, world_size=1, device_type="cpu")
    for ps in plan.values():
        ps.compute_kernel = "fused"
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=sharders,
                                   plan=ShardingPlan({"": plan}))
    (tbe,) = ftrl_tbes(dmp)
    return dmp, tbe


def _kjt(ids, lengths):
    from torchrec import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=_i64(ids), lengths=_i64(lengths))


def test_sharded_table_without_bounds_check_mode_gets_warning(one_process):
    from torchrec_ftrl.optim_type import EmbOptimType
    dmp, tbe = _dmp({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1})
    assert tbe.bounds_check_mode == BoundsCheckMode.WARNING
    W0 = tbe.split_embedding_weights()[0].detach().double().clone()
    ids = [1, 12, -3]
    out = dmp(_kjt(ids, [2, 1])).values()
    assert int(tbe.bounds_check_warning) == 2
    expected = torch.nn.functional.embedding_bag(torch.from_numpy(_repaired(ids, 10)), W0, torch.tensor([0, 2]),
                                                  mode="sum")
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)


def test_sharded_table_honours_fatal_from_fused_params(one_process):
    from torchrec_ftrl.optim_type import EmbOptimType
    dmp, tbe = _dmp({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1,
                     "bounds_check_mode": BoundsCheckMode.FATAL})
    assert tbe.bounds_check_mode == BoundsCheckMode.FATAL
    before = tbe_state(tbe)
    with pytest.raises(ValueError, match="out of range"):
        dmp(_kjt([1, 12, -3], [2, 1]))
    assert_same_bits(before, tbe_state(tbe))
