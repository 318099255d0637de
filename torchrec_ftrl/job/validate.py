"""The CTR job's whole configuration, checked before any process group, allocation or training.

argparse (``cli.parse_args``) checks each flag on its own; this module checks what needs several
flags, the environment or the data's first bytes, one function per concern. Each raises
:class:`~.errors.JobConfigError` naming the flag(s) and value(s), which ``train.main`` prints as one
``train_ctr: error: ...`` line with exit status 2, before anything is written.

* :data:`FLAG_CHECKS` (:func:`check_flags` runs them in order): flags and environment only;
* :func:`build_source`: the data source, with the errors of ``--data`` / ``--data-format`` /
  ``--split`` / ``--num-embeddings`` against the data's header or layout;
* :func:`check_plan`: TorchRec's planner finds a placement of the tables.

A new flag adds a function ``check_...(args)`` to :data:`FLAG_CHECKS`, or a line to
:data:`APPLIES_WHEN` when it applies to some runs only.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Sequence

from .data_kind import BINARY, SYNTHETIC, TEXT, data_kind
from .errors import JobConfigError

# The flags that apply to some runs only: flag -> (whether it applies, what it needs). A value other
# than the default where the flag does not apply is refused, never ignored.
APPLIES_WHEN: dict = {
    "--split": (lambda a: data_kind(a) != SYNTHETIC, "--data (files or a binary folder)"),
    "--max-val-rows": (lambda a: data_kind(a) != SYNTHETIC, "--data (files or a binary folder)"),
    "--data-format": (lambda a: data_kind(a) == TEXT, "--data files (not a binary folder)"),
    "--strict": (lambda a: data_kind(a) == TEXT, "--data files (not a binary folder)"),
    "--binary-dense": (lambda a: data_kind(a) == BINARY, "a binary --data folder"),
    "--synthetic-vocab": (lambda a: data_kind(a) == SYNTHETIC, "the synthetic data (no --data)"),
    "--val-batches": (lambda a: data_kind(a) == SYNTHETIC, "the synthetic data (no --data)"),
    "--checkpoint-every": (lambda a: a.checkpoint_dir is not None, "--checkpoint-dir"),
    "--keep-checkpoints": (lambda a: a.checkpoint_dir is not None, "--checkpoint-dir"),
    "--zch-eviction-interval": (lambda a: a.zch, "--zch"),
    "--sharding-types": (lambda a: not a.zch, "tables without --zch (--zch places every table "
                                              "row-wise)"),
    "--adagrad-eps": (lambda a: a.sparse_optimizer == "rowwise_adagrad",
                      "--sparse-optimizer rowwise_adagrad"),
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def check_applicable(args: argparse.Namespace) -> None:
    """A flag of :data:`APPLIES_WHEN` set to a non-default value where it does not apply."""
    from .cli import build_parser

    defaults = build_parser()
    for flag, (applies, needs) in APPLIES_WHEN.items():
        value = getattr(args, _dest(flag))
        if value != defaults.get_default(_dest(flag)) and not applies(args):
            shown = "" if value is True else f" {value}"
            raise JobConfigError(f"{flag}{shown} does not apply to this run: it needs {needs}")


def check_numbers(args: argparse.Namespace) -> None:
    """Counts and rates that argparse takes as plain ints / floats."""
    if not (math.isfinite(args.dense_lr) and args.dense_lr > 0):
        raise JobConfigError(f"--dense-lr must be a finite number > 0, got {args.dense_lr!r}")
    if args.epochs is not None and not math.isfinite(args.epochs):
        raise JobConfigError(f"--epochs must be a finite number > 0, got {args.epochs!r}")
    for flag in ("--synthetic-vocab", "--keep-checkpoints"):
        if getattr(args, _dest(flag)) < 1:
            raise JobConfigError(f"{flag} must be >= 1, got {getattr(args, _dest(flag))}")
    if args.max_val_rows is not None and args.max_val_rows < 1:
        raise JobConfigError(f"--max-val-rows must be >= 1, got {args.max_val_rows} (--split none "
                             f"validates nothing)")
    if args.seed < 0:
        raise JobConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.cpu_threads < 0:
        raise JobConfigError(f"--cpu-threads must be >= 0, got {args.cpu_threads}")
    for flag in ("--dense-arch", "--over-arch"):
        sizes = getattr(args, f"{_dest(flag)}_list")
        if any(n < 1 for n in sizes):
            raise JobConfigError(f"{flag} sizes must be >= 1, got {getattr(args, _dest(flag))!r}")


def check_sharding_types(args: argparse.Namespace) -> None:
    """``--sharding-types``: TorchRec ``ShardingType`` values other than data_parallel."""
    from torchrec.distributed.types import ShardingType

    allowed = [t.value for t in ShardingType if t != ShardingType.DATA_PARALLEL]
    given = args.sharding_types.split(",")
    bad = [t for t in given if t not in allowed]
    if bad or not given:
        raise JobConfigError(f"--sharding-types {args.sharding_types!r}: {', '.join(map(repr, bad))} "
                             f"not among {', '.join(allowed)} (data_parallel is never offered: FTRL "
                             f"tables must be fused)")


def check_device(args: argparse.Namespace) -> None:
    """``--device cuda`` needs a CUDA device."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise JobConfigError("--device cuda: no CUDA device (torch.cuda.is_available() is False; "
                             "torch " + torch.__version__ + ")")


def check_dense_precision(args: argparse.Namespace) -> None:
    """``--dense-precision`` (resolved by ``cli.parse_args``) on the run's device: tf32 needs CUDA,
    bf16 on CUDA needs bf16 support on this rank's GPU (``LOCAL_RANK``). A value given on the command
    line that the device cannot run is refused; without one, ``args.dense_precision`` becomes the
    device's default (``dense_precision.resolve_on_device``: fp32 on a GPU without native bf16),
    which the start line and the summary report. ``--plan-only`` plans for GPUs without one and
    computes nothing dense: any value passes."""
    from .cli import cuda_run
    from .dense_precision import resolve_on_device, unsupported_reason

    if args.plan_only:
        return

    device = f"cuda:{os.environ.get('LOCAL_RANK') or 0}" if cuda_run(args.device) else "cpu"
    if not getattr(args, "dense_precision_given", True):
        args.dense_precision = resolve_on_device(None, device)
    reason = unsupported_reason(args.dense_precision, device)
    if reason is not None:
        raise JobConfigError(reason)


def check_split(args: argparse.Namespace) -> None:
    """``--split`` parses (also when it does not apply, so a typo is never silent)."""
    from torchrec_ftrl.data import Split

    try:
        Split.parse(args.split)
    except ValueError as e:
        raise JobConfigError(f"--split {args.split}: {e}") from None


def check_data_format(args: argparse.Namespace) -> None:
    """``--data-format`` is a preset or a valid JSON column spec (also when it does not apply)."""
    from torchrec_ftrl.data import get_spec
    from torchrec_ftrl.data.spec import PRESETS

    try:
        get_spec(args.data_format)
    except ValueError as e:
        raise JobConfigError(f"--data-format {args.data_format}: {e} (presets: "
                             f"{', '.join(sorted(PRESETS))})") from None


def _first_missing_parent(path: str) -> str:
    """The deepest existing folder above (or at) ``path``."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_writable_dir(flag: str, path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise JobConfigError(f"{flag} {path!r} exists and is not a folder")
    base = _first_missing_parent(path)
    if not os.path.isdir(base):
        raise JobConfigError(f"{flag} {path!r}: {base!r} is not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise JobConfigError(f"{flag} {path!r}: {base!r} is not writable")


def check_outputs(args: argparse.Namespace) -> None:
    """``--output-dir`` and ``--checkpoint-dir`` are (or can be made) writable folders, and
    ``--run-name`` is a plain file name, so no result is lost at the end of a run."""
    if not args.run_name or os.sep in args.run_name or args.run_name in (".", ".."):
        raise JobConfigError(f"--run-name must be a plain file name, got {args.run_name!r}")
    _check_writable_dir("--output-dir", args.output_dir)
    if args.checkpoint_dir is not None:
        _check_writable_dir("--checkpoint-dir", args.checkpoint_dir)


FLAG_CHECKS: Sequence[Callable[[argparse.Namespace], None]] = (
    check_numbers, check_split, check_data_format, check_applicable, check_sharding_types,
    check_device, check_dense_precision, check_outputs)


def check_flags(args: argparse.Namespace) -> None:
    """Run :data:`FLAG_CHECKS` in order. Raises: JobConfigError (the first problem)."""
    for check in FLAG_CHECKS:
        check(args)


def build_source(args: argparse.Namespace):
    """``source.make_source(args)``, with the configuration errors it finds as
    :class:`JobConfigError` naming the flags: a ``--num-embeddings`` list whose length is not the
    number of categorical columns, a ``--data-format`` whose columns are not in the file's header.
    Missing files and malformed data keep their own errors (``main`` prints them as one line).

    Returns ``(source, description dict)``.
    """
    from torchrec_ftrl.data import MalformedRowError, NoUsableRowsError, get_spec
    from .source import make_source

    ne = args.num_embeddings_list
    kind = data_kind(args)
    columns = get_spec(args.data_format).num_categorical
    if kind == TEXT and len(ne) > 1 and len(ne) != columns:
        raise JobConfigError(f"--num-embeddings {args.num_embeddings} has {len(ne)} entries but "
                             f"--data-format {args.data_format} has {columns} categorical columns "
                             f"(give one size, or one per column)")
    try:
        return make_source(args)
    except (FileNotFoundError, MalformedRowError, NoUsableRowsError, JobConfigError):
        raise
    except ValueError as e:
        flags = {SYNTHETIC: f"--num-embeddings {args.num_embeddings}",
                 BINARY: f"--data {args.data[0]} with --num-embeddings {args.num_embeddings}",
                 TEXT: f"--data-format {args.data_format} with --data {' '.join(args.data or ())}"}[kind]
        raise JobConfigError(f"{flags}: {e}") from None


def check_plan(args: argparse.Namespace, source, fused_params: dict, world_size: int,
               local_world_size: int, device_type: str) -> None:
    """TorchRec's planner (the job's: ``model.make_planner``, with the memory ``model.shard`` plans
    for) finds a placement of the job's tables on ``world_size`` ranks of ``device_type``; the model
    is built on the meta device and nothing is allocated. Tables that do not fit the memory get
    :func:`.plan_only.no_fit_message` when their own bytes exceed that memory. ``--zch`` tables are
    placed row-wise without the planner and are not checked here.

    Raises:
        JobConfigError: a ``PlannerError``, with its first line and the flags that size the tables.
    """
    if args.zch:
        return
    import torch
    import torchrec_ftrl
    from torchrec.distributed.planner.types import PlannerError
    from . import model as model_lib

    features = source.categorical_names
    net = model_lib.build_dlrm(features, source.num_embeddings, args.embedding_dim,
                              len(source.dense_names), args.dense_arch_list, args.over_arch_list,
                              torch.device("meta"))
    hbm, ddr = model_lib.device_memory_bytes(torch.device(device_type), args.hbm_gib, args.host_gib,
                                             local_world_size)
    planner = model_lib.make_planner([f"t_{f}" for f in features], args.sharding_types.split(","),
                                     device_type, world_size, local_world_size, args.batch_size, hbm, ddr)
    try:
        planner.plan(net, torchrec_ftrl.sharders(fused_params))
    except PlannerError as e:
        from .plan_only import no_fit_message, table_bytes
        rows = list(source.num_embeddings)
        weights, states = table_bytes(args, rows)
        if sum(weights) + sum(states) > world_size * ((hbm or 0) + (ddr or 0)):   # the tables alone
            raise JobConfigError(no_fit_message(args, rows, world_size, hbm, ddr)) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JobConfigError(
            f"TorchRec's planner found no placement of the {len(features)} tables on {world_size} "
            f"{device_type} rank(s) for --batch-size {args.batch_size}, --num-embeddings "
            f"{args.num_embeddings}, --embedding-dim {args.embedding_dim}, --sharding-types "
            f"{args.sharding_types}: {first}") from None
