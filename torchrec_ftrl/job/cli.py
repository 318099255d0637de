"""Command-line flags of the CTR job and the mapping of sparse-optimizer flags to ``fused_params``."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional, Sequence

from . import dense_precision, presets
from .errors import PROG, JobConfigError, exit_with_error
from .pipeline import PIPELINES

SPARSE_OPTIMIZERS = ("ftrl", "rowwise_adagrad")
FTRL_REG_SCALES = ("per_example", "raw")
FTRL_STATE_DTYPES = ("fp32", "bf16")
# --compile-dense values: "on" is torch.compile's default mode.
COMPILE_DENSE = ("auto", "on", "off")
# --dense-cuda-graphs values (resolve_dense_cuda_graphs).
DENSE_CUDA_GRAPHS = ("auto", "on", "off")
# --compile-dense auto on CUDA: this mode at this per-rank batch and above, eager below
# (docs/main-job.md); on the CPU it is off.
CUDA_AUTO_COMPILE_MODE = "default"
COMPILE_DENSE_MIN_CUDA_BATCH = 32_768
# Per-example FTRL defaults of the job (scaled by the global batch size, see sparse_fused_params).
DEFAULT_FTRL_L1 = 0.1
DEFAULT_FTRL_L2 = 0.0
DEFAULT_FTRL_BETA = 1.0
# The smallest and largest fp32 normal magnitudes; FTRLHyperparams refuses non-zero knobs outside them.
_FP32_MIN_NORMAL = 1.1754943508222875e-38
_FP32_MAX = 3.4028234663852886e38


class _OneLineParser(argparse.ArgumentParser):
    """argparse with the job's error form: one line ``train_ctr: error: ...``, exit status 2."""

    def error(self, message: str):  # argparse's hook for every flag error
        exit_with_error(message)


def _non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (argparse names the flag and the value when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The job's flags: the groups data, model, optimization and run, then the preset flags."""
    p = _OneLineParser(
        prog=PROG,
        description="DLRM CTR model whose embedding tables are trained with a fused sparse optimizer "
                    "(FTRL-Proximal by default), sharded with DistributedModelParallel.")
    _add_data_flags(p)
    _add_model_flags(p)
    _add_optimization_flags(p)
    _add_run_flags(p)
    presets.add_flags(p)
    return p


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """The "data" group: what is read (files, a binary folder or the synthetic generator) and how."""
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="delimited CTR log file(s), or one folder in TorchRec's binary Criteo layout "
                        "(PREFIX_dense.npy / PREFIX_sparse.npy / PREFIX_labels.npy triplets, e.g. from "
                        "python -m torchrec_ftrl.data.preprocess), or its materialised multi-hot "
                        "layout (PREFIX_sparse_multi_hot.npz in place of PREFIX_sparse.npy, from the "
                        "DLRM example's materialize_synthetic_multihot_dataset.py); default: the "
                        "embedded synthetic Criteo-like generator")
    d.add_argument("--binary-dense", choices=("text", "stored"), default="text",
                   help="binary folder: 'text' feeds log(1 + max(x, 0)) of the integer features, as "
                        "for text files; 'stored' feeds TorchRec's stored log(x - min + 2) unchanged")
    d.add_argument("--data-format", default="criteo",
                   help="'criteo' (raw TSV), 'avazu' (raw CSV) or a JSON column spec (inline or a .json "
                        "file) with keys label, dense, categorical, delimiter, header, ...")
    d.add_argument("--split", default="every:10",
                   help="train/validation split of file data: every:K (every K-th row), tail:F (last "
                        "fraction F) or none")
    d.add_argument("--max-val-rows", type=int, default=None, help="cap on validation rows (file data)")
    d.add_argument("--strict", action="store_true",
                   help="stop at the first malformed row (file and line) instead of skipping it")
    d.add_argument("--num-embeddings", default="10000",
                   help="rows per table: one int, or a comma list with one entry per categorical column")
    d.add_argument("--synthetic-vocab", type=int, default=2000, help="distinct values per synthetic feature")
    d.add_argument("--val-batches", type=int, default=8, help="validation batches per rank (synthetic)")
    d.add_argument("--zch", action="store_true",
                   help="managed collision (zero-collision hashing): features keep their raw ids "
                        "(Criteo's hex values as they are, other strings hashed to 62 bits; no "
                        "vocabulary, no modulo) and each table is a ZCH table of --num-embeddings "
                        "slots (TorchRec's MCHManagedCollisionModule, DistanceLFU eviction), sharded "
                        "row-wise (--sharding-types does not apply)")
    d.add_argument("--zch-eviction-interval", type=int, default=1,
                   help="--zch: training forwards between eviction passes")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The "model" group: embedding width, MLP sizes and the sharding types offered to the planner."""
    m = p.add_argument_group("model")
    m.add_argument("--embedding-dim", type=int, default=16)
    m.add_argument("--dense-arch", default="64", help="bottom MLP hidden sizes (embedding_dim is appended)")
    m.add_argument("--over-arch", default="64,32", help="top MLP hidden sizes (1 is appended)")
    m.add_argument("--sharding-types", default="table_wise,column_wise,table_column_wise,row_wise,table_row_wise",
                   help="sharding types the planner may use (data_parallel is never offered: FTRL "
                        "tables must be fused)")


def _add_optimization_flags(p: argparse.ArgumentParser) -> None:
    """The "optimization" group: steps, batch size, the sparse and dense optimizers and the seed."""
    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=200, help="training steps (each rank one batch per step)")
    o.add_argument("--epochs", type=float, default=None,
                   help="file data: train this many passes instead of --steps")
    o.add_argument("--batch-size", type=int, default=256, help="per-rank batch size")
    o.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default="ftrl")
    o.add_argument("--sparse-lr", type=float, default=None,
                   help="fused learning_rate (default 0.05 for ftrl, 0.05 for rowwise_adagrad); ftrl with "
                        "--ftrl-reg-scale per_example: learning_rate = LR * S^(1 + 2 * lr_power), "
                        "which is LR itself for the default lr_power -0.5")
    o.add_argument("--ftrl-reg-scale", choices=FTRL_REG_SCALES, default="per_example",
                   help="per_example (default): --ftrl-l1/-l2/-l2-shrinkage/-beta/-initial-accumulator "
                        "are per-example values and the job scales them by S, the number of examples "
                        "whose gradients each embedding-row gradient averages (the global batch: "
                        "--batch-size x world size, as TorchRec divides sharded gradients by the world "
                        "size): ftrl_l1_reg = L1 / S, ftrl_l2_reg = L2 / S, ftrl_l2_shrinkage = "
                        "SHRINK / S, ftrl_beta = BETA * S^(2 * lr_power), "
                        "ftrl_initial_accumulator_value = ACC / S^2; the updates are then those of FTRL "
                        "with the flag values on the gradient of the batch-sum loss, whatever the batch "
                        "size. raw: the flags are passed to fused_params unchanged (they act on "
                        "gradients of the batch-mean loss)")
    o.add_argument("--ftrl-l1", type=float, default=DEFAULT_FTRL_L1,
                   help=f"L1 strength per example (ftrl_l1_reg = L1 / S; see --ftrl-reg-scale); "
                        f"default {DEFAULT_FTRL_L1}")
    o.add_argument("--ftrl-l2", type=float, default=DEFAULT_FTRL_L2,
                   help=f"L2 strength per example (ftrl_l2_reg = L2 / S); default {DEFAULT_FTRL_L2}")
    o.add_argument("--ftrl-beta", type=float, default=DEFAULT_FTRL_BETA,
                   help=f"beta per example (ftrl_beta = BETA * S^(2 * lr_power), BETA / S for lr_power "
                        f"-0.5); default {DEFAULT_FTRL_BETA}")
    o.add_argument("--ftrl-lr-power", type=float, default=-0.5, help="ftrl_learning_rate_power (<= 0)")
    o.add_argument("--ftrl-l2-shrinkage", type=float, default=0.0,
                   help="l2 shrinkage per example (ftrl_l2_shrinkage = SHRINK / S)")
    o.add_argument("--ftrl-initial-accumulator", type=float, default=0.0,
                   help="initial accumulator per example (ftrl_initial_accumulator_value = ACC / S^2)")
    o.add_argument("--ftrl-l2-convention", choices=("tensorflow", "mcmahan"), default="tensorflow")
    o.add_argument("--ftrl-state-dtype", choices=FTRL_STATE_DTYPES, default="fp32",
                   help="storage dtype of FTRL's accum and linear: fp32 (default) or bf16 (half the "
                        "state bytes; fp32 math, stochastic rounding); fused_params "
                        "optimizer_state_dtypes. Stored with checkpoints: --resume refuses another one")
    o.add_argument("--adagrad-eps", type=float, default=1e-8, help="eps of row-wise Adagrad")
    o.add_argument("--dense-optimizer", choices=("adagrad", "adam", "sgd"), default="adagrad")
    o.add_argument("--dense-lr", type=float, default=0.05)
    dense_precision.add_flag(o)
    o.add_argument("--seed", type=int, default=0)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The "run" group: device, evaluation, logging, checkpoints, outputs, data workers, pipeline
    and profiling."""
    r = p.add_argument_group("run")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: one GPU per process (NCCL) when CUDA is present, else CPU (gloo)")
    r.add_argument("--eval-every", type=int, default=50, help="validate every N steps (and at the end)")
    r.add_argument("--log-every", type=int, default=10, help="record the cross-rank mean loss every N steps")
    r.add_argument("--checkpoint-dir", default=None, help="DCP checkpoints go here (step_XXXXXXXX/)")
    r.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end)")
    r.add_argument("--keep-checkpoints", type=int, default=2, help="keep the newest N checkpoints")
    r.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --checkpoint-dir, or from a given step dir")
    r.add_argument("--output-dir", default="outputs", help="summary JSON and PNG go here")
    r.add_argument("--run-name", default="train_ctr", help="file name stem of the outputs")
    r.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    r.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads per process on CPU (1 avoids oversubscription when "
                        "several ranks share few cores)")
    r.add_argument("--compile-dense", nargs="?", const="on", default="auto", choices=COMPILE_DENSE,
                   help="torch.compile the training dense part (bottom MLP, interaction, top MLP) as one "
                        "graph, compiled before the first step; parameter and checkpoint names stay the "
                        "same, and results match the eager model to float32 rounding, not bitwise. on "
                        "(the bare flag): inductor's fused kernels; auto: "
                        f"{CUDA_AUTO_COMPILE_MODE} for a CUDA run of --batch-size "
                        f">= {COMPILE_DENSE_MIN_CUDA_BATCH:,}, else off")
    r.add_argument("--dense-cuda-graphs", default="auto", choices=DENSE_CUDA_GRAPHS,
                   help="capture the training dense part (eager, or compiled by --compile-dense) as "
                        "CUDA graphs (torch.cuda.make_graphed_callables) before the first step: one "
                        "host call a direction instead of one a kernel; a batch of another size runs "
                        "without them. CUDA and one rank only; auto: on for a one-rank CUDA run of "
                        f"--batch-size < {COMPILE_DENSE_MIN_CUDA_BATCH:,}")
    r.add_argument("--data-workers", default="auto", metavar="N",
                   help="DataLoader worker processes per rank that read, parse and assemble the "
                        "training batches off the training thread (0: on it; a text --data uses one); "
                        "auto: min(4, CPUs per rank - 1). The batches and their order do not depend "
                        "on N")
    r.add_argument("--pipeline", choices=PIPELINES, default="sparse_dist",
                   help="sparse_dist: TorchRec's TrainPipelineSparseDist (batch i+1's input all-to-all "
                        "and batch i+2's copy overlap batch i's compute); none: one batch at a time")
    r.add_argument("--profile-steps", type=_non_negative_int, default=0, metavar="K",
                   help="record K training steps with torch.profiler after a few warm-up steps: "
                        "per-phase host/device ms in the summary JSON ('step_profile') and a chrome "
                        "trace <output-dir>/<run-name>_trace.json (0: off)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check flags.

    Raises:
        SystemExit: (argparse) with a message naming the bad flag and value.
    """
    p = build_parser()
    a = p.parse_args(argv)
    presets.apply_preset(a, presets.explicit_dests(build_parser, argv))
    for name in ("steps", "batch_size", "embedding_dim", "eval_every", "log_every", "val_batches",
                 "zch_eviction_interval"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.data_workers != "auto":
        try:
            a.data_workers = int(a.data_workers)
        except ValueError:
            p.error(f"--data-workers must be an integer >= 0 or auto, got {a.data_workers!r}")
        if a.data_workers < 0:
            p.error(f"--data-workers must be an integer >= 0 or auto, got {a.data_workers}")
    if a.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {a.checkpoint_every}")
    if a.resume is not None and a.checkpoint_dir is None and a.resume == "latest":
        p.error("--resume without a path needs --checkpoint-dir")
    if a.data is not None and len(a.data) > 1 and any(os.path.isdir(x) for x in a.data):
        p.error(f"--data takes one binary folder or one or more files, got {a.data}")
    if a.epochs is not None and (a.data is None or a.epochs <= 0):
        p.error(f"--epochs needs --data and a value > 0, got {a.epochs}")
    if a.embedding_dim % 4:
        p.error(f"--embedding-dim must be a multiple of 4 (TBE rows), got {a.embedding_dim}")
    for flag in ("--num-embeddings", "--dense-arch", "--over-arch"):
        text = getattr(a, flag[2:].replace("-", "_"))
        try:
            setattr(a, f"{flag[2:].replace('-', '_')}_list", [int(x) for x in text.split(",") if x])
        except ValueError:
            p.error(f"{flag} must be a comma list of integers, got {text!r}")
    if not a.num_embeddings_list or any(n < 1 for n in a.num_embeddings_list):
        p.error(f"--num-embeddings entries must be >= 1, got {a.num_embeddings!r}")
    if a.sparse_lr is None:
        a.sparse_lr = 0.05
    a.dense_precision_given = a.dense_precision is not None
    a.dense_precision = dense_precision.resolve(a.dense_precision, "cuda" if cuda_run(a.device) else "cpu")
    a.compile_dense = resolve_compile_dense(a.compile_dense, cuda_run(a.device), a.batch_size)
    if a.dense_cuda_graphs == "on" and not cuda_run(a.device):
        p.error("--dense-cuda-graphs on needs a CUDA device (it captures CUDA graphs); this run is "
                "on the CPU: use off or auto")
    if a.zch and a.sparse_optimizer == "rowwise_adagrad" and not cuda_run(a.device):
        p.error("--zch with --sparse-optimizer rowwise_adagrad needs --device cuda: FBGEMM resets "
                "evicted rows with a CUDA-only op (fbgemm::reset_weight_momentum)")
    _check_optimizer_flags(p, a)
    presets.check(p, a)
    return a


def resolve_compile_dense(value: str, cuda: bool, batch_size: int) -> Optional[str]:
    """The ``torch.compile`` mode of the run's dense part (``job.model.COMPILE_MODES``), or None for
    eager: ``value`` ``"on"``: ``"default"``; ``"off"``: None;
    ``"auto"``: :data:`CUDA_AUTO_COMPILE_MODE` for a CUDA run (``cuda``) whose per-rank
    ``batch_size`` is at least :data:`COMPILE_DENSE_MIN_CUDA_BATCH`, else None."""
    if value == "auto":
        return CUDA_AUTO_COMPILE_MODE if cuda and batch_size >= COMPILE_DENSE_MIN_CUDA_BATCH else None
    return {"on": "default", "off": None}[value]


def resolve_dense_cuda_graphs(value: str, device_type: str, world_size: int, batch_size: int) -> bool:
    """Whether the run captures its dense part as CUDA graphs (``--dense-cuda-graphs``, after
    :func:`parse_args` refused ``on`` off CUDA): ``"on"`` yes, ``"off"`` no, ``"auto"`` for a CUDA
    run (``device_type``) of one rank whose per-rank ``batch_size`` is below
    :data:`COMPILE_DENSE_MIN_CUDA_BATCH`, where the step waits on the host (docs/main-job.md).

    Raises:
        JobConfigError: ``"on"`` with ``world_size > 1``: the graphs' gradients are not verified
            under DDP's gradient hooks, which wrap the dense part of a run of several ranks.
    """
    if value == "on" and world_size > 1:
        raise JobConfigError(f"--dense-cuda-graphs on runs on one rank; this run has {world_size} "
                             "(DDP wraps the dense part there): use off or auto")
    if value == "auto":
        return device_type == "cuda" and world_size == 1 and batch_size < COMPILE_DENSE_MIN_CUDA_BATCH
    return value == "on"


def compile_words(mode: Optional[str], cuda_graphs: bool = False) -> str:
    """Words for the start line and reports after the precision: ``""`` for an eager dense part
    (None), ``" compiled"`` for a compiled one (its one mode, ``"default"``), then ``" in CUDA
    graphs"`` where ``cuda_graphs``."""
    return (" compiled" if mode else "") + (" in CUDA graphs" if cuda_graphs else "")


def cuda_run(device: str) -> bool:
    """Whether ``--device`` puts the run on CUDA (``auto``: when CUDA is present)."""
    import torch
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _check_optimizer_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Sign and range checks of the sparse-optimizer flags (argparse errors naming flag and value)."""
    def bad(flag: str, value: float, rule: str) -> None:
        p.error(f"{flag} must be {rule}, got {value!r}")

    if not (math.isfinite(a.sparse_lr) and a.sparse_lr > 0):
        bad("--sparse-lr", a.sparse_lr, "a finite number > 0")
    for flag in ("--ftrl-l1", "--ftrl-l2", "--ftrl-beta", "--ftrl-l2-shrinkage",
                 "--ftrl-initial-accumulator", "--adagrad-eps"):
        v = getattr(a, flag[2:].replace("-", "_"))
        if not (math.isfinite(v) and v >= 0):
            bad(flag, v, "a finite number >= 0")
    if not (math.isfinite(a.ftrl_lr_power) and a.ftrl_lr_power <= 0):
        bad("--ftrl-lr-power", a.ftrl_lr_power, "a finite number <= 0")
    if a.sparse_optimizer != "ftrl":
        if a.ftrl_state_dtype != "fp32":
            p.error(f"--ftrl-state-dtype {a.ftrl_state_dtype} needs --sparse-optimizer ftrl, got "
                    f"--sparse-optimizer {a.sparse_optimizer}")
        return
    # Every kernel computes in fp32: a scaled knob must stay a normal fp32 magnitude.
    knobs = ftrl_fused_knobs(a)
    where = ("" if a.ftrl_reg_scale == "raw"
             else f" (scaled for {examples_per_row_gradient(a.batch_size)} examples per row gradient)")
    for flag, key in _FLAG_OF_KNOB:
        given, v = getattr(a, flag[2:].replace('-', '_')), knobs[key]
        # A knob set to 0 stays 0; any other value must scale to a normal fp32 magnitude (not 0).
        if given != 0 and not (_FP32_MIN_NORMAL <= abs(v) <= _FP32_MAX):
            p.error(f"{flag} {given!r} gives {key} = {v!r}{where}, outside fp32's normal range")


_FLAG_OF_KNOB = (("--sparse-lr", "learning_rate"), ("--ftrl-l1", "ftrl_l1_reg"),
                 ("--ftrl-l2", "ftrl_l2_reg"), ("--ftrl-beta", "ftrl_beta"),
                 ("--ftrl-l2-shrinkage", "ftrl_l2_shrinkage"),
                 ("--ftrl-initial-accumulator", "ftrl_initial_accumulator_value"))


def examples_per_row_gradient(batch_size: int, world_size: Optional[int] = None) -> int:
    """``S``, the number of examples whose per-example gradients an embedding row's gradient averages.

    The loss is each rank's batch mean, and TorchRec's sharded embedding collectives divide the
    gradients they return by the world size (``torchrec.distributed.comm_ops.get_gradient_division()``,
    True by default), so a row's gradient is ``(1 / S) * sum`` of per-example gradients over the global
    batch with ``S = batch_size * world_size`` (``batch_size`` alone when gradient division is off).
    ``world_size`` defaults to the ``WORLD_SIZE`` environment variable (torchrun / torchx), else 1.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1:
        try:
            from torchrec.distributed.comm_ops import get_gradient_division
        except ImportError:  # pragma: no cover - torchrec is a dependency of the job
            def get_gradient_division() -> bool:
                return True
        if not get_gradient_division():
            world_size = 1
    return batch_size * world_size


def ftrl_fused_knobs(args: argparse.Namespace, world_size: Optional[int] = None) -> dict[str, float]:
    """The FTRL knobs that go into ``fused_params``, from the flags.

    ``--ftrl-reg-scale per_example`` (the default): with ``S = examples_per_row_gradient(...)`` and
    ``p = --ftrl-lr-power``::

        learning_rate                  = sparse_lr * S ** (1 + 2 p)   (= sparse_lr for p = -0.5)
        ftrl_l1_reg                    = ftrl_l1 / S
        ftrl_l2_reg                    = ftrl_l2 / S                  (either l2 convention)
        ftrl_l2_shrinkage              = ftrl_l2_shrinkage / S
        ftrl_beta                      = ftrl_beta * S ** (2 p)       (= ftrl_beta / S for p = -0.5)
        ftrl_initial_accumulator_value = ftrl_initial_accumulator / S ** 2

    The row gradient the kernel sees is ``g / S`` with ``g`` the per-example gradients summed, and
    under this scaling FTRL's state is ``z / S``, ``n / S**2`` and its weights are exactly those of
    FTRL with the flag values fed ``g``: the flags mean the same at every batch size. ``raw``: the
    flag values unchanged.
    """
    if args.ftrl_reg_scale == "raw":
        s, lr_s, beta_s = 1.0, 1.0, 1.0
    else:
        s = float(examples_per_row_gradient(args.batch_size, world_size))
        p = args.ftrl_lr_power
        lr_s, beta_s = s ** (1.0 + 2.0 * p), s ** (2.0 * p)
    return {
        "learning_rate": args.sparse_lr * lr_s,
        "ftrl_l1_reg": args.ftrl_l1 / s,
        "ftrl_l2_reg": args.ftrl_l2 / s,
        "ftrl_beta": args.ftrl_beta * beta_s,
        "ftrl_l2_shrinkage": args.ftrl_l2_shrinkage / s,
        "ftrl_initial_accumulator_value": args.ftrl_initial_accumulator / (s * s),
    }


def sparse_fused_params(args: argparse.Namespace, world_size: Optional[int] = None) -> dict[str, Any]:
    """``fused_params`` for the sharders: optimizer, learning_rate and the optimizer's knobs.

    FTRL's knobs come from ``ftrl_fused_knobs(args, world_size)``: by default the flags are
    per-example values scaled by the global batch size ``S`` (``ftrl_l1_reg = --ftrl-l1 / S``, ...;
    see there). Row-wise Adagrad takes ``--sparse-lr`` and ``--adagrad-eps`` unchanged.

    FTRL: ``{"optimizer": EmbOptimType.FTRL, "learning_rate", "ftrl_l1_reg", "ftrl_l2_reg",
    "ftrl_beta", "ftrl_learning_rate_power", "ftrl_l2_shrinkage", "ftrl_initial_accumulator_value",
    "ftrl_l2_convention"}``, and with ``--ftrl-state-dtype bf16`` ``"optimizer_state_dtypes":
    frozenset({("accum", SparseType.BF16.as_int()), ("linear", SparseType.BF16.as_int())})`` (the
    hashable form TorchRec's table grouping needs; fp32 adds no key); row-wise Adagrad: ``{"optimizer": EXACT_ROWWISE_ADAGRAD,
    "learning_rate", "eps"}``.

    Raises:
        RuntimeError: ``ftrl`` asked for but ``EmbOptimType.FTRL`` is not registered (the
            torchrec_ftrl integration is missing).
    """
    import torchrec_ftrl  # noqa: F401  (registers EmbOptimType.FTRL when the integration is present)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if args.sparse_optimizer == "rowwise_adagrad":
        return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.sparse_lr,
                "eps": args.adagrad_eps}
    ftrl = getattr(EmbOptimType, "FTRL", None)
    if ftrl is None:
        raise RuntimeError("EmbOptimType.FTRL is not registered after `import torchrec_ftrl` (the "
                           "TorchRec integration is missing); use --sparse-optimizer rowwise_adagrad")
    fused = {"optimizer": ftrl, **ftrl_fused_knobs(args, world_size),
             "ftrl_learning_rate_power": args.ftrl_lr_power,
             "ftrl_l2_convention": args.ftrl_l2_convention}
    from .layout_flags import fused_layout_params
    fused.update(fused_layout_params(args))
    state = getattr(args, "ftrl_state_dtype", "fp32")
    if state != "fp32":
        from torchrec_ftrl.state_dtype import hashable_state_dtypes
        fused["optimizer_state_dtypes"] = hashable_state_dtypes({"accum": state, "linear": state},
                                                                "--ftrl-state-dtype")
    return fused


def data_workers(flag, local_world_size: int) -> int:
    """``--data-workers``: the number given, or for ``auto`` ``min(4, CPUs per rank - 1)`` (0 when the
    ranks of a host have fewer than 2 CPUs each; CPUs: this process's affinity set)."""
    if flag != "auto":
        return int(flag)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(4, cpus // max(local_world_size, 1) - 1))
