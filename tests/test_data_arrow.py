"""The arrow parser of CTRFileReader against the per-line parser (the readable specification).

On the real Criteo / Avazu / MovieLens samples and on crafted files with every malformed-row kind,
header lines, CRLF and lone CR line ends, blank lines, empty fields, a byte-order mark, invalid UTF-8
and values outside the vectorised fast paths, both parsers must give equal rows (labels, dense bits,
ids), equal ``ReadStats`` and, under ``strict``, the same rows before the same error message. Small
``chunk_bytes`` put chunk boundaries everywhere. A few expected values are computed here from the
text (``int(hex, 16)``, ``math.log1p``, BLAKE2b), not read back from the package.
"""

import csv
import hashlib
import math
import struct
import warnings

import pytest
import torch

pytest.importorskip("pyarrow")

from torchrec_ftrl.data import (AVAZU_SPEC, CRITEO_SPEC, ColumnSpec, CTRFileReader, FileSource,  # noqa: E402
                                MalformedRowError, Split)
from torchrec_ftrl.data import reader as reader_mod  # noqa: E402


def _bits(rows):
    """Rows as comparable tuples, dense values by their float64 bits (so -0.0 != 0.0)."""
    return [(r.label, tuple(struct.pack("<d", x) for x in r.dense), tuple(r.ids)) for r in rows]


def _run(paths, spec, ne, strict=False, **kw):
    """``(rows, stats dict, error message or None)`` of one full pass."""
    r = CTRFileReader(paths, spec, ne, strict=strict, **kw)
    rows, err = [], None
    try:
        for row in r:
            rows.append(row)
    except MalformedRowError as e:
        err = str(e)
    return _bits(rows), r.stats.to_dict(), err


def assert_same(paths, spec, ne, chunk_sizes=(8 << 20, 97, 1)):
    """Both parsers agree, lenient and strict, at several chunk sizes; returns the per-line result."""
    want = _run(paths, spec, ne, parser="python")
    want_strict = _run(paths, spec, ne, strict=True, parser="python")
    for cb in chunk_sizes:
        got = _run(paths, spec, ne, parser="arrow", chunk_bytes=cb)
        assert got[0] == want[0], f"rows differ (chunk_bytes={cb})"
        assert got[1] == want[1], f"stats differ (chunk_bytes={cb})"
        got_strict = _run(paths, spec, ne, strict=True, parser="arrow", chunk_bytes=cb)
        assert got_strict == want_strict, f"strict pass differs (chunk_bytes={cb})"
    return want, want_strict


# ------------------------------------------------------------------------------------- real samples


def test_criteo_sample_equal_and_hand_values(sample_data):
    path = sample_data("criteo", "criteo_dac_combined.tsv")
    (rows, stats, _), _ = assert_same(path, CRITEO_SPEC, [7] + [1000] * 25, chunk_sizes=(8 << 20, 50_000))
    assert stats["valid"] == 6726 and stats["malformed"] == 0
    # independent: the first 200 lines parsed here with int(), math.log1p and int(v, 16)
    got = CTRFileReader(path, CRITEO_SPEC, [7] + [1000] * 25, parser="arrow")
    with open(path, newline="") as f:
        text = [line.rstrip("\n").split("\t") for _, line in zip(range(200), f)]
    seen = 0
    for row, fields in zip(got, text):
        assert row.label == int(fields[0])
        assert row.dense == [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]]
        assert row.ids == [int(v, 16) % (7 if j == 0 else 1000) if v else -1
                           for j, v in enumerate(fields[14:])]
        seen += 1
    assert seen == 200


def test_avazu_sample_equal_and_blake2b(sample_data):
    path = sample_data("avazu", "avazu_train_head9999.csv")
    (rows, stats, _), _ = assert_same(path, AVAZU_SPEC, 1 << 20, chunk_sizes=(8 << 20, 100_000))
    assert stats["valid"] == 9999
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    header, first = table[0], table[1]
    site = first[header.index("site_id")]
    expect = int.from_bytes(hashlib.blake2b(site.encode(), digest_size=8).digest(), "little") % (1 << 20)
    row0 = next(iter(CTRFileReader(path, AVAZU_SPEC, 1 << 20, parser="arrow")))
    assert row0.ids[3] == expect and row0.label == int(first[header.index("click")])


def test_kaggle_csv_by_header_names(sample_data):
    path = sample_data("criteo", "kaggle2014_tr.r100000.csv")
    spec = ColumnSpec(label="Label", dense=tuple(f"I{i}" for i in range(1, 14)),
                      categorical=tuple(f"C{i}" for i in range(1, 27)), delimiter=",", header=True,
                      categorical_encoding="hex", dense_type="int")
    (rows, stats, _), _ = assert_same(path, spec, 5000, chunk_sizes=(8 << 20, 4000))
    assert stats["valid"] == 403


def test_movielens_mostly_malformed_labels(sample_data, tmp_path):
    """u.data's rating as the label (its first 20,000 lines): only rating-1 rows are valid, the
    others are malformed labels, so most rows go through the per-line fallback."""
    with open(sample_data("movielens", "ml-100k_u.data"), newline="") as f:
        head = [line for _, line in zip(range(20_000), f)]
    path = str(tmp_path / "u.data")
    with open(path, "w", newline="") as f:
        f.writelines(head)
    spec = ColumnSpec(label=2, dense=(3,), categorical=(0, 1), dense_type="float",
                      dense_transform="none")
    want = _run(path, spec, 2000, parser="python")
    assert _run(path, spec, 2000, parser="arrow", chunk_bytes=100_000) == want
    ones = sum(line.split("\t")[2] == "1" for line in head)  # independent count
    assert want[1]["valid"] == ones and want[1]["reasons"] == {"label": 20_000 - ones}
    first = head[0].split("\t")[2]
    assert want[1]["examples"][0] == f"{path}:1: label must be 0 or 1, got '{first}'"
    assert _run(path, spec, 2000, strict=True, parser="arrow")[2] == \
        f"{path}:1: malformed row (label): label must be 0 or 1, got '{first}'"
    # independent values of the valid rows: the timestamp as a float, ids as BLAKE2b of the text
    valid = [line.rstrip("\n").split("\t") for line in head if line.split("\t")[2] == "1"]
    rows = list(CTRFileReader(path, spec, 2000, parser="arrow"))
    assert [r.dense for r in rows] == [[float(v[3])] for v in valid]
    h = int.from_bytes(hashlib.blake2b(valid[0][0].encode(), digest_size=8).digest(), "little") % 2000
    assert rows[0].ids[0] == h


# ------------------------------------------------------------------------------------ crafted files


def _line(label="1", dense=None, cats=None):
    dense = dense if dense is not None else ["1"] * 13
    cats = cats if cats is not None else ["0000000a"] * 26
    return "\t".join([label, *dense, *cats])


def _d(v, j=0):
    """13 dense fields with ``v`` at position ``j`` (the others "2")."""
    return ["2"] * j + [v] + ["2"] * (12 - j)


def _c(v, j=0):
    return ["68fd1e64"] * j + [v] + ["68fd1e64"] * (25 - j)


CRITEO_LINES = [
    _line(),
    "\t".join(_line().split("\t")[:-1]),                       # 39 fields
    _line() + "\textra",                                       # 41 fields
    _line(label="2"), _line(label=""), _line(label="1.0"), _line(label=" 0"), _line(label="nan"),
    _line(label="0.5"), _line(label="-0"), _line(label="1e0"),
    _line(dense=_d("1.5")), _line(dense=_d("x", 3)), _line(dense=_d(" 5")), _line(dense=_d("+5", 12)),
    _line(dense=_d("1_0")), _line(dense=_d("\u0663")), _line(dense=_d("0x10")), _line(dense=_d("-0")),
    _line(dense=_d("007")), _line(dense=_d("-17")), _line(dense=_d("123456789012345678901")),
    _line(dense=_d("65535")), _line(dense=_d("65536")), _line(dense=_d("9999999")), _line(dense=_d("-")),
    _line(dense=_d("1-2")), _line(dense=_d("")),
    _line(cats=_c("zz00ff00")), _line(cats=_c("0x1f", 5)), _line(cats=_c("1_f")), _line(cats=_c("+1f")),
    _line(cats=_c(" 1f")), _line(cats=_c("ABCDEF12")), _line(cats=_c("1f", 25)), _line(cats=_c("abc")),
    _line(cats=_c("00000000000000001f")), _line(cats=_c("ffffffffffffffff")), _line(cats=_c("f" * 17)),
    _line(cats=_c("-1f")), _line(cats=_c("\u0663")), _line(cats=_c("")),
    _line(label="0", dense=[""] * 13, cats=[""] * 26),         # all missing: valid
    "\t" * 39,                                                 # 40 empty fields: bad label
    "", "   ", "\t",
    _line(label="2", dense=_d("x")),                           # two faults: label is checked first
    _line(dense=_d("x"), cats=_c("zz")),                       # dense before categorical
]


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
def test_crafted_criteo_every_rule(tmp_path, ending):
    p = tmp_path / "c.tsv"
    p.write_bytes((ending.join(CRITEO_LINES) + ending).encode())
    (rows, stats, _), (srows, sstats, err) = assert_same(str(p), CRITEO_SPEC, 1000)
    assert set(stats["reasons"]) == {"field_count", "label", "dense", "categorical"}
    assert stats["blank"] == 1 and err == f"{p}:2: malformed row (field_count): expected 40 fields, got 39"
    # hand-computed values of a few lines
    assert rows[0][2] == tuple([10] * 26)
    assert len(srows) == 1 and sstats["lines"] == 2 and sstats["valid"] == 1


def test_crafted_invalid_utf8_bom_and_no_final_newline(tmp_path):
    good = _line().encode()
    body = [good, _line(cats=_c("\xff")).encode("latin-1"), good.replace(b"0000000a", b"\xe2\x82", 1),
            b"\xff\xfe\tshort", b"", good]
    p = tmp_path / "u.tsv"
    p.write_bytes(b"\n".join(body))  # no final newline
    (rows, stats, _), _ = assert_same(str(p), CRITEO_SPEC, 1000)
    assert stats["malformed"] == 3 and stats["valid"] == 2
    assert "not a hex value: '\ufffd'" in stats["examples"][0]  # U+FFFD, as the text reader decodes it
    bom = tmp_path / "bom.tsv"
    bom.write_bytes(b"\xef\xbb\xbf" + b"\n".join([good, good]) + b"\n")
    (_, stats, _), _ = assert_same(str(bom), CRITEO_SPEC, 1000)
    assert stats["reasons"] == {"label": 1} and stats["valid"] == 1  # the BOM stays in field 0


def test_crafted_string_spec_header_files_and_floats(tmp_path):
    spec = ColumnSpec.from_json('{"label": "y", "dense": ["a", "b"], "categorical": ["s", "t"], '
                                '"delimiter": ",", "header": true, "dense_type": "float"}')
    raw = ColumnSpec(label="y", dense=("a", "b"), categorical=("s", "t"), delimiter=",", header=True,
                     dense_type="float", dense_transform="none")
    values = ["1.5", "-0.0", "-0", ".5", "5.", "+.5e-3", "1e308", "1e400", "1e-400", "inf", "-inf",
              "nan", " 2.5", "1_0.5", "0x1p3", "4.9e-324", "0.1", "123456789012345678901234567890",
              "1e", "e5", "", "abc", "1.7976931348623157e308"]
    lines = ["y,a,b,s,t"] + [f"1,{v},3,k{i},\"q{i % 3}\"" for i, v in enumerate(values)]
    lines += ["0,1,2,,", "0,1,2", "1,1,2,\xe9t\xe9,x", "1,1,2,a,b,c", "", "\r"]
    p1, p2 = tmp_path / "a.csv", tmp_path / "b.csv"
    p1.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    p2.write_bytes(b"y,a,b,s,t\n0,7,8,\xff\xfez,w\n1,-3,4,z,w\n")  # invalid UTF-8 -> U+FFFD text hashed
    for s in (spec, raw):
        (rows, stats, _), _ = assert_same([str(p1), str(p2)], s, 1 << 40)
        assert stats["reasons"] == {"dense": 8, "field_count": 2}  # inf, -inf, nan, 1e400, 0x1p3, 1e, e5, abc
    # independent: 'k0' hashed here
    row0 = next(iter(CTRFileReader(str(p1), raw, 1 << 40, parser="arrow")))
    assert row0.ids[0] == int.from_bytes(hashlib.blake2b(b"k0", digest_size=8).digest(), "little") % (1 << 40)
    assert row0.dense == [1.5, 3.0]


def test_one_field_rows_and_header_only_files(tmp_path):
    spec = ColumnSpec(label=0, categorical=(0,))
    p = tmp_path / "one.txt"
    p.write_text("1\n0\n\n2\n1\t1\n1")
    assert_same(str(p), spec, 10)
    h = tmp_path / "h.csv"
    h.write_text("y,s")
    hs = ColumnSpec(label="y", categorical=("s",), delimiter=",", header=True)
    (rows, stats, _), _ = assert_same([str(h), str(h)], hs, 10)
    assert rows == [] and stats["lines"] == 0


# ----------------------------------------------------------------------------- engine and sources


def test_engine_choice_and_missing_pyarrow(tmp_path, monkeypatch):
    p = tmp_path / "x.tsv"
    p.write_text(_line() + "\n")
    assert CTRFileReader(str(p), CRITEO_SPEC, 10).engine == "arrow"
    two = ColumnSpec(label=0, categorical=(1,), delimiter="::")
    assert CTRFileReader(str(p), two, 10).engine == "python"
    with pytest.raises(ValueError, match="arrow parser cannot read.*'::'"):
        CTRFileReader(str(p), two, 10, parser="arrow")
    with pytest.raises(ValueError, match="parser must be one of"):
        CTRFileReader(str(p), CRITEO_SPEC, 10, parser="fast")
    monkeypatch.setattr(reader_mod, "arrow_importable", lambda: False)
    monkeypatch.setattr(reader_mod, "_warned_no_arrow", False)
    with pytest.warns(RuntimeWarning, match="pyarrow is not importable"):
        r = CTRFileReader(str(p), CRITEO_SPEC, 10)
    assert r.engine == "python" and len(list(r)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one-time: no second warning
        assert CTRFileReader(str(p), CRITEO_SPEC, 10).engine == "python"
    with pytest.raises(ImportError, match="needs pyarrow"):
        CTRFileReader(str(p), CRITEO_SPEC, 10, parser="arrow")


def _batches_equal(a, b):
    return (torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
            and torch.equal(a.sparse_features.values(), b.sparse_features.values())
            and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths()))


@pytest.mark.parametrize("split", ["every:10", "tail:0.1"])
def test_file_source_same_batches(tmp_path, sample_data, split):
    path = sample_data("criteo", "criteo_dac_combined.tsv")
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(CRITEO_LINES) + "\n")
    srcs = [FileSource(CTRFileReader([path, str(bad)], CRITEO_SPEC, 1000, parser=p, chunk_bytes=cb),
                       Split.parse(split), max_val_rows=500) for p, cb in (("python", 1 << 20),
                                                                           ("arrow", 300_000))]
    for rank in (0, 1):
        its = [s.train_batches(rank, 2, 256, start_step=3) for s in srcs]
        for _ in range(15):  # past one epoch (3,000+ rows per rank)
            assert _batches_equal(next(its[0]), next(its[1]))
        va, vb = (s.validation_batches(rank, 2, 128) for s in srcs)
        assert [n for _, n in va] == [n for _, n in vb]
        assert all(_batches_equal(x, y) for (x, _), (y, _) in zip(va, vb))
    assert srcs[0].stats().to_dict() == srcs[1].stats().to_dict()
    assert srcs[0].reader.count_valid() == srcs[1].reader.count_valid()
