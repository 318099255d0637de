"""The FTRL table layout flags of the job (``--ftrl-weights``, ``--ftrl-accumulator``), what the
installed TBE supports of them, and the bytes per embedding row of each layout.

A layout is what an FTRL table stores per row of ``D`` elements:

* weights: ``stored`` keeps the weight vector (``D`` elements of the weights' dtype) beside the state;
  ``derived`` keeps none and computes the weight from ``linear`` and ``accum`` when a row is read
  (FTRL's closed form, docs/ftrl.md);
* ``accum`` (FTRL's ``n``): ``elementwise`` keeps ``D`` values, ``rowwise`` one fp32 value per row;
* ``linear`` (FTRL's ``z``): always ``D`` values;

states in fp32 or bf16 (``--ftrl-state-dtype``). Which values the TBE accepts is read from the
signature of :class:`torchrec_ftrl.tbe.FTRLTableBatchedEmbeddingBags` (a keyword argument named like
the flag), so a TBE that gains a layout is usable through these flags without a change here.
"""

from __future__ import annotations

import inspect

# flag -> (fused_params / TBE keyword, values, the layout every TBE has)
LAYOUT_FLAGS = {
    "--ftrl-weights": ("ftrl_weights", ("stored", "derived"), "stored"),
    "--ftrl-accumulator": ("ftrl_accumulator", ("elementwise", "rowwise"), "elementwise"),
}
# Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD): fp32 weights and one fp32 momentum per row.
ROWWISE_ADAGRAD_STATE_BYTES_PER_ROW = 4
# --ftrl-accumulator rowwise: one fp32 accum per row.
ROWWISE_ACCUMULATOR_BYTES = 4


def tbe_keywords() -> frozenset:
    """Keyword arguments of ``FTRLTableBatchedEmbeddingBags.__init__``."""
    from torchrec_ftrl.tbe import FTRLTableBatchedEmbeddingBags
    return frozenset(inspect.signature(FTRLTableBatchedEmbeddingBags.__init__).parameters)


def supported_values(flag: str, keywords=None) -> tuple:
    """Values of ``flag`` (a key of :data:`LAYOUT_FLAGS`) the installed TBE accepts: all of them when
    its constructor takes the flag's keyword, else only the layout every TBE has."""
    key, values, default = LAYOUT_FLAGS[flag]
    keywords = tbe_keywords() if keywords is None else keywords
    return values if key in keywords else (default,)


def layout_error(args, keywords=None) -> str:
    """A one-line error for a layout flag whose value the TBE does not support, or for a layout flag
    other than its default with ``--sparse-optimizer rowwise_adagrad``; "" when all are fine."""
    for flag, (key, _values, default) in LAYOUT_FLAGS.items():
        value = getattr(args, key)
        if value == default:
            continue
        if args.sparse_optimizer != "ftrl":
            return (f"{flag} {value} needs --sparse-optimizer ftrl, got --sparse-optimizer "
                    f"{args.sparse_optimizer}")
        ok = supported_values(flag, keywords)
        if value not in ok:
            return (f"{flag} {value} is not supported by the installed FTRL TBE "
                    f"(FTRLTableBatchedEmbeddingBags takes no {key!r} argument); supported: "
                    f"{', '.join(ok)}")
    return ""


def fused_layout_params(args) -> dict:
    """The layout keys for ``fused_params``: only those whose flag differs from the layout every TBE
    has (so default runs pass exactly the ``fused_params`` they always did)."""
    return {key: getattr(args, key, default) for key, _values, default in LAYOUT_FLAGS.values()
            if getattr(args, key, default) != default}


def bytes_per_row(dim: int, sparse_optimizer: str, weights: str = "stored",
                  accumulator: str = "elementwise", state_dtype: str = "fp32") -> tuple[int, int]:
    """``(weight bytes, optimizer-state bytes)`` of one embedding row of ``dim`` fp32 weights.

    FTRL: weights ``4 * dim`` when ``stored``, 0 when ``derived``; state ``linear`` ``dim`` values
    plus ``accum`` ``dim`` values (``elementwise``) or 4 bytes (``rowwise``, fp32), values of 4 bytes
    (fp32) or 2 (bf16). Row-wise Adagrad: ``4 * dim`` and 4.

    Raises:
        ValueError: an unknown optimizer, layout or state dtype, naming it.
    """
    if sparse_optimizer == "rowwise_adagrad":
        return 4 * dim, ROWWISE_ADAGRAD_STATE_BYTES_PER_ROW
    if sparse_optimizer != "ftrl":
        raise ValueError(f"sparse_optimizer must be ftrl or rowwise_adagrad, got {sparse_optimizer!r}")
    for name, value, allowed in (("weights", weights, LAYOUT_FLAGS["--ftrl-weights"][1]),
                                 ("accumulator", accumulator, LAYOUT_FLAGS["--ftrl-accumulator"][1])):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    from torchrec_ftrl.state_dtype import parse_state_dtypes, state_bytes_per_element
    dtypes = parse_state_dtypes({"accum": state_dtype, "linear": state_dtype}, "state_dtype")
    if accumulator == "elementwise":
        state = dim * state_bytes_per_element(dtypes)
    else:
        state = dim * dtypes["linear"].itemsize + ROWWISE_ACCUMULATOR_BYTES
    return (4 * dim if weights == "stored" else 0), state
