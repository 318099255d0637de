"""One run of the quality study: a DLRM whose sparse part is one TBE trained by a named *variant*
(sparse optimizer, FTRL knobs, state dtypes, layout keys), trained on given examples in a seeded order
from seeded initial weights, then evaluated: AUC, log loss, normalized entropy, exact-zero shares and
bytes of the sparse model.

The model is single-process (no DMP): the TBE's pooled output ``[B, F * D]`` feeds TorchRec's DLRM
blocks (``torchrec.models.dlrm``'s ``DenseArch``, ``InteractionArch``, ``OverArch``), as
``torchrec_ftrl.job.model.build_dlrm`` composes them under DMP. FTRL variants use
``torchrec_ftrl.FTRLTableBatchedEmbeddingBags``; the stock ones FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen`` (``EXACT_ROWWISE_ADAGRAD``, ``ADAM``, ``EXACT_SGD``). FTRL
knobs are per-example values scaled by the batch size as the CTR job does
(``torchrec_ftrl.job.cli.ftrl_fused_knobs``), so they mean the same at every batch size.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# FTRL knobs as the CTR job's flags name them (per example; docs/main-job.md)
FTRL_DEFAULTS = {"sparse_lr": 0.05, "ftrl_l1": 0.1, "ftrl_l2": 0.0, "ftrl_beta": 1.0,
                 "ftrl_lr_power": -0.5, "ftrl_l2_shrinkage": 0.0, "ftrl_initial_accumulator": 0.0}
STOCK_OPTIMIZERS = {"rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM", "sgd": "EXACT_SGD"}


@dataclass(frozen=True)
class Variant:
    """A named way to train the sparse part.

    ``optimizer``: ``"ftrl"`` or a key of ``STOCK_OPTIMIZERS``; ``knobs``: FTRL's per-example flags
    (keys of ``FTRL_DEFAULTS``, overriding them) or the stock TBE's keyword arguments
    (``learning_rate``, ``eps``, ...); ``state_dtypes``: FTRL's ``optimizer_state_dtypes`` (e.g.
    ``{"accum": "bf16", "linear": "bf16"}``); ``layout``: further keyword arguments of
    ``FTRLTableBatchedEmbeddingBags`` that choose a storage layout (e.g. ``{"ftrl_weights":
    "derived"}``); a key the installed TBE does not take is refused (:func:`check_supported`);
    ``zero_init``: the tables start at w = 0 instead of :func:`init_weights`' uniform values (which
    derived weights encode into ``z`` where ``q(n0) > 0``).
    """

    name: str
    optimizer: str
    knobs: dict = field(default_factory=dict)
    state_dtypes: Optional[dict] = None
    layout: dict = field(default_factory=dict)
    description: str = ""
    zero_init: bool = False


def _v(name, optimizer, description, **kw) -> tuple[str, Variant]:
    return name, Variant(name, optimizer, description=description, **kw)


BF16_BOTH = {"accum": "bf16", "linear": "bf16"}
# The study's variants; the first is the reference. A lean layout is one entry here.
VARIANTS: dict[str, Variant] = dict([
    _v("ftrl", "ftrl", "exact FTRL, fp32 state, stored weights (reference)"),
    _v("ftrl_bf16_state", "ftrl", "FTRL, bf16 accum and linear", state_dtypes=BF16_BOTH),
    _v("ftrl_derived", "ftrl", "FTRL, weights derived from (z, n), fp32 state",
       layout={"ftrl_weights": "derived"}),
    _v("ftrl_derived_bf16_zn", "ftrl", "FTRL, derived weights, bf16 z and n",
       layout={"ftrl_weights": "derived"}, state_dtypes=BF16_BOTH),
    _v("ftrl_derived_rowwise_n", "ftrl", "FTRL, derived weights, one accumulator n per row (516 B)",
       layout={"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}),
    _v("ftrl_derived_bf16_z_rowwise_n", "ftrl",
       "FTRL, derived weights, bf16 z, one fp32 accumulator n per row (260 B)",
       layout={"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}, state_dtypes={"linear": "bf16"}),
    _v("ftrl_zero_init", "ftrl", "exact FTRL, fp32 state, stored weights, tables started at w = 0",
       zero_init=True),
    _v("ftrl_derived_zero_init", "ftrl", "FTRL, derived weights, fp32 state, tables started at w = 0",
       layout={"ftrl_weights": "derived"}, zero_init=True),
    _v("ftrl_derived_rowwise_n_zero_init", "ftrl",
       "FTRL, derived weights, one accumulator n per row, tables started at w = 0",
       layout={"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}, zero_init=True),
    _v("rowwise_adagrad", "rowwise_adagrad", "FBGEMM EXACT_ROWWISE_ADAGRAD (context)",
       knobs={"learning_rate": 0.05, "eps": 1e-8}),
    _v("adam", "adam", "FBGEMM ADAM (context; no CPU kernel in FBGEMM)",
       knobs={"learning_rate": 0.001}),
    _v("sgd", "sgd", "FBGEMM EXACT_SGD (context)", knobs={"learning_rate": 1.0}),
])
REFERENCE = "ftrl"


def check_supported(variant: Variant, device: torch.device) -> None:
    """Refuse a variant this installation cannot train as specified.

    Raises:
        ValueError: an unknown optimizer; an FTRL layout key ``FTRLTableBatchedEmbeddingBags`` does
            not take, or a layout it refuses (naming the variant and the key); a stock optimizer
            FBGEMM has no kernel for on ``device`` (ADAM on CPU).
    """
    if variant.optimizer == "ftrl":
        from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
        params = inspect.signature(FTRLTableBatchedEmbeddingBags.__init__).parameters
        for key, value in variant.layout.items():
            if key not in params:
                raise ValueError(f"variant {variant.name!r}: layout key {key}={value!r} is not supported "
                                 f"by this FTRLTableBatchedEmbeddingBags (no such argument); the variant "
                                 f"is not run as another layout")
        unknown = set(variant.knobs) - set(FTRL_DEFAULTS)
        if unknown:
            raise ValueError(f"variant {variant.name!r}: unknown FTRL knob(s) {sorted(unknown)}; "
                             f"known: {sorted(FTRL_DEFAULTS)}")
        if variant.layout:   # a TBE that takes the key may still refuse the value (not implemented)
            try:
                FTRLTableBatchedEmbeddingBags([(1, 4)], device=device, **ftrl_tbe_kwargs(variant, 1))
            except ValueError as e:
                raise ValueError(f"variant {variant.name!r}: layout {variant.layout} is refused by "
                                 f"FTRLTableBatchedEmbeddingBags: {e}") from e
    elif variant.optimizer in STOCK_OPTIMIZERS:
        if variant.optimizer == "adam" and device.type != "cuda":
            raise ValueError(f"variant {variant.name!r}: FBGEMM has no {device.type} kernel for ADAM "
                             f"(it runs on cuda only)")
    else:
        raise ValueError(f"variant {variant.name!r}: unknown optimizer {variant.optimizer!r}; known: "
                         f"ftrl, {', '.join(STOCK_OPTIMIZERS)}")


def ftrl_tbe_kwargs(variant: Variant, batch_size: int) -> dict:
    """FTRL's keyword arguments for ``FTRLTableBatchedEmbeddingBags`` at ``batch_size`` (per-example
    knobs scaled as the CTR job scales them), plus the variant's state dtypes and layout keys."""
    from torchrec_ftrl.job.cli import ftrl_fused_knobs

    k = {**FTRL_DEFAULTS, **variant.knobs}
    args = SimpleNamespace(ftrl_reg_scale="per_example", batch_size=batch_size, **k)
    out = ftrl_fused_knobs(args, world_size=1)
    out["ftrl_learning_rate_power"] = k["ftrl_lr_power"]
    if variant.state_dtypes:
        out["optimizer_state_dtypes"] = dict(variant.state_dtypes)
    out.update(variant.layout)
    return out


def build_tbe(variant: Variant, sizes: list[int], dim: int, batch_size: int,
              device: torch.device) -> nn.Module:
    """The variant's TBE over tables ``[(sizes[f], dim)]``, SUM pooling, on ``device``."""
    check_supported(variant, device)
    if variant.optimizer == "ftrl":
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
        from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
        return FTRLTableBatchedEmbeddingBags(
            [(v, dim) for v in sizes], device=device, bounds_check_mode=BoundsCheckMode.IGNORE,
            **ftrl_tbe_kwargs(variant, batch_size))
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    cuda = device.type == "cuda"
    loc = EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST
    comp = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(v, dim, loc, comp) for v in sizes], optimizer=getattr(EmbOptimType, STOCK_OPTIMIZERS[variant.optimizer]),
        device=device if cuda else None, **variant.knobs)


class SparseDLRM(nn.Module):
    """DLRM over a TBE: ``forward(dense [B, num_dense] f32, indices, offsets) -> logits [B] f32``
    (``num_dense == 0``: a constant ``ones [B, 1]`` input, as ``torchrec_ftrl.job.model.CTRTrain``).
    ``indices``/``offsets``: FBGEMM's feature-major layout, one id per example and feature.
    ``dense_precision``: the arithmetic of the MLPs and the interaction, through the CTR job's
    ``torchrec_ftrl.job.dense_precision.dlrm_logits`` (bf16: autocast around them, the TBE lookup
    and the logits fp32)."""

    def __init__(self, tbe: nn.Module, num_features: int, dim: int, num_dense: int,
                 dense_arch: list[int], over_arch: list[int], device: torch.device,
                 dense_precision: str = "fp32") -> None:
        from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
        super().__init__()
        self.tbe, self.num_features, self.dim = tbe, num_features, dim
        self.dense_precision, self.device_type = dense_precision, torch.device(device).type
        self.dense_arch = DenseArch(max(num_dense, 1), [*dense_arch, dim], device=device)
        self.inter_arch = InteractionArch(num_sparse_features=num_features)
        over_in = dim + num_features * (num_features + 1) // 2
        self.over_arch = OverArch(over_in, [*over_arch, 1], device=device)

    def forward(self, dense, indices, offsets):
        b = dense.shape[0]
        if dense.shape[1] == 0:   # no dense features: a constant input (the bottom MLP learns a bias)
            dense = torch.ones((b, 1), dtype=torch.float32, device=dense.device)
        from torchrec_ftrl.job.dense_precision import dlrm_logits

        return dlrm_logits(self, dense, lambda: self.tbe(indices, offsets).view(b, self.num_features, self.dim),
                           self.dense_precision, self.device_type)

    def dense_parameters(self):
        return [p for n, p in self.named_parameters() if not n.startswith("tbe.")]


def tbe_input(ids: torch.Tensor, missing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, F]`` int64 (-1 = missing: an empty bag, as the CTR job's batches have it) -> FBGEMM
    ``(indices [nnz], offsets [F * B + 1])``, feature-major. ``missing=False``: the caller knows no
    id is -1 (one id per bag, no device-to-host sync)."""
    flat = ids.t().reshape(-1)
    if not missing:
        return flat, torch.arange(flat.numel() + 1, dtype=torch.int64, device=ids.device)
    keep = flat >= 0
    offsets = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(keep, 0, out=offsets[1:])
    return flat[keep], offsets


@torch.no_grad()
def init_weights(tbe: nn.Module, sizes: list[int], seed: int, device: torch.device,
                 zero: bool = False) -> None:
    """Table ``f`` := ``U(-1/sqrt(V_f), 1/sqrt(V_f))`` (TorchRec's default initializer) from a generator
    seeded with ``seed``: every variant of a seed starts from the same weights; ``zero``: 0."""
    g = torch.Generator(device=device).manual_seed(int(seed))
    for f, (w, v) in enumerate(zip(tbe.split_embedding_weights(), sizes)):
        bound = 1.0 / math.sqrt(v)
        values = torch.rand(w.shape, generator=g, device=device) * (2 * bound) - bound
        if zero:
            values.zero_()
        if _stores_weights(tbe):
            w.copy_(values)
        else:   # derived weights: encoded into z where q(n) > 0, else the row starts at 0
            tbe.load_weights(f, values)


def _stores_weights(tbe: nn.Module) -> bool:
    """False for an FTRL TBE whose row layout derives the weights (no weight array)."""
    return getattr(getattr(tbe, "row_layout", None), "weights", "stored") == "stored"


def touched_masks(ids: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Per feature, ``bool [V_f]``: the rows ``ids [n, F]`` looks up (-1, missing, looks up none)."""
    out = []
    for f, v in enumerate(sizes):
        m = torch.zeros(v, dtype=torch.bool, device=ids.device)
        col = ids[:, f]
        m[col[col >= 0]] = True
        out.append(m)
    return out


@torch.no_grad()
def sparse_model_stats(tbe: nn.Module, touched: list[torch.Tensor]) -> dict:
    """Exact-zero shares of the touched rows' weights and of touched rows (all-zero rows), non-zero
    weights among touched rows, and the bytes the TBE stores: weights plus optimizer state
    (``split_embedding_weights`` + ``split_optimizer_states``)."""
    zw = zr = tw = tr = 0
    weight_bytes = 0
    for w, m in zip(tbe.split_embedding_weights(), touched):
        weight_bytes += w.numel() * w.element_size() if _stores_weights(tbe) else 0
        wt = w[m]
        z = wt == 0
        zw += int(z.sum())
        zr += int(z.all(dim=1).sum())
        tw += wt.numel()
        tr += wt.shape[0]
    state_bytes = 0
    for states in tbe.split_optimizer_states():
        for s in states:
            state_bytes += s.numel() * s.element_size()
    return {"zero_weight_share_touched": zw / max(tw, 1), "zero_row_share_touched": zr / max(tr, 1),
            "nonzero_weights_touched": tw - zw, "touched_weights": tw, "touched_rows": tr,
            "weight_bytes": weight_bytes, "state_bytes": state_bytes,
            "sparse_model_bytes": weight_bytes + state_bytes}


@dataclass
class Examples:
    """``dense [n, num_dense]`` f32, ``ids [n, F]`` int64 (-1 = missing), ``labels [n]`` f32, on the
    run's device; ``missing``: whether any id is -1 (else batches skip the masking, which syncs)."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    missing: bool = True

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 16
    dense_arch: tuple = (64,)
    over_arch: tuple = (64, 32)
    dense_lr: float = 0.05          # torch.optim.Adagrad on the MLPs, as the CTR job's default
    eval_batch: int = 65536
    dense_precision: str = "fp32"   # the MLPs' and interaction's arithmetic (--dense-precision)


def train_order(n: int, batch_size: int, epochs: int, seed: int, shuffle: bool,
                device: torch.device) -> torch.Tensor:
    """The row index of every training example in step order: ``epochs`` passes, each a seeded
    permutation (``shuffle``) or ``0..n-1``, each cut to whole batches. Shared by every variant of a
    seed (the paired design).

    Raises:
        ValueError: fewer than ``batch_size`` rows.
    """
    if n < batch_size:
        raise ValueError(f"batch_size {batch_size} exceeds the {n} training rows")
    keep = n // batch_size * batch_size
    g = torch.Generator(device="cpu").manual_seed(int(seed) * 7919 + 17)
    passes = [torch.randperm(n, generator=g)[:keep] if shuffle else torch.arange(keep)
              for _ in range(epochs)]
    return torch.cat(passes).to(device)


def train(variant: Variant, examples: Examples, sizes: list[int], batch_size: int, seed: int,
          order: torch.Tensor, cfg: ModelConfig, device: torch.device) -> tuple[SparseDLRM, dict]:
    """Train ``variant`` on ``examples`` in ``order`` (row indices, a multiple of ``batch_size``) from
    the initial weights of ``seed``. Returns ``(model, {"steps", "train_s"})``."""
    tbe = build_tbe(variant, sizes, cfg.dim, batch_size, device)
    init_weights(tbe, sizes, seed, device, zero=variant.zero_init)
    torch.manual_seed(seed)
    model = SparseDLRM(tbe, len(sizes), cfg.dim, examples.dense.shape[1], list(cfg.dense_arch),
                       list(cfg.over_arch), device, cfg.dense_precision)
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=cfg.dense_lr)
    steps = order.numel() // batch_size
    model.train()
    t0 = time.perf_counter()
    for s in range(steps):
        rows = order[s * batch_size:(s + 1) * batch_size]
        logits = model(examples.dense[rows], *tbe_input(examples.ids[rows], examples.missing))
        loss = F.binary_cross_entropy_with_logits(logits, examples.labels[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, {"steps": steps, "train_s": time.perf_counter() - t0}


@torch.no_grad()
def evaluate(model: SparseDLRM, evaluation: Examples, cfg: ModelConfig) -> dict:
    """``torchrec_ftrl.job.evaluate.binary_metrics`` of ``model`` on ``evaluation``: AUC, log loss,
    NE, CTR, rows."""
    from torchrec_ftrl.job.evaluate import binary_metrics

    was = model.training
    model.eval()
    out = [model(evaluation.dense[i:i + cfg.eval_batch],
                 *tbe_input(evaluation.ids[i:i + cfg.eval_batch], evaluation.missing))
           for i in range(0, len(evaluation), cfg.eval_batch)]
    model.train(was)
    return binary_metrics(torch.cat(out), evaluation.labels)


def run(variant: Variant, examples: Examples, evaluation: Examples, sizes: list[int], batch_size: int,
        seed: int, order: torch.Tensor, cfg: ModelConfig, device: torch.device) -> dict:
    """:func:`train`, then :func:`evaluate` and :func:`sparse_model_stats` (rows touched by
    ``order``): one dict with every metric, ``steps`` and ``train_s``."""
    model, info = train(variant, examples, sizes, batch_size, seed, order, cfg, device)
    stats = sparse_model_stats(model.tbe, touched_masks(examples.ids[order], sizes))
    return {**evaluate(model, evaluation, cfg), **stats, **info}


@torch.no_grad()
def prune_to(tbe: nn.Module, touched: list[torch.Tensor], keep: int) -> int:
    """Magnitude pruning: zero every weight of the touched rows except the ``keep`` largest in
    absolute value (over all tables; ties at the threshold are kept). Returns the non-zero weights
    left in the touched rows."""
    if not _stores_weights(tbe):
        raise ValueError("prune_to: magnitude pruning writes weights; this TBE derives them from (z, n)")
    tables = [(w, m) for w, m in zip(tbe.split_embedding_weights(), touched)]
    mags = torch.cat([w[m].abs().reshape(-1) for w, m in tables])
    if keep >= int((mags > 0).sum()):
        return int((mags > 0).sum())
    thr = torch.kthvalue(mags.float().cpu(), mags.numel() - max(keep, 0)).values.item() if keep > 0 \
        else math.inf
    left = 0
    for w, m in tables:
        rows = w[m]
        rows[rows.abs() <= thr] = 0
        w[m] = rows
        left += int((rows != 0).sum())
    return left
