"""The FTRL table-batched embedding module (TBE) and its parts: :mod:`.module` (the ``nn.Module`` and
its autograd function), :mod:`.args` (its constructor arguments, parsed once), :mod:`.tables` (the
tables' geometry and flat buffers), :mod:`.batch` and :mod:`.bounds_check` (a forward's checked batch),
:mod:`.cached_lookup` and :mod:`.cache` (the ``fused_uvm_caching`` placement's HBM row cache),
:mod:`.placement` (where the rows live and what each placement costs), :mod:`.table_api` (FBGEMM's
table API and the hooks TorchRec calls) and :mod:`.derived_weight` (the weight view of a derived
table)."""

from .module import FTRLTableBatchedEmbeddingBags

__all__ = ["FTRLTableBatchedEmbeddingBags"]
