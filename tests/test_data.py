"""CTR data layer: raw Criteo reader on the real sample, hashing, log transform, malformed rows,
column-spec mode on the real Avazu sample, splits, rank sharding, and the synthetic generator.

Expected values come from the data README (row and label counts), from an independent csv-module
parse of the same files, or are hand-computed literals (noted inline). The sample files are read from
``$TORCHREC_FTRL_DATA`` (default ``../shared/data``, fixture ``sample_data`` of tests/conftest.py); the
tests that need one are skipped without it.
"""

import csv

import numpy as np
import pytest
import torch

from torchrec_ftrl.data import (AVAZU_SPEC, CRITEO_SPEC, ColumnSpec, CTRFileReader, FileSource,
                                MalformedRowError, Split, SyntheticCTR, SyntheticSource, make_batch)



@pytest.fixture(scope="module")
def criteo(sample_data):
    """The Criteo sample (``$TORCHREC_FTRL_DATA/criteo``); the test is skipped without it."""
    return sample_data("criteo", "criteo_dac_combined.tsv")


@pytest.fixture(scope="module")
def avazu(sample_data):
    return sample_data("avazu", "avazu_train_head9999.csv")


@pytest.fixture(scope="module")
def criteo_rows(criteo):
    r = CTRFileReader(criteo, CRITEO_SPEC, 1000)
    return r, list(r)


def test_criteo_counts_match_readme(criteo_rows):
    reader, rows = criteo_rows
    assert len(rows) == 6726
    labels = [r.label for r in rows]
    assert labels.count(0) == 5142 and labels.count(1) == 1584
    assert reader.stats.valid == 6726 and reader.stats.malformed == 0
    assert all(len(r.dense) == 13 and len(r.ids) == 26 for r in rows)


def test_criteo_hashing_range_and_missing(criteo, criteo_rows):
    _, rows = criteo_rows
    ids = np.array([r.ids for r in rows])
    assert ids.max() < 1000 and ids.min() >= -1
    # independent parse: empty categorical fields per column
    with open(criteo, newline="") as f:
        fields = [line.rstrip("\n").split("\t") for line in f]
    empty = np.array([[row[14 + j] == "" for j in range(26)] for row in fields])
    assert np.array_equal(ids == -1, empty)
    # C22 is empty in 77.3% of rows (README)
    assert abs((ids[:, 21] == -1).mean() - 0.773) < 0.0005
    # hand-computed: 0x68fd1e64 = 1761418852, 1761418852 mod 1000 = 852 (row 1, C1)
    assert rows[0].ids[0] == 852
    # per-column table sizes: 0x68fd1e64 mod 7 = 1761418852 - 7*251631264 = 4
    r7 = CTRFileReader(criteo, CRITEO_SPEC, [7] + [1000] * 25)
    first = next(iter(r7))
    assert first.ids[0] == 4 and first.ids[1:] == rows[0].ids[1:]


def test_criteo_log_transform_hand_values(criteo_rows):
    _, rows = criteo_rows
    # line 1 dense: 1 1 5 0 1382 4 15 2 181 1 2 '' 2  -> log(1 + x), natural log, '' -> 0
    expect = [0.6931471805599453, 0.6931471805599453, 1.791759469228055, 0.0, 7.232010331664759,
              1.6094379124341003, 2.772588722239781, 1.0986122886681098, 5.204006687076795,
              0.6931471805599453, 1.0986122886681098, 0.0, 1.0986122886681098]
    np.testing.assert_allclose(rows[0].dense, expect, rtol=1e-12)
    # line 5 dense: 3 -1 '' 0 2 0 3 0 0 1 1 '' 0 -> negative I2 clips to log(1) = 0
    np.testing.assert_allclose(rows[4].dense[:3], [1.3862943611198906, 0.0, 0.0], rtol=1e-12)


def _write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return str(p)


def _criteo_line(label="1", dense=None, cats=None):
    dense = dense if dense is not None else ["1"] * 13
    cats = cats if cats is not None else ["0000000a"] * 26
    return "\t".join([label, *dense, *cats])


def test_malformed_rows_counted_and_skipped(tmp_path):
    good = _criteo_line()
    lines = [
        good,
        "\t".join(good.split("\t")[:-1]),             # 39 fields
        _criteo_line(dense=["1.5"] + ["1"] * 12),     # non-integer dense
        _criteo_line(cats=["zz00ff00"] + ["0a"] * 25),  # non-hex categorical
        _criteo_line(label="2"),                       # bad label
        "",                                            # blank: ignored, not malformed
        _criteo_line(label="0", dense=[""] * 13, cats=[""] * 26),  # all missing: valid
    ]
    path = _write(tmp_path, "bad.tsv", lines)
    r = CTRFileReader(path, CRITEO_SPEC, 100)
    rows = list(r)
    assert len(rows) == 2
    assert rows[1].ids == [-1] * 26 and rows[1].dense == [0.0] * 13
    assert rows[0].ids == [10] * 26  # 0x0a = 10
    assert r.stats.malformed == 4 and r.stats.blank == 1
    assert dict(r.stats.reasons) == {"field_count": 1, "dense": 1, "categorical": 1, "label": 1}
    assert f"{path}:2:" in r.stats.examples[0]
    assert "4 malformed" in r.stats.summary()


def test_strict_mode_names_file_and_line(tmp_path):
    path = _write(tmp_path, "bad.tsv", [_criteo_line(), _criteo_line(), _criteo_line(dense=["x"] * 13)])
    r = CTRFileReader(path, CRITEO_SPEC, 100, strict=True)
    with pytest.raises(MalformedRowError, match=rf"{path}:3: malformed row \(dense\)"):
        list(r)


def test_missing_file_is_clear_error(tmp_path):
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match="CTR data file not found.*nope.tsv"):
        CTRFileReader(missing, CRITEO_SPEC, 100)


def test_bad_arguments_raise_value_error(tmp_path):
    path = _write(tmp_path, "ok.tsv", [_criteo_line()])
    with pytest.raises(ValueError, match="num_embeddings has 3 entries for 26"):
        CTRFileReader(path, CRITEO_SPEC, [10, 10, 10])
    with pytest.raises(ValueError, match="num_embeddings entries must be ints >= 1"):
        CTRFileReader(path, CRITEO_SPEC, 0)
    with pytest.raises(ValueError, match="categorical_encoding"):
        ColumnSpec(label=0, categorical=(1,), categorical_encoding="base64")
    with pytest.raises(ValueError, match="header=False"):
        ColumnSpec(label="click", categorical=(1,))
    with pytest.raises(ValueError, match="split every:k needs an integer k >= 2"):
        Split.parse("every:1")
    with pytest.raises(ValueError, match="a split looks like"):
        Split.parse("10")


def test_column_spec_mode_on_avazu(avazu):
    with open(avazu, newline="") as f:
        table = list(csv.reader(f))
    header, body = table[0], table[1:]
    n = 2 ** 31 - 1  # large table: hashing collisions among a few thousand values are negligible
    r = CTRFileReader(avazu, AVAZU_SPEC, n)
    rows = list(r)
    assert len(rows) == 9999 == len(body)
    labels = [x.label for x in rows]
    assert labels.count(0) == 8293 and labels.count(1) == 1706
    assert r.categorical_names[3] == "site_id" and all(x.dense == [] for x in rows)
    site = header.index("site_id")
    assert len({x.ids[3] for x in rows}) == len({b[site] for b in body}) == 381
    # the same spec written as JSON (by column index, no names) gives identical rows
    cols = [header.index(c) for c in AVAZU_SPEC.categorical]
    js = ('{"label": 1, "categorical": %s, "delimiter": ",", "header": true}' % cols)
    rows2 = list(CTRFileReader(avazu, ColumnSpec.from_json(js), n))
    assert [x.ids for x in rows2] == [x.ids for x in rows]
    assert [x.label for x in rows2] == labels


def test_split_and_rank_sharding(criteo_rows):
    reader, rows = criteo_rows
    assert sum(Split.parse("every:10").is_validation(i) for i in range(6726)) == 672
    assert Split.parse("tail:0.1").first_validation_index(6726) == 6726 - 673  # ceil(672.6)
    src = FileSource(reader, Split.parse("every:10"))
    train = [r for i, r in enumerate(rows) if i % 10 != 9]  # 6054 rows
    b = 256
    got = []
    for rank in (0, 1):
        it = src.train_batches(rank, 2, b)
        batches = [next(it) for _ in range(12)]  # 3027 rows per rank -> 11 full batches per epoch
        assert all(x.labels.shape == (b,) and x.dense_features.shape == (b, 13) for x in batches)
        got.append(torch.cat([x.labels for x in batches[:11]]))
        mine = [r for t, r in enumerate(train) if t % 2 == rank][: 11 * b]
        assert torch.equal(got[rank], torch.tensor([float(r.label) for r in mine]))
        # resume: start_step=5 continues exactly at batch 5
        it5 = src.train_batches(rank, 2, b, start_step=5)
        assert torch.equal(next(it5).labels, batches[5].labels)
    v0, v1 = src.validation_batches(0, 2, b), src.validation_batches(1, 2, b)
    assert len(v0) == len(v1) == 2  # ceil(336 / 256)
    assert sum(n for _, n in v0 + v1) == 672


def test_make_batch_kjt_layout():
    ids = np.array([[3, -1], [5, 7], [-1, 9]])
    b = make_batch(np.array([1, 0, 1]), np.zeros((3, 2)), ids, ["a", "b"])
    kjt = b.sparse_features
    assert kjt.keys() == ["a", "b"]
    assert kjt.lengths().tolist() == [1, 1, 0, 0, 1, 1]
    assert kjt.values().tolist() == [3, 5, 7, 9]
    assert b.labels.dtype == torch.float32 and b.labels.tolist() == [1.0, 0.0, 1.0]


def test_synthetic_is_deterministic_and_learnable():
    from torchmetrics.functional.classification import binary_auroc

    g1, g2 = SyntheticCTR(5000, seed=3), SyntheticCTR(5000, seed=3)
    b1, b2 = g1.batch("train", 7, 64), g2.batch("train", 7, 64)
    assert torch.equal(b1.dense_features, b2.dense_features)
    assert torch.equal(b1.sparse_features.values(), b2.sparse_features.values())
    assert torch.equal(b1.sparse_features.lengths(), b2.sparse_features.lengths())
    assert torch.equal(b1.labels, b2.labels)
    other = SyntheticCTR(5000, seed=4).batch("train", 7, 64)
    assert not torch.equal(b1.sparse_features.values(), other.sparse_features.values())
    assert not torch.equal(g1.batch("val", 7, 64).dense_features, b1.dense_features)
    assert b1.sparse_features.values().max() < 5000 and b1.sparse_features.values().min() >= 0

    labels, _, _, logit = g1.arrays("train", 0, 20000)
    assert 0.1 < labels.mean() < 0.4
    assert float(binary_auroc(torch.tensor(logit), torch.tensor(labels))) > 0.8  # planted signal
    flat = SyntheticCTR(5000, seed=3, signal=0.0)
    labels0, _, ids0, _ = flat.arrays("train", 0, 20000)
    # no signal: a feature's value says nothing about the label
    score = torch.tensor((ids0[:, 0] % 97).astype(np.float64))
    assert abs(float(binary_auroc(score, torch.tensor(labels0))) - 0.5) < 0.03

    src = SyntheticSource(g1, val_batches=2)
    r0 = next(src.train_batches(0, 2, 16, start_step=3))
    assert torch.equal(r0.labels, g1.batch("train", 3 * 2 + 0, 16).labels)
