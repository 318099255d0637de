"""Model presets of the job (``--preset``) and the flags that describe the production-shape model:
multi-hot synthetic input, the DCN interaction, table-row scaling, the planner's memory, the FTRL
layout flags and the kernel warm-up.

``--preset mlperf-dcnv2`` is MLPerf's DLRM-DCNv2 on Criteo 1TB as TorchRec's example
(``torchrec_dlrm/dlrm_main.py --interaction_type=dcn``) trains it: 26 tables of
:data:`MLPERF_DCNV2_ROWS` rows (204,184,588) at D = 128, multi-hot bags of
:data:`MLPERF_DCNV2_MULTI_HOT` ids, bottom MLP 512-256-128, a DCN-v2 interaction of 3 layers of rank
512, top MLP 1024-1024-512-256-1, batch 65,536 (one process). A flag given on the command line wins
over the preset's value.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Sequence

# MLPerf DLRM-DCNv2 (training v3.0+; TorchRec's dlrm_main.py README for the Criteo 1TB multi-hot run).
MLPERF_DCNV2_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
                     405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
                     12973, 108, 36)
MLPERF_DCNV2_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3,
                          1, 1)

# Flag destinations -> values; anything given on the command line overrides them.
PRESETS = {
    "mlperf-dcnv2": {
        "num_embeddings": ",".join(map(str, MLPERF_DCNV2_ROWS)),
        "multi_hot_sizes": ",".join(map(str, MLPERF_DCNV2_MULTI_HOT)),
        "synthetic": "uniform",
        "embedding_dim": 128,
        "dense_arch": "512,256",
        "over_arch": "1024,1024,512,256",
        "dcn_layers": 3,
        "dcn_rank": 512,
        "batch_size": 65536,
        "dense_lr": 0.005,
    },
}
SYNTHETIC = ("criteo", "uniform", "zipf")
# Planner memory of --plan-only when not given: one H200 (139 GiB of HBM) and 128 GiB of host memory.
PLAN_ONLY_HBM_GIB = 139.0
PLAN_ONLY_HOST_GIB = 128.0


def add_flags(p: argparse.ArgumentParser) -> None:
    """Add the preset, multi-hot, DCN, planning, layout and warm-up flags to the job's parser."""
    from .layout_flags import LAYOUT_FLAGS

    g = p.add_argument_group("production shape")
    g.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="mlperf-dcnv2: MLPerf's DLRM-DCNv2 (26 tables, 204M rows at D=128, multi-hot "
                        "synthetic input, DCN interaction, batch 65,536); flags given override it")
    g.add_argument("--synthetic", choices=SYNTHETIC, default="criteo",
                   help="no --data: criteo (the Criteo-like generator with a planted signal, one id "
                        "per feature, batches built on the host) or uniform / zipf (random ids, "
                        "dense values and labels drawn on the training device, --multi-hot-sizes ids "
                        "per feature: uniform over a table's rows as TorchRec's RandomRecDataset "
                        "draws them, or Zipf(--zipf-alpha))")
    g.add_argument("--multi-hot-sizes", default=None, metavar="LIST",
                   help="--synthetic uniform/zipf: ids per bag, one int or one per table (default 1); "
                        "a --data folder in TorchRec's materialised multi-hot layout: the sizes it "
                        "must hold (default: its own)")
    g.add_argument("--zipf-alpha", type=float, default=1.05, help="--synthetic zipf: exponent (> 0)")
    g.add_argument("--dcn-layers", type=int, default=0,
                   help="0: DLRM's dot interaction; N > 0: TorchRec's DLRM_DCN with N low-rank cross "
                        "layers")
    g.add_argument("--dcn-rank", type=int, default=512, help="low-rank dimension of the DCN layers")
    g.add_argument("--rows-scale", type=float, default=1.0, metavar="F",
                   help="multiply every table's rows by F in (0, 1] (rounded up): the preset's shape "
                        "at a size a smaller machine holds")
    g.add_argument("--plan-only", action="store_true",
                   help="build the model on the meta device, run TorchRec's planner for "
                        "--world-size GPUs of --hbm-gib each, print the plan per table and one JSON "
                        "line, and exit; allocates no table, needs no GPU")
    g.add_argument("--world-size", type=int, default=1, help="--plan-only: GPUs to plan for")
    g.add_argument("--hbm-gib", type=float, default=None,
                   help="HBM per GPU the planner may fill (Topology hbm_cap); default: the GPU's "
                        f"memory, {PLAN_ONLY_HBM_GIB:g} (one H200) with --plan-only")
    g.add_argument("--host-gib", type=float, default=None,
                   help="host memory the planner may fill, shared by the host's ranks (Topology "
                        f"ddr_cap per rank); default: the host's, {PLAN_ONLY_HOST_GIB:g} with "
                        "--plan-only")
    for flag, (key, values, default) in LAYOUT_FLAGS.items():
        g.add_argument(flag, choices=values, default=default,
                       help=f"FTRL table layout ({', '.join(values)}; default {default}); the values "
                            f"the installed TBE does not support are refused")
    g.add_argument("--kernel-warmup", choices=("auto", "on", "off"), default="auto",
                   help="run each TBE (FTRL's and FBGEMM's) once on a throw-away batch before the "
                        "first timed step so its kernels compile and load there (weights, states and "
                        "step counters restored bit for bit); auto: on CUDA")


def explicit_dests(build_parser: Callable[[], argparse.ArgumentParser],
                   argv: Optional[Sequence[str]]) -> set:
    """Destinations of the flags given in ``argv`` (a copy of the parser with no defaults)."""
    q = build_parser()
    for action in q._actions:
        action.default = argparse.SUPPRESS
    given, _ = q.parse_known_args(argv)
    return set(vars(given))


def apply_preset(a: argparse.Namespace, explicit: set) -> None:
    """Set the values of ``a.preset`` (if any) on ``a`` for every flag not in ``explicit``, and
    ``a.multi_hot_origin`` (the flag that set ``--multi-hot-sizes``). With ``--data`` or
    ``--synthetic criteo`` the preset's ``--synthetic`` is left out, and so are its
    ``--multi-hot-sizes`` unless ``--data`` is a materialised multi-hot folder (whose sizes the job
    then checks against them)."""
    a.multi_hot_origin = "--multi-hot-sizes"
    if a.preset is None:
        return
    from .data_kind import multi_hot_folder

    # Input read from --data, or the host generator asked for: the preset's drawn input is not.
    own_input = a.data is not None or "synthetic" in explicit and a.synthetic == "criteo"
    one_hot_input = own_input and not multi_hot_folder(a)
    for dest, value in PRESETS[a.preset].items():
        if dest in explicit or (own_input and dest == "synthetic") or (
                one_hot_input and dest == "multi_hot_sizes"):
            continue
        setattr(a, dest, value)
        if dest == "multi_hot_sizes":
            a.multi_hot_origin = f"--preset {a.preset}"


def check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Check the flags of :func:`add_flags` (argparse errors naming flag and value) and derive
    ``a.multi_hot_list`` (ids per table, or None for one-hot input) and ``a.num_embeddings_list``
    scaled by ``--rows-scale``."""
    from .layout_flags import layout_error

    if not (0.0 < a.rows_scale <= 1.0):
        p.error(f"--rows-scale must be in (0, 1], got {a.rows_scale}")
    if a.rows_scale != 1.0:
        a.num_embeddings_list = [max(1, math.ceil(n * a.rows_scale)) for n in a.num_embeddings_list]
    for name in ("dcn_layers", "dcn_rank", "world_size"):
        low = 0 if name == "dcn_layers" else 1
        if getattr(a, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(a, name)}")
    for name in ("hbm_gib", "host_gib"):
        v = getattr(a, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            p.error(f"--{name.replace('_', '-')} must be a number > 0, got {v}")
    if a.world_size != 1 and not a.plan_only:
        p.error(f"--world-size {a.world_size} needs --plan-only (a run takes its world size from the "
                f"launcher)")
    if not (math.isfinite(a.zipf_alpha) and a.zipf_alpha > 0):
        p.error(f"--zipf-alpha must be a number > 0, got {a.zipf_alpha}")
    a.multi_hot_list = None
    if a.multi_hot_sizes is not None:
        from .data_kind import multi_hot_folder

        drawn = a.data is None and a.synthetic != "criteo"
        if not (drawn or multi_hot_folder(a)):
            p.error(f"--multi-hot-sizes needs --synthetic uniform or zipf (no --data) or a --data "
                    f"folder in TorchRec's materialised multi-hot layout (PREFIX_sparse_multi_hot.npz), "
                    f"got --multi-hot-sizes {a.multi_hot_sizes}")
        try:
            sizes = [int(x) for x in a.multi_hot_sizes.split(",")]
        except ValueError:
            p.error(f"--multi-hot-sizes must be a comma list of ints >= 1, got {a.multi_hot_sizes!r}")
        if any(s < 1 for s in sizes):
            p.error(f"--multi-hot-sizes entries must be >= 1, got {a.multi_hot_sizes}")
        tables = len(a.num_embeddings_list)
        if len(sizes) > 1 and tables > 1 and len(sizes) != tables:
            p.error(f"--multi-hot-sizes has {len(sizes)} entries but --num-embeddings {tables}")
        a.multi_hot_list = sizes
    if a.synthetic != "criteo" and a.data is not None:
        p.error(f"--synthetic {a.synthetic} generates the input: it cannot be used with --data")
    if a.synthetic != "criteo" and a.zch:
        p.error(f"--synthetic {a.synthetic} draws ids from the table rows; --zch needs raw ids")
    msg = layout_error(a)
    if msg:
        p.error(msg)
