"""``torchrec_ftrl.optim_type``: FTRL's identity (the ``EmbOptimType`` member and :func:`is_ftrl`)."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import torchrec_ftrl
from torchrec_ftrl.optim_type import FTRL_NAME, FTRL_VALUE, emb_optim_type, is_ftrl


class _SubFTRL(torchrec_ftrl.FTRL):
    pass


@pytest.mark.parametrize("value, expected", [
    (EmbOptimType.FTRL, True), ("ftrl", True), ("FTRL", True), (torchrec_ftrl.FTRL, True),
    (_SubFTRL, True), (EmbOptimType.ADAM, False), (torch.optim.Adam, False), (None, False),
    ("adam", False)])
def test_is_ftrl(value, expected):
    assert is_ftrl(value) is expected


def test_emb_optim_type_is_the_member():
    member = emb_optim_type()
    assert member is EmbOptimType.FTRL and member.name == FTRL_NAME and member.value == FTRL_VALUE
    assert is_ftrl(member) and torchrec_ftrl.FTRLTableBatchedEmbeddingBags([(2, 2)]).optimizer is member
