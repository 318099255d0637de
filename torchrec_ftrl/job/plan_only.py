"""``--plan-only``: the sharding plan of the job's model for a given topology, without a GPU.

The model is built on the meta device (no table or MLP is allocated) and TorchRec's planner (the job's
:func:`.model.make_planner`: ``fused`` / ``fused_uvm_caching`` kernels, torchrec_ftrl's storage
estimate for FTRL tables) plans it for ``--world-size`` CUDA devices of ``--hbm-gib`` GiB each and
``--host-gib`` GiB of host memory shared by them. Prints one line per table (sharding type, compute
kernel, ranks, bytes of weights and of optimizer state) and ends with one JSON line::

    {"sparse_bytes": ..., "weight_bytes": ..., "optimizer_state_bytes": ..., "fits_in_hbm": ...,
     "fits": ..., ...}

``sparse_bytes`` = weights + optimizer state of all tables (:func:`.layout_flags.bytes_per_row`);
``fits`` whether the planner found a placement in HBM + host memory; ``fits_in_hbm`` whether it
placed every table whole in HBM (compute kernel ``fused``).
"""

from __future__ import annotations

import json
from typing import Optional

import torch

from . import cli
from . import layout_flags
from . import model as model_lib
from . import presets

GB = 1e9


def layout_name(args) -> str:
    """The sparse optimizer and FTRL layout of ``args`` in words."""
    if args.sparse_optimizer != "ftrl":
        return args.sparse_optimizer
    return (f"ftrl weights {args.ftrl_weights}, accumulator {args.ftrl_accumulator}, "
            f"state {args.ftrl_state_dtype}")


def table_bytes(args, rows: list) -> tuple[list, list]:
    """Per table ``(weight bytes, optimizer-state bytes)`` lists for ``rows`` rows at
    ``--embedding-dim`` (:func:`.layout_flags.bytes_per_row`)."""
    w, s = layout_flags.bytes_per_row(args.embedding_dim, args.sparse_optimizer, args.ftrl_weights,
                                args.ftrl_accumulator, args.ftrl_state_dtype)
    return [n * w for n in rows], [n * s for n in rows]


def no_fit_message(args, rows: list, world_size: int, hbm_bytes: Optional[int],
                   ddr_bytes: Optional[int]) -> str:
    """One line: the tables' bytes against the memory the planner was given."""
    w, s = table_bytes(args, rows)
    hbm = "TorchRec's default HBM" if hbm_bytes is None else f"{hbm_bytes / model_lib.GIB:g} GiB of HBM"
    ddr = ("TorchRec's default host memory" if ddr_bytes is None
           else f"{ddr_bytes / model_lib.GIB:g} GiB of host memory")
    return (f"the sparse tables do not fit: {(sum(w) + sum(s)) / GB:.1f} GB ({sum(w) / GB:.1f} GB "
            f"weights + {sum(s) / GB:.1f} GB optimizer state, {layout_name(args)}, "
            f"{len(rows)} tables, {sum(rows):,} rows x {args.embedding_dim}) and TorchRec's planner "
            f"found no placement on {world_size} device(s) of {hbm} and {ddr} each")


def run(args) -> dict:
    """Plan and print (see the module docstring); returns the JSON line's dict."""
    from .source import make_source
    import torchrec_ftrl
    from torchrec.distributed.planner.types import PlannerError

    source, _ = make_source(args)
    features, rows = list(source.categorical_names), list(source.num_embeddings)
    fused_params = cli.sparse_fused_params(args, world_size=args.world_size)
    meta = torch.device("meta")
    dcn = (args.dcn_layers, args.dcn_rank) if args.dcn_layers else None
    net = model_lib.build_dlrm(features, rows, args.embedding_dim, len(source.dense_names),
                               args.dense_arch_list, args.over_arch_list, meta, dcn=dcn)
    hbm_gib = presets.PLAN_ONLY_HBM_GIB if args.hbm_gib is None else args.hbm_gib
    host_gib = presets.PLAN_ONLY_HOST_GIB if args.host_gib is None else args.host_gib
    hbm, ddr = model_lib.device_memory_bytes(meta, hbm_gib, host_gib, args.world_size)
    tables = [f"t_{f}" for f in features]
    planner = model_lib.make_planner(tables, args.sharding_types.split(","), "cuda", args.world_size,
                                     args.world_size, args.batch_size, hbm, ddr)
    weights, states = table_bytes(args, rows)
    try:
        plan = planner.plan(net, torchrec_ftrl.sharders(fused_params))
        error = None
    except PlannerError as e:
        plan, error = None, e
    placed = {}
    if plan is not None:
        for module_plan in plan.plan.values():
            placed.update(module_plan)
    print(f"plan-only: {layout_name(args)}, {len(tables)} tables, D={args.embedding_dim}, batch "
          f"{args.batch_size}/rank, {args.world_size} GPU(s) of {hbm_gib:g} GiB HBM, host "
          f"{host_gib:g} GiB")
    print(f"{'table':<8} {'rows':>12} {'sharding':<18} {'kernel':<18} {'ranks':<10} "
          f"{'weights GB':>10} {'state GB':>9}")
    for t, n, w, s in zip(tables, rows, weights, states):
        ps = placed.get(t)
        kind, kernel, ranks = ((ps.sharding_type, ps.compute_kernel, ",".join(map(str, ps.ranks or [])))
                               if ps is not None else ("-", "-", "-"))
        print(f"{t:<8} {n:>12,} {kind:<18} {kernel:<18} {ranks:<10} {w / GB:>10.3f} {s / GB:>9.3f}")
    fits = plan is not None
    if not fits:
        print(f"plan-only: {no_fit_message(args, rows, args.world_size, hbm, ddr)} "
              f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    result = {
        "sparse_bytes": sum(weights) + sum(states), "weight_bytes": sum(weights),
        "optimizer_state_bytes": sum(states),
        "fits_in_hbm": fits and all(ps.compute_kernel == "fused" for ps in placed.values()),
        "fits": fits,
        "compute_kernels": sorted({ps.compute_kernel for ps in placed.values()}),
        "layout": layout_name(args), "tables": len(tables), "rows": sum(rows),
        "embedding_dim": args.embedding_dim, "world_size": args.world_size,
        "hbm_gib_per_gpu": hbm_gib, "host_gib": host_gib,
    }
    print(json.dumps(result), flush=True)
    return result
