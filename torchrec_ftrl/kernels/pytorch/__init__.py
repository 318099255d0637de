"""The ops' PyTorch implementation (``CompositeExplicitAutograd``, and the ``"torch"`` backend):
:mod:`.composite` (the op implementations), :mod:`.rows` (vectorised forward and backward + update)
and :mod:`.index_rows` (the batch's per-index rows by torch ops)."""
