"""A synthetic CTR teacher: a fixed random logistic model over Zipf-distributed sparse ids and Gaussian
dense features, sampled with torch ops on any device and reproducible from seeds.

Each example has ``F`` categorical features (feature ``f`` draws one id in ``[0, V_f)``) and ``num_dense``
dense features. Ids follow a Zipf law of exponent 1: rank ``k`` (0-based) is drawn with probability
``log((k + 2) / (k + 1)) / log(V_f + 1)`` (inverse CDF ``k = floor((V_f + 1) ** u) - 1``, ``u ~ U[0, 1)``),
and rank ``k`` is stored as id ``(a_f * k + b_f) mod V_f`` (a bijection: ``a_f`` is coprime to ``V_f``), so
the frequent ids are spread over the table. The teacher's logit is::

    logit = bias + sum_f w_f(id_f) + dense @ v

``w_f(id)`` is non-zero only for the *informative* ids, those whose hash ``h1(f, id)`` in ``[0, 1)`` is
below ``informative_share``; there ``w_f(id) = weight_scale * (2 h2(f, id) - 1)``. The hashes are
integer mixes of (feature, id, teacher seed), computed on the fly: the teacher stores no table, so
``V_f`` may be 10M. Labels are ``Bernoulli(sigmoid(logit))``; the teacher's own AUC on an evaluation set
(:meth:`Teacher.ceiling_auc`) is the ceiling any student can reach there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B          # 32-bit integer hash multiplier (h ^= h >> 16; h *= _MIX; twice)
_SCRAMBLE = 1_000_003     # prime multiplier of the rank -> id bijection


def _hash01(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 ``x`` (values below 2**32 after masking) -> float64 in ``[0, 1)``."""
    h = x & _MASK32
    h = (((h >> 16) ^ h) * _MIX) & _MASK32
    h = (((h >> 16) ^ h) * _MIX) & _MASK32
    h = (h >> 16) ^ h
    return h.to(torch.float64) / float(1 << 32)


@dataclass(frozen=True)
class TeacherConfig:
    """Shape and strength of a :class:`Teacher`.

    ``num_embeddings``: ``V_f`` per categorical feature (ids per feature); ``informative_share``: the
    expected share of ids with a non-zero teacher weight; ``weight_scale``: their weights are uniform
    in ``[-weight_scale, weight_scale]``; ``dense_scale``: the dense coefficients ``v`` are
    ``N(0, dense_scale**2 / num_dense)``; ``bias``: sets the CTR; ``seed``: the teacher's identity.
    """

    num_embeddings: Sequence[int]
    num_dense: int = 13
    informative_share: float = 0.05
    weight_scale: float = 2.0
    dense_scale: float = 1.0
    bias: float = -1.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.num_embeddings or any(int(v) < 1 for v in self.num_embeddings):
            raise ValueError(f"num_embeddings must be a non-empty list of sizes >= 1, got "
                             f"{list(self.num_embeddings)}")
        if not 0.0 < self.informative_share <= 1.0:
            raise ValueError(f"informative_share must be in (0, 1], got {self.informative_share}")
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")


def log_spaced_sizes(num_features: int, smallest: int, largest: int) -> list[int]:
    """``num_features`` table sizes spaced evenly on a log scale from ``smallest`` to ``largest``."""
    if num_features == 1:
        return [int(smallest)]
    r = math.log(largest / smallest) / (num_features - 1)
    return [int(round(smallest * math.exp(r * i))) for i in range(num_features)]


@dataclass
class TeacherData:
    """``n`` examples: ``dense [n, num_dense]`` float32, ``ids [n, F]`` int64, ``labels [n]`` float32
    (0/1), ``logits [n]`` float32 (the teacher's), all on one device."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    logits: torch.Tensor = field(repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class Teacher:
    """The teacher model of ``config`` (see the module docstring); ``device``: where it samples."""

    def __init__(self, config: TeacherConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        sizes = [int(v) for v in config.num_embeddings]
        mults = []
        for v in sizes:
            a = _SCRAMBLE % v or 1
            while math.gcd(a, v) != 1:
                a += 1
            mults.append(a)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=self.device)
        self._log_v1 = torch.log(self.sizes.double() + 1.0)
        self._mult = torch.tensor(mults, dtype=torch.int64, device=self.device)
        self._shift = torch.tensor([(7919 * (f + 1) + config.seed) % v for f, v in enumerate(sizes)],
                                   dtype=torch.int64, device=self.device)
        # feature salt of the hashes: distinct per (feature, teacher seed), below 2**31
        self._salt = (torch.arange(len(sizes), dtype=torch.int64, device=self.device) + 1) * 40503 \
            + (config.seed % 65536) * 2654435
        g = torch.Generator(device="cpu").manual_seed(config.seed)
        self.dense_coef = (torch.randn(config.num_dense, generator=g, dtype=torch.float64)
                           * config.dense_scale / math.sqrt(max(config.num_dense, 1))).to(self.device)

    @property
    def num_features(self) -> int:
        return len(self.config.num_embeddings)

    def informative(self, ids: torch.Tensor) -> torch.Tensor:
        """``bool [n, F]``: which ids of ``ids [n, F]`` (int64, on this device) have a non-zero weight."""
        return _hash01(ids * 2654435761 + self._salt) < self.config.informative_share

    def sparse_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """``float64 [n, F]``: the teacher weight ``w_f(id)`` of each id of ``ids [n, F]``."""
        u = _hash01(ids * 2246822519 + self._salt * 3 + 1)
        w = self.config.weight_scale * (2.0 * u - 1.0)
        return torch.where(self.informative(ids), w, torch.zeros_like(w))

    def sample(self, n: int, seed: int, chunk: int = 1 << 21) -> TeacherData:
        """``n`` examples drawn from the stream ``seed`` (same ``(config, seed, n, chunk)``, same
        examples, on a given device type), generated in chunks of ``chunk`` rows to bound the memory
        peak.

        Raises:
            ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        g = torch.Generator(device=self.device).manual_seed(int(seed))
        parts = [self._chunk(min(chunk, n - s), g) for s in range(0, n, chunk)]
        return TeacherData(*(torch.cat(p) for p in zip(*parts)))

    def _chunk(self, n: int, g: torch.Generator):
        cfg, dev = self.config, self.device
        u = torch.rand((n, self.num_features), generator=g, device=dev, dtype=torch.float64)
        rank = (torch.exp(u * self._log_v1) - 1.0).floor().long().clamp_(min=0)
        rank = torch.minimum(rank, self.sizes - 1)
        ids = (rank * self._mult + self._shift) % self.sizes
        dense = torch.randn((n, cfg.num_dense), generator=g, device=dev, dtype=torch.float32)
        logits = cfg.bias + self.sparse_weights(ids).sum(1) + dense.double() @ self.dense_coef
        labels = (torch.rand(n, generator=g, device=dev, dtype=torch.float64)
                  < torch.sigmoid(logits)).float()
        return dense, ids, labels, logits.float()

    @staticmethod
    def ceiling_auc(data: TeacherData) -> float:
        """The teacher's own AUC on ``data`` (its logits against the sampled labels)."""
        from torchmetrics.functional.classification import binary_auroc
        return float(binary_auroc(data.logits.double().cpu(), data.labels.long().cpu()))


def teacher_summary(teacher: Teacher, data: Optional[TeacherData] = None) -> dict:
    """JSON-friendly description: the config, and with ``data`` its CTR, ceiling AUC and the share of
    informative ids among its id occurrences."""
    c = teacher.config
    out = {"num_embeddings": [int(v) for v in c.num_embeddings], "num_dense": c.num_dense,
           "informative_share": c.informative_share, "weight_scale": c.weight_scale,
           "dense_scale": c.dense_scale, "bias": c.bias, "seed": c.seed,
           "zipf_exponent": 1.0}
    if data is not None:
        out.update(rows=len(data), ctr=float(data.labels.mean()), ceiling_auc=Teacher.ceiling_auc(data),
                   informative_occurrence_share=float(teacher.informative(data.ids).float().mean()))
    return out
