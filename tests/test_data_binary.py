"""The binary Criteo layout reader (``BinarySource``) and its wiring into the job.

Real data: the first 1,000 rows of the Criteo sample, cut into three files ``day_0`` (rows 1-300),
``day_2`` (301-600) and ``day_10`` (601-1000) and converted with TorchRec's own
``BinaryCriteoUtils.tsv_to_npys``. Expected values are computed here from the TSV text with plain
string operations (``int(hex, 16) % n`` or missing for an empty field, ``log(1 + max(x, 0))``), or
are hand-computed literals, or come from the text reader ``FileSource`` (the other implementation).
Row-to-rank assignment is checked on synthetic triplets whose first categorical column holds the
global row number, against the rule written out in the test.
"""

import json
import math
import os

import numpy as np
import pytest
import torch

from conftest import run_job
from torchrec_ftrl.data import (CRITEO_SPEC, BinaryLayoutError, BinarySource, CTRFileReader,
                                FileSource, NoUsableRowsError, Split)

SLICES = (("day_0", 0, 300), ("day_2", 300, 600), ("day_10", 600, 1000))


# ---------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def criteo_lines(sample_data):
    with open(sample_data("criteo", "criteo_dac_combined.tsv")) as f:
        return [line.rstrip("\n") for _, line in zip(range(1000), f)]


@pytest.fixture(scope="module")
def binary_dir(criteo_lines, tmp_path_factory):
    """``(folder, tsv path of the same 1,000 rows)``: three triplets written by tsv_to_npys."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    root = tmp_path_factory.mktemp("binary")
    out = root / "npy"
    out.mkdir()
    for prefix, a, b in SLICES:
        tsv = root / f"{prefix}.tsv"
        tsv.write_text("".join(line + "\n" for line in criteo_lines[a:b]))
        BinaryCriteoUtils.tsv_to_npys(str(tsv), *(str(out / f"{prefix}_{k}.npy")
                                                  for k in ("dense", "sparse", "labels")))
    whole = root / "all.tsv"
    whole.write_text("".join(line + "\n" for line in criteo_lines))
    return str(out), str(whole)


def _expected(lines, ne):
    """Labels [n], dense [n, 13] (text transform, float32) and ids [n, 26] (-1 missing) from text."""
    fields = [line.split("\t") for line in lines]
    labels = np.array([int(f[0]) for f in fields])
    dense = np.array([[math.log1p(max(int(v or "0"), 0)) for v in f[1:14]] for f in fields],
                     dtype=np.float32)
    ids = np.array([[int(v, 16) % ne if v else -1 for v in f[14:40]] for f in fields])
    return labels, dense, ids


def _batch_arrays(batch):
    """``(labels [B], dense [B, D], ids [B, F] with -1 for an empty bag)`` of a torchrec Batch."""
    kjt = batch.sparse_features
    f, b = len(kjt.keys()), batch.labels.shape[0]
    lengths = kjt.lengths().reshape(f, b).numpy()
    assert set(np.unique(lengths)) <= {0, 1}
    ids = np.full((f, b), -1, dtype=np.int64)
    ids[lengths == 1] = kjt.values().numpy()
    return batch.labels.numpy(), batch.dense_features.numpy(), ids.T


def _stack(batches):
    parts = [_batch_arrays(b) for b in batches]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


# ------------------------------------------------------------------------------- values vs the text


def test_batches_match_the_tsv_text(binary_dir, criteo_lines):
    folder, _ = binary_dir
    src = BinarySource(folder, 1000, Split.parse("every:10"))
    assert [t.prefix for t in src.triplets] == ["day_0", "day_2", "day_10"]  # natural order
    assert src.num_rows == 1000 and src.num_train_rows() == 900
    assert src.dense_names == CRITEO_SPEC.dense_names and src.categorical_names == CRITEO_SPEC.categorical_names
    train_lines = [line for i, line in enumerate(criteo_lines) if i % 10 != 9]
    want = _expected(train_lines, 1000)
    it = src.train_batches(0, 1, 64)
    got = _stack([next(it) for _ in range(14)])  # 896 of the 900 training rows
    np.testing.assert_array_equal(got[0], want[0][:896])
    np.testing.assert_allclose(got[1], want[1][:896], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(got[2], want[2][:896])
    # hand-computed: row 1, C1 = 0x68fd1e64 = 1761418852 -> 852; I5 = 1382 -> log(1383)
    assert got[2][0, 0] == 852 and got[1][0, 4] == pytest.approx(7.232010331664759, rel=1e-7)
    # row 5: I1 = 3 -> log(4), I2 = -1 -> 0 (clipped, as in the text reader), I3 missing -> 0
    np.testing.assert_allclose(got[1][4, :3], [1.3862943611198906, 0.0, 0.0], rtol=1e-7)
    # the 15th batch wraps: training rows 896..899, then 0..59 of the next epoch
    nxt = _batch_arrays(next(it))
    np.testing.assert_array_equal(nxt[0], np.concatenate([want[0][896:], want[0][:60]]))
    assert src.epoch == 1


def test_per_file_zero_code_and_stored_dense(binary_dir, criteo_lines):
    """tsv_to_npys stores log(x - m + 2), m the file's smallest value (hand-found: -1, -1, -2);
    the code of x = 0 is 2 - m; ``dense="stored"`` feeds the stored values unchanged."""
    folder, _ = binary_dir
    src = BinarySource(folder, 1000, Split.parse("none"), dense="stored")
    assert [BinarySource(folder, 1000, Split.parse("none")).zero_code(f) for f in range(3)] == [3, 3, 4]
    got = _stack([next(src.train_batches(0, 1, 1000))])
    for prefix, a, b in SLICES:
        x = np.array([[int(v or "0") for v in line.split("\t")[1:14]] for line in criteo_lines[a:b]])
        stored = np.log((x - x.min() + 2).astype(np.float32), dtype=np.float32)
        np.testing.assert_array_equal(got[1][a:b], stored)


def test_same_batches_as_the_text_reader(binary_dir):
    """World size 1: the binary and text readers give the same training stream; any world size: the
    same validation batches (rows, padding, n_real)."""
    folder, tsv = binary_dir
    split = Split.parse("every:10")
    text = FileSource(CTRFileReader(tsv, CRITEO_SPEC, 777), split)
    binary = BinarySource(folder, 777, split)
    ti, bi = text.train_batches(0, 1, 100), binary.train_batches(0, 1, 100)
    for _ in range(12):  # 1,200 rows: more than one epoch of 900
        for x, y in zip(_batch_arrays(next(ti)), _batch_arrays(next(bi))):
            np.testing.assert_array_equal(x, y)
    for rank in (0, 1, 2):
        tv, bv = text.validation_batches(rank, 3, 16), binary.validation_batches(rank, 3, 16)
        # 100 validation rows: 34 / 33 / 33 on ranks 0 / 1 / 2, 3 batches of 16 on every rank
        assert [n for _, n in tv] == [n for _, n in bv] == [16, 16, 2 if rank == 0 else 1]
        for (x, _), (y, _) in zip(tv, bv):
            for p, q in zip(_batch_arrays(x), _batch_arrays(y)):
                np.testing.assert_array_equal(p, q)


# ------------------------------------------------------------------------- split and rank assignment


def _numbered(folder, sizes, dense_cols=13, sparse_cols=3):
    """Triplets ``p0, p1, ...`` of ``sizes`` rows; sparse[:, 0] = global row + 1, labels = row % 2,
    dense = log(row % 7 + 2) (x = row % 7, m = 0)."""
    os.makedirs(folder, exist_ok=True)
    start = 0
    for i, n in enumerate(sizes):
        rows = np.arange(start, start + n)
        sparse = np.zeros((n, sparse_cols), dtype=np.int64)
        sparse[:, 0] = rows + 1
        sparse[:, 1:] = 5
        dense = np.log((np.repeat((rows % 7)[:, None], dense_cols, 1) + 2).astype(np.float32))
        np.save(os.path.join(folder, f"p{i}_dense.npy"), dense.astype(np.float32))
        np.save(os.path.join(folder, f"p{i}_sparse.npy"), sparse)
        np.save(os.path.join(folder, f"p{i}_labels.npy"), (rows % 2).astype(np.int32).reshape(-1, 1))
        start += n
    return str(folder)


def _rows_of(batch):
    return _batch_arrays(batch)[2][:, 0] - 1  # the global row numbers


@pytest.mark.parametrize("text", ["every:7", "every:2", "tail:0.13", "none"])
def test_split_index_maps_match_is_validation(text):
    split, n = Split.parse(text), 103
    train = [i for i in range(n) if not split.is_validation(i, n)]
    val = [i for i in range(n) if split.is_validation(i, n)]
    assert split.counts(n) == (len(train), len(val))
    assert split.train_index(np.arange(len(train)), n).tolist() == train
    assert split.validation_index(np.arange(len(val)), n).tolist() == val


def test_training_rows_to_ranks(tmp_path):
    """Rule: training rows in order form one stream cycling over epochs; global batch j (B stream
    positions) is step j // W of rank j % W. One epoch: every training row on exactly one rank."""
    folder = _numbered(tmp_path / "n", [300, 450, 250])
    src = BinarySource(folder, 10 ** 6, Split.parse("every:10"))
    train = [i for i in range(1000) if i % 10 != 9]  # 900 rows
    w, b, steps = 3, 32, 10  # 10 steps x 3 ranks x 32 = 960 positions
    per_rank = {r: [_rows_of(x) for x, _ in zip(src.train_batches(r, w, b), range(steps))]
                for r in range(w)}
    stream = np.concatenate([per_rank[j % w][j // w] for j in range(steps * w)])
    np.testing.assert_array_equal(stream, (train * 2)[:960])
    first_epoch = stream[:900]
    assert sorted(first_epoch.tolist()) == train
    # labels and the dense code travel with their rows (label = row % 2; x = row % 7)
    x, _ = next(zip(src.train_batches(1, w, b), range(1)))
    lab, dense, _ = _batch_arrays(x)
    rows = _rows_of(x)
    np.testing.assert_array_equal(lab, rows % 2)
    np.testing.assert_allclose(dense[:, 5], np.log1p(rows % 7), rtol=1e-6)


def test_resume_equals_skipping(tmp_path):
    folder = _numbered(tmp_path / "n", [120, 80])
    src = BinarySource(folder, 10 ** 6, Split.parse("tail:0.25"))
    for rank in (0, 1):
        full = [_rows_of(x) for x, _ in zip(src.train_batches(rank, 2, 16), range(12))]
        resumed = [_rows_of(x) for x, _ in zip(src.train_batches(rank, 2, 16, start_step=7), range(5))]
        for a, b in zip(full[7:], resumed):
            np.testing.assert_array_equal(a, b)


def test_validation_rows_tail_split_and_cap(tmp_path):
    folder = _numbered(tmp_path / "n", [120, 80])
    src = BinarySource(folder, 10 ** 6, Split.parse("tail:0.25"))  # rows 150..199 validate
    assert src.num_train_rows() == 150
    got = {r: src.validation_batches(r, 3, 8) for r in range(3)}
    assert all(len(v) == 3 for v in got.values())  # ceil(ceil(50 / 3) / 8) = 3 on every rank
    for r, batches in got.items():
        real = np.concatenate([_rows_of(x)[:n] for x, n in batches])
        np.testing.assert_array_equal(real, np.arange(150, 200)[r::3])
        pad = np.concatenate([_rows_of(x)[n:] for x, n in batches])
        assert (pad == 150).all() and len(real) + len(pad) == 24
    train = np.concatenate([_rows_of(x) for x, _ in zip(src.train_batches(0, 1, 50), range(3))])
    np.testing.assert_array_equal(train, np.arange(150))
    capped = BinarySource(folder, 10 ** 6, Split.parse("tail:0.25"), max_val_rows=5)
    (x, n), = capped.validation_batches(0, 1, 8)
    assert n == 5 and _rows_of(x)[:5].tolist() == [150, 151, 152, 153, 154]
    with pytest.raises(NoUsableRowsError, match="validation split"):
        BinarySource(folder, 10, Split.parse("none")).validation_batches(0, 1, 8)


# ------------------------------------------------------------------------------------- bad input


def _copy(src_folder, dst):
    import shutil

    shutil.copytree(src_folder, dst)
    return str(dst)


def test_bad_layouts_name_the_file(binary_dir, tmp_path):
    folder, _ = binary_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"empty.*no PREFIX_dense\.npy.*empty binary data folder"):
        BinarySource(str(empty), 10, Split.parse("every:10"))
    with pytest.raises(FileNotFoundError, match="nowhere: binary data folder not found"):
        BinarySource(str(tmp_path / "nowhere"), 10, Split.parse("every:10"))

    d = _copy(folder, tmp_path / "missing")
    os.remove(os.path.join(d, "day_2_labels.npy"))
    with pytest.raises(FileNotFoundError, match=r"day_2_labels\.npy: missing array of the triplet "
                                                r"'day_2' \(present: day_2_dense\.npy, day_2_sparse\.npy\)"):
        BinarySource(d, 10, Split.parse("every:10"))

    d = _copy(folder, tmp_path / "rows")
    np.save(os.path.join(d, "day_10_labels.npy"), np.zeros((399, 1), dtype=np.int32))
    with pytest.raises(BinaryLayoutError, match=r"day_10_\*\.npy: row counts differ: dense 400, "
                                                r"sparse 400, labels 399"):
        BinarySource(d, 10, Split.parse("every:10"))

    cases = [
        ("day_0_dense.npy", np.zeros((300, 13), np.float64), r"day_0_dense\.npy: dtype float64, expected float32"),
        ("day_0_sparse.npy", np.zeros((300, 26), np.float32), r"day_0_sparse\.npy: dtype float32, expected int64"),
        ("day_0_labels.npy", np.zeros((300, 1), np.float32), r"day_0_labels\.npy: dtype float32, expected an integer"),
        ("day_0_labels.npy", np.zeros(300, np.int32), r"day_0_labels\.npy: shape \(300,\), expected 2-D"),
        ("day_0_labels.npy", np.zeros((300, 2), np.int32), r"day_0_labels\.npy: shape \(300, 2\), expected \[n, 1\]"),
        ("day_0_dense.npy", np.zeros((300, 12), np.float32),
         r"day_2_dense\.npy: 13 dense columns, but .*day_0_dense\.npy has 12"),
    ]
    for i, (name, arr, msg) in enumerate(cases):
        d = _copy(folder, tmp_path / f"case{i}")
        np.save(os.path.join(d, name), arr)
        with pytest.raises(BinaryLayoutError, match=msg):
            BinarySource(d, 10, Split.parse("every:10"))

    d = _copy(folder, tmp_path / "trunc")
    p = os.path.join(d, "day_2_sparse.npy")
    os.truncate(p, os.path.getsize(p) - 100)  # header 128 + 300 * 26 * 8 = 62528 bytes
    with pytest.raises(BinaryLayoutError, match=r"day_2_sparse\.npy: truncated: 62428 bytes, expected 62528"):
        BinarySource(d, 10, Split.parse("every:10"))

    d = _copy(folder, tmp_path / "garbage")
    with open(os.path.join(d, "day_0_dense.npy"), "wb") as f:
        f.write(b"not an npy file at all")
    with pytest.raises(BinaryLayoutError, match=r"day_0_dense\.npy: not a readable \.npy file"):
        BinarySource(d, 10, Split.parse("every:10"))

    with pytest.raises(BinaryLayoutError, match=r"num_embeddings has 2 entries for 26 categorical columns"):
        BinarySource(folder, [10, 10], Split.parse("every:10"))


def test_bad_values_name_file_and_row(tmp_path):
    cases = [("labels", lambda a: a.__setitem__((17, 0), 2), r"p1_labels\.npy: row 17: label 2, expected 0 or 1"),
             ("sparse", lambda a: a.__setitem__((3, 1), -4), r"p1_sparse\.npy: row 3: negative categorical value -4"),
             ("dense", lambda a: a.__setitem__((9, 2), np.nan), r"p1_dense\.npy: row 9: non-finite dense value")]
    for i, (kind, edit, msg) in enumerate(cases):
        folder = _numbered(tmp_path / f"v{i}", [40, 40])
        p = os.path.join(folder, f"p1_{kind}.npy")
        arr = np.load(p)
        edit(arr)
        np.save(p, arr)
        src = BinarySource(folder, 100, Split.parse("none"))
        it = src.train_batches(0, 1, 40)
        next(it)  # p0 is fine
        with pytest.raises(BinaryLayoutError, match=msg):
            next(it)
    folder = _numbered(tmp_path / "r", [40])  # raw values, not tsv_to_npys's log(x - m + 2) >= log 2
    np.save(os.path.join(folder, "p0_dense.npy"), np.zeros((40, 13), np.float32))
    with pytest.raises(BinaryLayoutError, match=r"p0_dense\.npy: row 0: dense value 0\.0 is not a "
                                                r"log\(x - m \+ 2\) of tsv_to_npys"):
        next(BinarySource(folder, 100, Split.parse("none")).train_batches(0, 1, 8))
    folder = _numbered(tmp_path / "z", [40])  # column minima all differ: no code of x = 0
    np.save(os.path.join(folder, "p0_dense.npy"),
            np.log(np.arange(2, 15, dtype=np.float32)[None, :].repeat(40, 0)))
    with pytest.raises(BinaryLayoutError, match=r"p0_dense\.npy: cannot find the stored code of x = 0"):
        next(BinarySource(folder, 100, Split.parse("none")).train_batches(0, 1, 8))
    assert next(BinarySource(folder, 100, Split.parse("none"), dense="stored").train_batches(0, 1, 8)) is not None


# ------------------------------------------------------------------------------------ job wiring


def test_make_source_and_steps_for_epochs(binary_dir):
    from torchrec_ftrl.job import cli
    from torchrec_ftrl.job.source import make_source, steps_for_epochs

    folder, tsv = binary_dir
    args = cli.parse_args(["--data", folder, "--num-embeddings", "500", "--epochs", "2"])
    src, desc = make_source(args)
    assert isinstance(src, BinarySource) and desc["kind"] == "binary" and src.num_embeddings == [500] * 26
    assert desc["prefixes"] == ["day_0", "day_2", "day_10"] and desc["dense"] == "text"
    assert steps_for_epochs(src, 2, 2, 64) == math.ceil(2 * 900 / 128)  # 15
    text, _ = make_source(cli.parse_args(["--data", tsv, "--epochs", "2"]))
    assert steps_for_epochs(text, 2, 2, 64) == 15
    with pytest.raises(SystemExit):
        cli.parse_args(["--data", folder, tsv])


def test_job_on_binary_folder(binary_dir, tmp_path):
    folder, _ = binary_dir
    p = run_job(["--data", folder, "--steps", "4", "--batch-size", "64", "--num-embeddings", "500",
                 "--no-progress", "--eval-every", "100", "--output-dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data: 1000 rows in 3 binary triplet(s)" in p.stdout and "data=binary" in p.stdout
    with open(tmp_path / "train_ctr_summary.json") as f:
        s = json.load(f)
    assert s["data"]["reader"]["validation_rows"] == 100 and s["final_validation"]["rows"] == 100
    with open(binary_dir[1]) as f:  # validation CTR of rows 10, 20, ..., counted from the text
        labels = [int(line.split("\t", 1)[0]) for i, line in enumerate(f) if i % 10 == 9]
    assert s["final_validation"]["ctr"] == pytest.approx(sum(labels) / 100, abs=1e-12)


def test_job_on_bad_folder_fails_in_one_line(binary_dir, tmp_path):
    folder, _ = binary_dir
    bad = _copy(folder, tmp_path / "bad")
    os.remove(os.path.join(bad, "day_0_sparse.npy"))
    p = run_job(["--data", bad, "--steps", "2", "--output-dir", str(tmp_path)])
    assert p.returncode == 2 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train_ctr: error: ") and "day_0_sparse.npy: missing array" in last
