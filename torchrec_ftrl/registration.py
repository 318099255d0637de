"""Registration of FTRL into stock fbgemm_gpu / torchrec (filled in by the integration work)."""

from __future__ import annotations


def ftrl_emb_optim_type():
    """``EmbOptimType.FTRL`` (registered on import of torchrec_ftrl)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    return getattr(EmbOptimType, "FTRL", None)
