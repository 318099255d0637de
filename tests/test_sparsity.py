"""The job's sparsity counts (torchrec_ftrl/job/sparsity.py), counted in row chunks, against counts made
here by hand with NumPy."""

import numpy as np
import pytest
import torch

from torchrec_ftrl.job import sparsity


class _Model(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.embedding_bags = torch.nn.ModuleDict({"t0": torch.nn.EmbeddingBag(*table.shape)})
        self.embedding_bags["t0"].weight.data.copy_(table)


@pytest.mark.parametrize("chunk_elements", [1, 8, 13, 1 << 27])
def test_counts_do_not_depend_on_the_chunk(monkeypatch, chunk_elements):
    rng = np.random.default_rng(0)
    table = rng.normal(size=(11, 4)) * (rng.uniform(size=(11, 4)) < 0.5)
    table[3] = 0.0
    table[7] = 0.0
    touched = np.zeros(11, dtype=bool)
    touched[[1, 3, 4]] = True
    monkeypatch.setattr(sparsity, "_CHUNK_ELEMENTS", chunk_elements)
    got = sparsity.table_sparsity(_Model(torch.tensor(table, dtype=torch.float32)), torch.device("cpu"),
                                  touched={"t0": torch.tensor(touched)})["t0"]
    zero = table == 0
    zero_row = zero.all(axis=1)
    assert got["zero_weights"] == int(zero.sum())
    assert got["zero_rows"] == int(zero_row.sum()) == 2 + int(zero_row[[i for i in range(11) if i not in (3, 7)]].sum())
    assert got["zero_weights_touched"] == int(zero[touched].sum())
    assert got["zero_rows_touched"] == int(zero_row[touched].sum())
