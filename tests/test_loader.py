"""``torchrec_ftrl.data.train_loader`` (the training batches from DataLoader workers) and the job's
touched-row tracker.

The loader must yield, with any number of workers, bitwise the batches the source's own sequential
iterator yields (``train_batches``; its rows are checked against the text elsewhere, e.g.
tests/test_data_binary.py), in the same order, for every source and rank, from any start step. The
tracker's masks are checked against the set of ids counted with numpy from the batches' id arrays.
"""

import numpy as np
import pytest
import torch

from torchrec_ftrl.data import (CRITEO_SPEC, BinarySource, CTRFileReader, FileSource, Split,
                                SyntheticCTR, SyntheticSource, train_loader)
from torchrec_ftrl.job.sparsity import TouchTracker
from test_data_binary import binary_dir, criteo_lines  # noqa: F401  (module fixtures)


def _assert_same_batch(a, b):
    for x, y in ((a.dense_features, b.dense_features), (a.labels, b.labels),
                 (a.sparse_features.values(), b.sparse_features.values()),
                 (a.sparse_features.lengths(), b.sparse_features.lengths())):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert a.sparse_features.length_per_key() == b.sparse_features.length_per_key()


def _assert_loader_matches(source, world_size, batch_size, start_step, num_steps, workers):
    for rank in range(world_size):
        want = source.train_batches(rank, world_size, batch_size, start_step=start_step)
        got = list(train_loader(source, rank, world_size, batch_size, start_step, num_steps,
                                workers=workers))
        assert len(got) == num_steps
        for b in got:
            _assert_same_batch(b, next(want))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_synthetic_steps_in_order_from_workers(workers):
    src = SyntheticSource(SyntheticCTR(500, num_categorical=4, seed=3))
    _assert_loader_matches(src, world_size=2, batch_size=16, start_step=5, num_steps=7, workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_binary_steps_in_order_from_workers(binary_dir, workers):  # noqa: F811
    folder, _ = binary_dir
    src = BinarySource(folder, 1000, Split.parse("every:10"))
    # 3 ranks x 40 rows: the stream wraps past the 900 training rows within 10 steps
    _assert_loader_matches(src, world_size=3, batch_size=40, start_step=2, num_steps=10, workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_text_stream_from_one_worker(sample_data, workers):
    reader = CTRFileReader([sample_data("criteo", "criteo_dac_combined.tsv")], CRITEO_SPEC, 1000)
    src = FileSource(reader, Split.parse("every:10"))
    # 2 ranks x 512 rows: the second pass over the training rows (9 in 10) begins within these steps
    _assert_loader_matches(src, world_size=2, batch_size=512, start_step=3, num_steps=6, workers=workers)


def test_loader_refuses_bad_arguments():
    src = SyntheticSource(SyntheticCTR(50, num_categorical=2))
    for kw, msg in (({"workers": -1}, "workers must be >= 0, got -1"),
                    ({"num_steps": -2}, "num_steps must be >= 0, got -2"),
                    ({"start_step": -3}, "start_step must be >= 0, got -3"),
                    ({"prefetch_factor": 0}, "prefetch_factor must be >= 1, got 0")):
        args = {"start_step": 0, "num_steps": 4, **kw}
        with pytest.raises(ValueError, match=msg):
            train_loader(src, 0, 1, 8, args.pop("start_step"), args.pop("num_steps"), **args)
    assert list(train_loader(src, 0, 1, 8, 0, 0, workers=2)) == []


def test_touch_tracker_marks_exactly_the_ids_of_the_batches():
    gen = SyntheticCTR([300, 40, 7], seed=1, vocab=50)
    tracker = TouchTracker(gen.categorical_names, gen.num_embeddings)
    seen = [np.zeros(n, dtype=bool) for n in gen.num_embeddings]
    for i in range(3):
        tracker.update(gen.batch("train", i, 64).sparse_features)
        ids = gen.arrays("train", i, 64)[2]   # [B, F], -1 missing
        for f in range(ids.shape[1]):
            seen[f][ids[ids[:, f] >= 0, f]] = True
    masks = tracker.masks
    assert list(masks) == ["t_C1", "t_C2", "t_C3"]
    for f, name in enumerate(masks):
        assert masks[name].dtype == torch.bool
        assert np.array_equal(masks[name].numpy(), seen[f]), name
    # state_dict / load_state_dict: a fresh tracker restores the same masks
    other = TouchTracker(gen.categorical_names, gen.num_embeddings)
    other.load_state_dict(tracker.state_dict())
    assert all(torch.equal(other.masks[n], masks[n]) for n in masks)


class _Boom:
    """A source whose step 3 cannot be built; without ``train_batch`` it is a plain stream."""

    def __init__(self, indexed: bool):
        self.gen = SyntheticSource(SyntheticCTR(50, num_categorical=2))
        if indexed:
            self.train_batch = self._batch

    def _batch(self, rank, world_size, batch_size, step):
        if step == 3:
            raise ValueError("row 77: malformed row (field_count)")
        return self.gen.train_batch(rank, world_size, batch_size, step)

    def train_batches(self, rank, world_size, batch_size, start_step=0):
        step = start_step
        while True:
            yield self._batch(rank, world_size, batch_size, step)
            step += 1


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_a_worker_is_raised_unchanged_at_its_step(indexed, workers):
    got = []
    with pytest.raises(ValueError) as e:
        for b in train_loader(_Boom(indexed), 0, 1, 8, 0, 6, workers=workers):
            got.append(b)
    assert str(e.value) == "row 77: malformed row (field_count)"   # no worker traceback in it
    assert len(got) == 3   # steps 0, 1 and 2 were trained
