"""The FTRL table layout flags of the job (``--ftrl-weights``, ``--ftrl-accumulator``), which of them
the TBE kernels run, and the bytes per embedding row of each layout.

What a layout stores per row is :class:`torchrec_ftrl.row_layout.RowLayout` (``--ftrl-state-dtype``
gives both states' dtype); which layouts the kernels implement is
:data:`torchrec_ftrl.row_layout.KERNEL_LAYOUTS`, so a layout the kernels gain is usable through these
flags without a change here.
"""

from __future__ import annotations

from torchrec_ftrl.row_layout import ACCUMULATORS, KERNEL_LAYOUTS, WEIGHTS, RowLayout

# flag -> (fused_params / TBE keyword, values, the default layout)
LAYOUT_FLAGS = {
    "--ftrl-weights": ("ftrl_weights", WEIGHTS, "stored"),
    "--ftrl-accumulator": ("ftrl_accumulator", ACCUMULATORS, "elementwise"),
}
# Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD): fp32 weights and one fp32 momentum per row.
ROWWISE_ADAGRAD_STATE_BYTES_PER_ROW = 4


def layout_error(args, kernel_layouts=KERNEL_LAYOUTS) -> str:
    """A one-line error for a layout the TBE kernels do not run (``kernel_layouts``: the
    ``(weights, accumulator)`` pairs they do), or for a layout flag other than its default with
    ``--sparse-optimizer rowwise_adagrad``; "" when all are fine."""
    for flag, (key, _values, default) in LAYOUT_FLAGS.items():
        value = getattr(args, key)
        if value != default and args.sparse_optimizer != "ftrl":
            return (f"{flag} {value} needs --sparse-optimizer ftrl, got --sparse-optimizer "
                    f"{args.sparse_optimizer}")
    pair = (args.ftrl_weights, args.ftrl_accumulator)
    if args.sparse_optimizer == "ftrl" and pair not in kernel_layouts:
        have = "; ".join(f"--ftrl-weights {w} --ftrl-accumulator {a}" for w, a in sorted(kernel_layouts))
        return (f"--ftrl-weights {pair[0]} --ftrl-accumulator {pair[1]} is not supported by the FTRL TBE "
                f"kernels; supported: {have}")
    return ""


def fused_layout_params(args) -> dict:
    """The layout keys for ``fused_params``: only those whose flag differs from the default layout (so
    default runs pass exactly the ``fused_params`` they always did)."""
    return {key: getattr(args, key, default) for key, _values, default in LAYOUT_FLAGS.values()
            if getattr(args, key, default) != default}


def derives_weights(args) -> bool:
    """Whether the job's embedding tables keep no weights: FTRL with ``--ftrl-weights derived``
    (:attr:`~torchrec_ftrl.row_layout.RowLayout.stores_weights`)."""
    return args.sparse_optimizer == "ftrl" and not RowLayout.from_options(fused_layout_params(args)).stores_weights


def bytes_per_row(dim: int, sparse_optimizer: str, weights: str = "stored",
                  accumulator: str = "elementwise", state_dtype: str = "fp32") -> tuple[int, int]:
    """``(weight bytes, optimizer-state bytes)`` of one embedding row of ``dim`` fp32 weights: FTRL's
    by :class:`~torchrec_ftrl.row_layout.RowLayout` (``state_dtype`` for both states); row-wise
    Adagrad ``4 * dim`` and 4.

    Raises:
        ValueError: an unknown optimizer, layout or state dtype, naming it.
    """
    if sparse_optimizer == "rowwise_adagrad":
        return 4 * dim, ROWWISE_ADAGRAD_STATE_BYTES_PER_ROW
    if sparse_optimizer != "ftrl":
        raise ValueError(f"sparse_optimizer must be ftrl or rowwise_adagrad, got {sparse_optimizer!r}")
    layout = RowLayout.from_options({"ftrl_weights": weights, "ftrl_accumulator": accumulator,
                                     "optimizer_state_dtypes": {"accum": state_dtype, "linear": state_dtype}},
                                    where="layout")
    return layout.weight_bytes_per_row(dim, 4), layout.state_bytes_per_row(dim)
