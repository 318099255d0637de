"""Reusable randomized checks of ``FTRLTableBatchedEmbeddingBags`` against an independent reference.

Used by ``tests/test_tbe.py`` (backends "cpp" and "torch") and by the Triton tests (backend "triton",
device "cuda"). Expected values never come from the module's kernels:

* forward: one ``torch.nn.functional.embedding_bag`` / ``embedding`` call per feature on a float64
  copy of its table (FBGEMM TBE semantics: SUM/MEAN pooling, per-sample weights, empty bags give 0);
* update: the float64 autograd gradient of ``sum(out * grad_out)`` w.r.t. each float64 table is the
  summed sparse gradient; ``ftrl_reference_rows`` (``torchrec_ftrl/kernels/reference.py``, transcribed
  from ``shared/docs/FTRL.md``) applies ONE update per touched row; untouched rows must stay
  bit-for-bit unchanged;
* per-sample-weight gradient: float64 autograd on the same reference (weights before the update).

Each step starts the reference from the module's current state (in float64), so every step is checked
with tight tolerances and nothing drifts.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as Fn

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels.reference import ftrl_reference_rows, reference_knobs
from torchrec_ftrl.tbe_compat import PoolingMode, SparseType

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


def build_module(case: TBECase, backend: str, device="cpu") -> FTRLTableBatchedEmbeddingBags:
    """The module under test, weights drawn uniformly from [-0.5, 0.5] (seeded)."""
    torch.manual_seed(case.seed)
    m = FTRLTableBatchedEmbeddingBags(
        case.specs, feature_table_map=case.feature_table_map, pooling_mode=case.pooling,
        weights_precision=case.weights_precision, output_dtype=case.output_dtype, device=device,
        backend=backend, **case.hp)
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


def reference_forward(tables64: list[torch.Tensor], case: TBECase, indices, offsets, psw):
    """Float64 expected output; ``tables64`` may require grad (for the reference gradients).

    Returns ``[B, sum D_f]`` (SUM/MEAN), ``[N, D]`` (NONE) or the flat FBGEMM VBE output (ranks, then
    features, then samples)."""
    idx = indices.long().cpu()
    off = offsets.long().cpu()
    psw64 = psw.double().cpu() if psw is not None else None
    sizes = _bag_sizes(case)
    per_feature, bag0 = [], 0
    for f, nb in enumerate(sizes):
        W = tables64[case.feature_table_map[f]]
        lo, hi = int(off[bag0]), int(off[bag0 + nb])
        if case.pooling == PoolingMode.NONE:
            per_feature.append(Fn.embedding(idx[lo:hi], W))
        else:
            foff = off[bag0:bag0 + nb] - lo
            fp = psw64[lo:hi] if psw64 is not None else None
            if case.pooling == PoolingMode.SUM or fp is None:
                mode = "sum" if case.pooling == PoolingMode.SUM else "mean"
                pooled = Fn.embedding_bag(idx[lo:hi], W, foff, mode=mode, per_sample_weights=fp,
                                          include_last_offset=False)
            else:  # MEAN with per-sample weights: weighted sum / bag length
                pooled = Fn.embedding_bag(idx[lo:hi], W, foff, mode="sum", per_sample_weights=fp)
                lens = (off[bag0 + 1:bag0 + nb + 1] - off[bag0:bag0 + nb]).double().clamp(min=1)
                pooled = pooled / lens.unsqueeze(1)
            per_feature.append(pooled)
        bag0 += nb
    if case.pooling == PoolingMode.NONE:
        return torch.cat(per_feature, 0)
    if case.vbe is None:
        return torch.cat(per_feature, 1)
    R = len(case.vbe[0])
    chunks = []
    for r in range(R):
        for f in range(len(sizes)):
            start = sum(case.vbe[f][:r])
            chunks.append(per_feature[f][start:start + case.vbe[f][r]].reshape(-1))
    return torch.cat(chunks)


def _close(actual, expected, dtype, what, case, atol_scale=1.0):
    rtol = _RTOL[dtype]
    atol = rtol * atol_scale + 1e-7
    a = actual.double().cpu()
    e = torch.as_tensor(expected, dtype=torch.float64)
    ok = (a - e).abs() <= atol + rtol * e.abs()
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~ok).sum())} mismatches, first at {bad}: got "
                             f"{a[tuple(bad)].item()!r}, expected {e[tuple(bad)].item()!r} "
                             f"(rtol={rtol}, atol={atol})\n{case.describe()}")


def check_case(case: TBECase, backend: str, device="cpu", steps: int = 3) -> None:
    """Run ``steps`` forward/backward steps and check every output and state against the reference.

    Raises AssertionError (with the case description) on the first mismatch."""
    m = build_module(case, backend, device)
    rng = np.random.default_rng(case.seed)
    wdt = _DTYPES[case.weights_precision]
    odt = _DTYPES[case.output_dtype]
    T = len(case.specs)
    for step in range(steps):
        indices, offsets, psw = random_batch(case, rng, device)
        W0 = [w.detach().clone() for w in m.split_embedding_weights()]
        S0 = [(a.clone(), z.clone()) for a, z in m.split_optimizer_states()]
        tables64 = [w.double().cpu().requires_grad_(True) for w in W0]
        psw_ref = psw.double().cpu().requires_grad_(True) if psw is not None else None
        expected = reference_forward(tables64, case, indices, offsets, psw_ref)

        psw_in = psw.clone().requires_grad_(True) if psw is not None else None
        out = m(indices, offsets, per_sample_weights=psw_in,
                batch_size_per_feature_per_rank=case.vbe)
        assert out.dtype == odt, f"output dtype {out.dtype} != {odt}\n{case.describe()}"
        assert tuple(out.shape) == tuple(expected.shape), \
            f"output shape {tuple(out.shape)} != {tuple(expected.shape)}\n{case.describe()}"
        # Tolerance: the output is rounded to odt; fp32 sums of low-precision weights are exact-ish.
        _close(out, expected.detach(), odt if odt != torch.float32 else torch.float32,
               f"step {step} forward", case, atol_scale=1.0)

        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + step),
                           dtype=torch.float64)
        grad_in = grad.to(odt)
        (expected * grad_in.double()).sum().backward()
        out.backward(grad_in.to(device))

        if psw is not None:
            _close(psw_in.grad, psw_ref.grad, torch.float32 if wdt == torch.float32 else wdt,
                   f"step {step} per_sample_weights grad", case, atol_scale=10.0)

        idx = indices.long().cpu()
        off = offsets.long().cpu()
        sizes = _bag_sizes(case)
        bag_feature = np.repeat(np.arange(len(sizes)), sizes)
        idx_bag = np.repeat(np.arange(len(bag_feature)), np.diff(off.numpy()))
        idx_table = np.asarray(case.feature_table_map)[bag_feature[idx_bag]] if len(idx) else np.zeros(0, int)
        W1 = m.split_embedding_weights()
        S1 = m.split_optimizer_states()
        for t in range(T):
            touched = np.unique(idx.numpy()[idx_table == t])
            g = tables64[t].grad
            rows = torch.as_tensor(touched, dtype=torch.long)
            w_ref, z_ref, n_ref = ftrl_reference_rows(
                W0[t].double().cpu().numpy(), S0[t][1].double().cpu().numpy(),
                S0[t][0].double().cpu().numpy(), touched,
                g[rows].numpy() if g is not None else np.zeros((len(touched), case.specs[t][1])),
                **reference_knobs(m.hyperparams))
            untouched = torch.ones(case.specs[t][0], dtype=torch.bool)
            untouched[rows] = False
            what = f"step {step} table {t}"
            for name, now, before in (("weight", W1[t], W0[t]), ("accum", S1[t][0], S0[t][0]),
                                      ("linear", S1[t][1], S0[t][1])):
                assert torch.equal(_bits(now.cpu()[untouched]), _bits(before.cpu()[untouched])), \
                    f"{what}: untouched {name} rows changed\n{case.describe()}"
            if len(touched):
                _close(S1[t][0].cpu()[rows], n_ref[touched], torch.float32, f"{what} accum", case,
                       atol_scale=_state_scale(n_ref[touched]))
                _close(S1[t][1].cpu()[rows], z_ref[touched], torch.float32, f"{what} linear", case,
                       atol_scale=_state_scale(z_ref[touched]))
                _close(W1[t].cpu()[rows], w_ref[touched], wdt, f"{what} weight", case,
                       atol_scale=_state_scale(w_ref[touched]))
        assert int(m.nonfinite_grad_rows) == 0


def _state_scale(x) -> float:
    """Absolute tolerance scale: fp32 cancellation in z = z + g - sigma*w is relative to the operands."""
    return 10.0 * max(1.0, float(np.abs(x).max()) if np.size(x) else 1.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparison: NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
