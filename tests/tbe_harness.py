"""Reusable randomized checks of ``FTRLTableBatchedEmbeddingBags`` against an independent reference.

Used by ``tests/test_tbe.py`` (backends "cpp" and "torch"), ``tests/test_reliability_tbe.py`` and the
Triton tests (backend "triton"). Expected values never come from the module's kernels: they come from
the float64 oracle of ``tests/conftest.py`` (:func:`conftest.reference_update`): the forward by
``torch.nn.functional.embedding_bag`` / ``embedding`` per feature on float64 copies of the tables, the
summed row gradients and the per-sample-weight gradient by float64 autograd, and ONE
``ftrl_reference_rows`` update (``tests/reference.py``, transcribed from ``docs/ftrl.md``) per touched
row; untouched rows must stay bit-for-bit unchanged.

Each step starts the reference from the module's current state (in float64), so every step is checked
with tight tolerances and nothing drifts.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np
import torch

from conftest import ReferenceStep, bits, reference_update
from reference import reference_knobs
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import PoolingMode, SparseType

#: Backends the CPU tests run; the Triton tests pass ``backend="triton"`` explicitly.
CPU_BACKENDS = ["cpp", "torch"]

_DTYPES = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16,
           SparseType.BF16: torch.bfloat16}

# Relative tolerance of a value rounded to each dtype (a few ulps), and of fp32 math vs float64.
_RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclasses.dataclass
class TBECase:
    """One random configuration. ``hp`` holds the constructor's FTRL keywords."""

    specs: list                      # [(rows, dim)] per table
    feature_table_map: list          # table of each feature
    pooling: PoolingMode
    weights_precision: SparseType
    output_dtype: SparseType
    weighted: bool
    vbe: Optional[list]              # batch_size_per_feature_per_rank or None
    B: int                           # samples per feature (non-VBE)
    max_L: int
    hot: float                       # probability an index is the table's hot row 0
    long_bag: bool                   # one bag per step gets 4 * max_L + 7 indices
    index_dtype: torch.dtype
    hp: dict
    seed: int

    def describe(self) -> str:
        return (f"seed={self.seed} specs={self.specs} ftm={self.feature_table_map} "
                f"pool={self.pooling.name} w={self.weights_precision.name} "
                f"out={self.output_dtype.name} weighted={self.weighted} vbe={self.vbe} B={self.B} "
                f"max_L={self.max_L} hot={self.hot} long={self.long_bag} idx={self.index_dtype} "
                f"hp={self.hp}")


_HP_CHOICES = [
    dict(learning_rate=0.1),
    dict(learning_rate=0.05, ftrl_l1_reg=0.02),
    dict(learning_rate=0.2, ftrl_l2_reg=0.05),
    dict(learning_rate=0.1, ftrl_beta=1.0, ftrl_l1_reg=0.01, ftrl_l2_reg=0.01),
    dict(learning_rate=0.1, ftrl_l2_shrinkage=0.3),
    dict(learning_rate=0.3, ftrl_learning_rate_power=-0.3, ftrl_initial_accumulator_value=0.1),
    dict(learning_rate=0.05, ftrl_learning_rate_power=0.0, ftrl_beta=0.5),
    dict(learning_rate=0.1, ftrl_l2_reg=0.1, ftrl_l2_convention="mcmahan",
         ftrl_initial_accumulator_value=0.1, ftrl_l1_reg=0.005),
]


def random_case(seed: int, *, allow_low_precision: bool = True) -> TBECase:
    """A random configuration covering T, mixed D (incl. 1 and D % 4 != 0), B, L (incl. 0), E, pooling
    modes, weights, VBE, shared tables, int32/int64 indices, weight/output precisions, hot rows."""
    r = random.Random(seed)
    pooling = r.choice([PoolingMode.SUM, PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE])
    T = r.randint(1, 4)
    if pooling == PoolingMode.NONE:
        d = r.choice([1, 3, 4, 8, 13])
        dims = [d] * T
    else:
        dims = [r.choice([1, 2, 3, 4, 5, 8, 13, 16, 33]) for _ in range(T)]
    specs = [(r.choice([1, 2, 7, 30, 100]), dims[t]) for t in range(T)]
    ftm = list(range(T))
    if r.random() < 0.4:                              # shared tables: features repeat a table
        ftm += [r.randrange(T) for _ in range(r.randint(1, 3))]
        r.shuffle(ftm)
    precisions = [SparseType.FP32] * 3 + ([SparseType.FP16, SparseType.BF16] if allow_low_precision else [])
    vbe = None
    if pooling != PoolingMode.NONE and r.random() < 0.3:
        R = r.randint(1, 3)
        vbe = [[r.randint(0, 4) for _ in range(R)] for _ in ftm]
    return TBECase(
        specs=specs, feature_table_map=ftm, pooling=pooling,
        weights_precision=r.choice(precisions), output_dtype=r.choice(precisions),
        weighted=pooling != PoolingMode.NONE and r.random() < 0.5, vbe=vbe,
        B=r.randint(0, 6) if r.random() < 0.1 else r.randint(1, 6), max_L=r.choice([0, 1, 3, 6]),
        hot=r.choice([0.0, 0.0, 0.5]), long_bag=r.random() < 0.3,
        index_dtype=r.choice([torch.int32, torch.int64]), hp=r.choice(_HP_CHOICES), seed=seed)


def build_module(case: TBECase, backend: str, device="cpu", **kwargs) -> FTRLTableBatchedEmbeddingBags:
    """The module under test, weights drawn uniformly from [-0.5, 0.5] (seeded); ``kwargs``: more
    constructor arguments (e.g. ``deterministic``)."""
    torch.manual_seed(case.seed)
    m = FTRLTableBatchedEmbeddingBags(
        case.specs, feature_table_map=case.feature_table_map, pooling_mode=case.pooling,
        weights_precision=case.weights_precision, output_dtype=case.output_dtype, device=device,
        backend=backend, **case.hp, **kwargs)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    return m


def _bag_sizes(case: TBECase) -> list[int]:
    """Number of bags of each feature (feature-major input order)."""
    if case.vbe is not None:
        return [sum(per_rank) for per_rank in case.vbe]
    return [case.B] * len(case.feature_table_map)


def random_batch(case: TBECase, rng: np.random.Generator, device="cpu"):
    """``(indices, offsets, per_sample_weights or None)`` in FBGEMM's feature-major layout."""
    idx, lengths = [], []
    long_at = None
    n_bags = sum(_bag_sizes(case))
    if case.long_bag and n_bags:
        long_at = int(rng.integers(n_bags))
    k = 0
    for f, nb in enumerate(_bag_sizes(case)):
        rows = case.specs[case.feature_table_map[f]][0]
        for _ in range(nb):
            L = 4 * case.max_L + 7 if k == long_at else int(rng.integers(0, case.max_L + 1))
            bag = rng.integers(0, rows, size=L)
            bag[rng.random(L) < case.hot] = 0
            idx.extend(bag.tolist())
            lengths.append(L)
            k += 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = torch.tensor(idx, dtype=case.index_dtype, device=device)
    offsets = torch.tensor(offsets, dtype=case.index_dtype, device=device)
    psw = None
    if case.weighted:
        psw = torch.tensor(rng.uniform(-1.0, 2.0, size=len(idx)), dtype=torch.float32, device=device)
    return indices, offsets, psw


def bf16_spacing(x) -> np.ndarray:
    """float64 distance between neighbouring bf16 values at ``|x|`` (8 significand bits:
    ``2^(e - 8)`` for ``|x| = m 2^e``, ``0.5 <= m < 1``; the subnormal spacing ``2^-133`` at the
    bottom), from ``np.frexp``. A stochastically rounded value is within this of its fp32 value."""
    _, e = np.frexp(np.abs(np.asarray(x, dtype=np.float64)))
    return np.ldexp(1.0, np.maximum(e - 8, -133))


def _close(actual, expected, dtype, what, case, atol_scale=1.0, extra_atol=0.0):
    rtol = _RTOL[dtype]
    atol = rtol * atol_scale + 1e-7
    a = actual.double().cpu()
    e = torch.as_tensor(expected, dtype=torch.float64)
    atol = atol + torch.as_tensor(extra_atol, dtype=torch.float64)
    ok = (a - e).abs() <= atol + rtol * e.abs()
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~ok).sum())} mismatches, first at {bad}: got "
                             f"{a[tuple(bad)].item()!r}, expected {e[tuple(bad)].item()!r} "
                             f"(rtol={rtol}, atol={atol.max().item() if atol.dim() else atol.item()})"
                             f"\n{case.describe()}")


def table_snapshot(m):
    """Copies of the per-table weights and ``(accum, linear)`` states of ``m``."""
    return ([w.detach().clone() for w in m.split_embedding_weights()],
            [(a.clone(), z.clone()) for a, z in m.split_optimizer_states()])


def reference_step(m, case: TBECase, W0, S0, indices, offsets, grad_out, psw=None) -> ReferenceStep:
    """The float64 reference of one step of ``m`` from the snapshot ``W0``, ``S0``."""
    return reference_update(W0, [a for a, _ in S0], [z for _, z in S0], case.feature_table_map,
                            case.pooling, indices, offsets, grad_out, reference_knobs(m.hyperparams),
                            psw=psw, vbe=case.vbe)


def check_tables(m, case: TBECase, W0, S0, ref: ReferenceStep, what: str) -> None:
    """After a step of ``m`` from ``W0``, ``S0``: the rows the reference updated match it, and every
    other row (untouched, or skipped for a non-finite summed gradient) keeps its bits. A bf16 state
    (the reference ran from its stored, rounded values) may be off by one more bf16 spacing of the
    reference value: stochastic rounding moves it to one of its two bf16 neighbours."""
    wdt = _DTYPES[case.weights_precision]
    # One bf16 spacing, taken at |x| * 1.01 to cover a value across a power of two from x.
    sr = {name: ((lambda x: bf16_spacing(np.abs(x) * 1.01))
                 if getattr(m, f"{name}_dev").dtype == torch.bfloat16 else (lambda x: 0.0))
          for name in ("accum", "linear")}
    W1, S1 = m.split_embedding_weights(), m.split_optimizer_states()
    for t, (rows_t, _) in enumerate(case.specs):
        upd = ref.updated[t]
        rows = torch.as_tensor(upd, dtype=torch.long)
        keep = torch.ones(rows_t, dtype=torch.bool)
        keep[rows] = False
        for name, now, before in (("weight", W1[t], W0[t]), ("accum", S1[t][0], S0[t][0]),
                                  ("linear", S1[t][1], S0[t][1])):
            assert torch.equal(bits(now.cpu()[keep]), bits(before.cpu()[keep])), \
                f"{what} table {t}: {name} of an untouched or skipped row changed\n{case.describe()}"
        if len(upd):
            _close(S1[t][0].cpu()[rows], ref.n[t][upd], torch.float32, f"{what} table {t} accum", case,
                   atol_scale=_state_scale(ref.n[t][upd]), extra_atol=sr["accum"](ref.n[t][upd]))
            _close(S1[t][1].cpu()[rows], ref.z[t][upd], torch.float32, f"{what} table {t} linear", case,
                   atol_scale=_state_scale(ref.z[t][upd]), extra_atol=sr["linear"](ref.z[t][upd]))
            _close(W1[t].cpu()[rows], ref.w[t][upd], wdt, f"{what} table {t} weight", case,
                   atol_scale=_state_scale(ref.w[t][upd]))


def check_case(case: TBECase, backend: str, device="cpu", steps: int = 3, **kwargs) -> None:
    """Run ``steps`` forward/backward steps and check every output and state against the reference;
    ``kwargs``: more constructor arguments (e.g. ``optimizer_state_dtypes``).

    Raises AssertionError (with the case description) on the first mismatch."""
    m = build_module(case, backend, device, **kwargs)
    rng = np.random.default_rng(case.seed)
    wdt = _DTYPES[case.weights_precision]
    odt = _DTYPES[case.output_dtype]
    for step in range(steps):
        indices, offsets, psw = random_batch(case, rng, device)
        W0, S0 = table_snapshot(m)
        psw_in = psw.clone().requires_grad_(True) if psw is not None else None
        out = m(indices, offsets, per_sample_weights=psw_in,
                batch_size_per_feature_per_rank=case.vbe)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + step),
                           dtype=torch.float64)
        grad_in = grad.to(odt)
        ref = reference_step(m, case, W0, S0, indices, offsets, grad_in, psw)
        assert out.dtype == odt, f"output dtype {out.dtype} != {odt}\n{case.describe()}"
        assert tuple(out.shape) == tuple(ref.out.shape), \
            f"output shape {tuple(out.shape)} != {tuple(ref.out.shape)}\n{case.describe()}"
        # Tolerance: the output is rounded to odt; fp32 sums of low-precision weights are exact-ish.
        _close(out, ref.out, odt, f"step {step} forward", case, atol_scale=1.0)

        out.backward(grad_in.to(device))

        if psw is not None:
            _close(psw_in.grad, ref.psw_grad, torch.float32 if wdt == torch.float32 else wdt,
                   f"step {step} per_sample_weights grad", case, atol_scale=10.0)
        assert not any(len(f) for f in ref.flagged), f"non-finite reference gradient\n{case.describe()}"
        check_tables(m, case, W0, S0, ref, f"step {step}")
        assert int(m.nonfinite_grad_rows) == 0


def check_warning_repairs(m) -> None:
    """``BoundsCheckMode.WARNING`` on ``m``, two tables (10 rows, D0) and (6 rows, D1), one feature
    each, SUM: a bad index reads row 0, offsets are repaired like FBGEMM (clamped into [0, N], made
    non-decreasing, last = N); every repair is counted once."""
    W = [w.detach().double().cpu().clone() for w in m.split_embedding_weights()]
    D1 = W[1].shape[1]
    dev = m.weights_dev.device
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    # feature 0 (10 rows): bags [1, 99] and [-4]; feature 1 (6 rows): bags [] and [6] (6 is out of range)
    out = m(i64([1, 99, -4, 6]), i64([0, 2, 3, 3, 4]))
    assert int(m.bounds_check_warning) == 3
    expected = torch.stack([torch.cat([W[0][1] + W[0][0], torch.zeros(D1, dtype=torch.float64)]),
                            torch.cat([W[0][0], W[1][0]])])
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-6, atol=1e-7)
    # -> offsets [0, 2, 2, 3, 3]: feature 0 bags [1, 2] and []; feature 1 bags [3] and []
    out = m(i64([1, 2, 3]), i64([0, 2, 1, 3, 9]))
    assert int(m.bounds_check_warning) == 3 + 2
    expected = torch.stack([torch.cat([W[0][1] + W[0][2], W[1][3]]),
                            torch.zeros(W[0].shape[1] + D1, dtype=torch.float64)])
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-6, atol=1e-7)


def _state_scale(x) -> float:
    """Absolute tolerance scale: fp32 cancellation in z = z + g - sigma*w is relative to the operands."""
    return 10.0 * max(1.0, float(np.abs(x).max()) if np.size(x) else 1.0)
