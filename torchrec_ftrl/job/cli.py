"""Command-line flags of the CTR job and the mapping of sparse-optimizer flags to ``fused_params``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

SPARSE_OPTIMIZERS = ("ftrl", "rowwise_adagrad")


def _prog() -> str:
    """argparse's program name: the script's (``train_ctr.py``), also under ``python -m
    torchrec_ftrl.job`` (argv[0] ``.../__main__.py``), so usage and error lines read as they always
    have whichever way the job was started."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "train_ctr.py" if name in ("", "__main__.py", "-c") else name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="DLRM CTR model whose embedding tables are trained with a fused sparse optimizer "
                    "(FTRL-Proximal by default), sharded with DistributedModelParallel.")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="delimited CTR log file(s), or one folder in TorchRec's binary Criteo layout "
                        "(PREFIX_dense.npy / PREFIX_sparse.npy / PREFIX_labels.npy triplets, e.g. from "
                        "python -m torchrec_ftrl.data.preprocess); default: the embedded synthetic "
                        "Criteo-like generator")
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

    m = p.add_argument_group("model")
    m.add_argument("--embedding-dim", type=int, default=16)
    m.add_argument("--dense-arch", default="64", help="bottom MLP hidden sizes (embedding_dim is appended)")
    m.add_argument("--over-arch", default="64,32", help="top MLP hidden sizes (1 is appended)")
    m.add_argument("--sharding-types", default="table_wise,column_wise,table_column_wise,row_wise,table_row_wise",
                   help="sharding types the planner may use (data_parallel is never offered: FTRL "
                        "tables must be fused)")

    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=200, help="training steps (each rank one batch per step)")
    o.add_argument("--epochs", type=float, default=None,
                   help="file data: train this many passes instead of --steps")
    o.add_argument("--batch-size", type=int, default=256, help="per-rank batch size")
    o.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS, default="ftrl")
    o.add_argument("--sparse-lr", type=float, default=None,
                   help="fused learning_rate (default 0.05 for ftrl, 0.05 for rowwise_adagrad)")
    o.add_argument("--ftrl-l1", type=float, default=0.001,
                   help="ftrl_l1_reg (lambda1; gradients are of the batch-mean loss, so ~1/batch-size of a per-example L1)")
    o.add_argument("--ftrl-l2", type=float, default=0.0, help="ftrl_l2_reg (lambda2)")
    o.add_argument("--ftrl-beta", type=float, default=1.0, help="ftrl_beta")
    o.add_argument("--ftrl-lr-power", type=float, default=-0.5, help="ftrl_learning_rate_power")
    o.add_argument("--ftrl-l2-shrinkage", type=float, default=0.0, help="ftrl_l2_shrinkage")
    o.add_argument("--ftrl-initial-accumulator", type=float, default=0.0,
                   help="ftrl_initial_accumulator_value")
    o.add_argument("--ftrl-l2-convention", choices=("tensorflow", "mcmahan"), default="tensorflow")
    o.add_argument("--adagrad-eps", type=float, default=1e-8, help="eps of row-wise Adagrad")
    o.add_argument("--dense-optimizer", choices=("adagrad", "adam", "sgd"), default="adagrad")
    o.add_argument("--dense-lr", type=float, default=0.05)
    o.add_argument("--seed", type=int, default=0)

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
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check flags.

    Raises:
        SystemExit: (argparse) with a message naming the bad flag and value.
    """
    p = build_parser()
    a = p.parse_args(argv)
    for name in ("steps", "batch_size", "embedding_dim", "eval_every", "log_every", "val_batches"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
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
    try:
        a.num_embeddings_list = [int(x) for x in a.num_embeddings.split(",")]
        a.dense_arch_list = [int(x) for x in a.dense_arch.split(",") if x]
        a.over_arch_list = [int(x) for x in a.over_arch.split(",") if x]
    except ValueError as e:
        p.error(f"bad integer list: {e}")
    if any(n < 1 for n in a.num_embeddings_list):
        p.error(f"--num-embeddings entries must be >= 1, got {a.num_embeddings}")
    if a.sparse_lr is None:
        a.sparse_lr = 0.05
    return a


def sparse_fused_params(args: argparse.Namespace) -> dict[str, Any]:
    """``fused_params`` for the sharders: optimizer, learning_rate and the optimizer's knobs.

    FTRL: ``{"optimizer": EmbOptimType.FTRL, "learning_rate", "ftrl_l1_reg", "ftrl_l2_reg",
    "ftrl_beta", "ftrl_learning_rate_power", "ftrl_l2_shrinkage", "ftrl_initial_accumulator_value",
    "ftrl_l2_convention"}``; row-wise Adagrad: ``{"optimizer": EXACT_ROWWISE_ADAGRAD,
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
    return {
        "optimizer": ftrl,
        "learning_rate": args.sparse_lr,
        "ftrl_l1_reg": args.ftrl_l1,
        "ftrl_l2_reg": args.ftrl_l2,
        "ftrl_beta": args.ftrl_beta,
        "ftrl_learning_rate_power": args.ftrl_lr_power,
        "ftrl_l2_shrinkage": args.ftrl_l2_shrinkage,
        "ftrl_initial_accumulator_value": args.ftrl_initial_accumulator,
        "ftrl_l2_convention": args.ftrl_l2_convention,
    }
