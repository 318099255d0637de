"""TorchRec's materialised multi-hot Criteo layout (``MultiHotBinarySource``) and the job on it.

Real data: the first 480 rows of the Criteo sample, cut into the 24 days ``day_0`` .. ``day_23``
(20 rows each) and converted with TorchRec's own ``BinaryCriteoUtils.tsv_to_npys``, then
materialised to multi-hot with MLPerf DLRM-DCNv2's multi-hot sizes and the preset's table sizes
capped at 1,000 rows. The materialising script (``torchrec_dlrm/scripts/
materialize_synthetic_multihot_dataset.py`` of github.com/facebookresearch/dlrm) is not part of the
torchrec package, so :func:`materialise` transcribes it (its ``Multihot`` lookup tables from
``torchrec_dlrm/multi_hot.py``, commit 090956e); ``test_transcription_writes_what_the_script_writes``
runs the script itself where the example is checked out (``$TORCHREC_DLRM_DIR``, or ``.anchor/``
from ``benchmarks/bench_torchrec_dlrm.py --extract``) and compares the files byte for byte.

Expected ids are read from the ``.npz`` files with ``np.load`` (which reads whole members; the
source memory-maps them at offsets it computes) and the training rows are picked by the split rule
written out here (``--split every:10``: row ``i`` validates when ``i % 10 == 9``).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_job
from torchrec_ftrl.data import (BinaryLayoutError, BinarySource, MultiHotBinarySource, Split,
                                train_loader)
from torchrec_ftrl.job import cli, validate
from torchrec_ftrl.job.errors import JobConfigError
from torchrec_ftrl.job.presets import MLPERF_DCNV2_MULTI_HOT, MLPERF_DCNV2_ROWS

DAYS, ROWS_PER_DAY = 24, 20
ROWS = [min(n, 1000) for n in MLPERF_DCNV2_ROWS]
NE_FLAG = ",".join(map(str, ROWS))


def materialise(onehot: str, out: str, rows, multi_hot) -> None:
    """What ``materialize_synthetic_multihot_dataset.py --copy_labels_and_dense`` writes (uniform
    distribution), transcribed: lookup table ``f`` is ``[arange(rows[f]) | randint(0, rows[f],
    (rows[f], multi_hot[f] - 1))]`` drawn after ``np.random.seed(0)``, int32; day ``i``'s member
    ``str(f)`` is table ``f`` looked up at ``sparse[:, f] % rows[f]``."""
    np.random.seed(0)
    tables = [np.concatenate((np.arange(n)[:, None], np.random.randint(0, n, size=(n, h - 1))),
                             axis=-1).astype(np.int32) for n, h in zip(rows, multi_hot)]
    os.makedirs(out, exist_ok=True)
    for i in range(DAYS):
        sparse = np.load(os.path.join(onehot, f"day_{i}_sparse.npy"), mmap_mode="r")
        np.savez(os.path.join(out, f"day_{i}_sparse_multi_hot.npz"),
                 **{str(f): t[sparse[:, f] % n] for f, (t, n) in enumerate(zip(tables, rows))})
        for part in ("labels", "dense"):
            shutil.copyfile(os.path.join(onehot, f"day_{i}_{part}.npy"),
                            os.path.join(out, f"day_{i}_{part}.npy"))


@pytest.fixture(scope="module")
def onehot(sample_data, tmp_path_factory):
    """The 24 one-hot day triplets, written by TorchRec's ``tsv_to_npys``."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    with open(sample_data("criteo", "criteo_dac_combined.tsv")) as f:
        lines = [line for _, line in zip(range(DAYS * ROWS_PER_DAY), f)]
    root = tmp_path_factory.mktemp("onehot")
    for i in range(DAYS):
        tsv = root / f"day_{i}.tsv"
        tsv.write_text("".join(lines[i * ROWS_PER_DAY:(i + 1) * ROWS_PER_DAY]))
        BinaryCriteoUtils.tsv_to_npys(str(tsv), *(str(root / f"day_{i}_{k}.npy")
                                                  for k in ("dense", "sparse", "labels")))
        tsv.unlink()
    return str(root)


@pytest.fixture(scope="module")
def multihot(onehot, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("multihot"))
    materialise(onehot, out, ROWS, MLPERF_DCNV2_MULTI_HOT)
    return out


def _npz_rows(folder, f, rows):
    """Feature ``f``'s bags ``[len(rows), h]`` of the global rows ``rows``, from ``np.load``."""
    whole = np.concatenate([np.load(os.path.join(folder, f"day_{i}_sparse_multi_hot.npz"))[str(f)]
                            for i in range(DAYS)])
    return whole[rows]


def _train_rows(n):
    """The first ``n`` training rows under ``--split every:10``."""
    return [i for i in range(DAYS * ROWS_PER_DAY) if i % 10 != 9][:n]


def test_first_batch_holds_the_npz_ids(multihot, onehot):
    args = cli.parse_args(["--preset", "mlperf-dcnv2", "--data", multihot, "--num-embeddings", NE_FLAG])
    src, desc = validate.build_source(args)
    assert isinstance(src, MultiHotBinarySource) and desc["kind"] == "binary-multi-hot"
    assert desc["multi_hot"] == list(MLPERF_DCNV2_MULTI_HOT)
    b = 32
    batch = next(train_loader(src, 0, 1, b, 0, 2, workers=1))   # built in a DataLoader worker
    kjt = batch.sparse_features
    assert kjt.keys() == [f"C{f + 1}" for f in range(26)] and kjt.stride() == b
    rows = _train_rows(b)
    for f, jt in enumerate(kjt.to_dict().values()):
        want = _npz_rows(multihot, f, rows)
        assert want.shape == (b, MLPERF_DCNV2_MULTI_HOT[f]) and want.max() < ROWS[f]
        assert jt.lengths().tolist() == [MLPERF_DCNV2_MULTI_HOT[f]] * b
        assert jt.values().tolist() == want.reshape(-1).tolist()
    # labels and dense are the one-hot folder's, as the one-hot reader gives them
    one = BinarySource(onehot, ROWS, Split.parse("every:10")).train_batch(0, 1, b, 0)
    assert batch.labels.tolist() == one.labels.tolist()
    assert batch.dense_features.tolist() == one.dense_features.tolist()


def test_ids_beyond_the_tables_are_taken_modulo(multihot):
    src = MultiHotBinarySource(multihot, 7, Split.parse("every:10"))
    values = src.train_batch(0, 1, 16, 0).sparse_features.values().numpy()
    want = np.concatenate([_npz_rows(multihot, f, _train_rows(16)).reshape(-1) % 7 for f in range(26)])
    assert values.tolist() == want.tolist()


def test_job_trains_on_the_multi_hot_folder(multihot, tmp_path):
    steps, b = 3, 32
    p = run_job(["--preset", "mlperf-dcnv2", "--data", multihot, "--num-embeddings", NE_FLAG,
                 "--embedding-dim", "16", "--batch-size", str(b), "--steps", str(steps),
                 "--no-progress", "--eval-every", str(steps), "--output-dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "data=binary-multi-hot" in p.stdout and "data: 480 rows in 24 binary triplet(s)" in p.stdout
    with open(tmp_path / "train_ctr_summary.json") as f:
        s = json.load(f)
    assert s["data"]["multi_hot"] == list(MLPERF_DCNV2_MULTI_HOT)
    rows = _train_rows(steps * b)   # every bag of the trained rows touches its ids
    for f in range(26):
        touched = len(np.unique(_npz_rows(multihot, f, rows)))
        assert s["sparsity"][f"t_C{f + 1}"]["touched_rows"] == touched, f


def test_sizes_that_differ_are_refused_in_one_line(onehot, tmp_path):
    other = str(tmp_path / "mh2")
    materialise(onehot, other, ROWS, [2] * 26)
    p = run_job(["--preset", "mlperf-dcnv2", "--data", other, "--num-embeddings", NE_FLAG,
                 "--output-dir", str(tmp_path / "out")])
    assert p.returncode == 2 and "Traceback" not in p.stderr and not (tmp_path / "out").exists()
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"train_ctr: error: --data {other} holds multi-hot sizes {','.join(['2'] * 26)} "
                    f"({other}/day_0_sparse_multi_hot.npz), but --multi-hot-sizes is "
                    f"{','.join(map(str, MLPERF_DCNV2_MULTI_HOT))} (from --preset mlperf-dcnv2)")
    args = cli.parse_args(["--data", other, "--num-embeddings", NE_FLAG, "--multi-hot-sizes", "3"])
    with pytest.raises(JobConfigError, match=r"holds multi-hot sizes 2,2,.*but --multi-hot-sizes is 3$"):
        validate.build_source(args)
    assert validate.build_source(cli.parse_args(["--data", other, "--multi-hot-sizes", "2",
                                                 "--num-embeddings", NE_FLAG]))[0].multi_hot == (2,) * 26


def test_which_layout_a_folder_gives(onehot, multihot, tmp_path, capsys):
    both = str(tmp_path / "both")   # materialised in place: the npz next to the one-hot sparse.npy
    shutil.copytree(onehot, both)
    for name in os.listdir(multihot):
        if name.endswith(".npz"):
            shutil.copy(os.path.join(multihot, name), both)

    def kind(*flags):
        return validate.build_source(cli.parse_args(["--num-embeddings", NE_FLAG, *flags]))[1]["kind"]

    assert kind("--data", multihot) == "binary-multi-hot"         # its own sizes
    assert kind("--data", both) == "binary"                       # one-hot unless asked
    assert kind("--data", both, "--preset", "mlperf-dcnv2") == "binary-multi-hot"
    assert kind("--data", both, "--multi-hot-sizes", ",".join(map(str, MLPERF_DCNV2_MULTI_HOT))) \
        == "binary-multi-hot"
    assert kind("--data", onehot, "--preset", "mlperf-dcnv2") == "binary"
    with pytest.raises(SystemExit):
        cli.parse_args(["--data", onehot, "--multi-hot-sizes", "2"])
    assert "--multi-hot-sizes needs --synthetic uniform or zipf (no --data) or a --data folder in " \
           "TorchRec's materialised multi-hot layout" in capsys.readouterr().err
    with pytest.raises(JobConfigError, match="--zch needs raw ids"):
        validate.build_source(cli.parse_args(["--data", multihot, "--zch"]))


def test_bad_multi_hot_folders_name_the_file(multihot, tmp_path):
    def copy(name, day=None, edit=None, save=np.savez):
        """A copy of the folder whose ``day``'s npz members are rewritten by ``edit`` with ``save``."""
        dst = str(tmp_path / name)
        shutil.copytree(multihot, dst)
        if edit is not None:
            path = os.path.join(dst, f"day_{day}_sparse_multi_hot.npz")
            members = dict(np.load(path))
            edit(members)
            save(path, **members)
        return dst

    def source(folder):
        return MultiHotBinarySource(folder, ROWS, Split.parse("every:10"))

    no_dense = copy("no_dense")
    os.remove(os.path.join(no_dense, "day_3_dense.npy"))
    with pytest.raises(FileNotFoundError,
                       match=r"day_3_dense\.npy: missing array .*--copy_labels_and_dense"):
        source(no_dense)
    with pytest.raises(BinaryLayoutError,
                       match=r"day_5_sparse_multi_hot\.npz: member 0\.npy is compressed"):
        source(copy("compressed", 5, lambda m: None, np.savez_compressed))
    with pytest.raises(BinaryLayoutError,
                       match=r"day_7_sparse_multi_hot\.npz: multi-hot sizes 3,2,1,2,2,"):
        source(copy("sizes", 7, lambda m: m.update({"4": m["4"][:, :2]})))
    negative = source(copy("negative", 0, lambda m: m["20"].__setitem__((4, 7), -5)))
    with pytest.raises(BinaryLayoutError, match=r"day_0_sparse_multi_hot\.npz: row 4: negative id -5 "
                                                r"of feature 20 \(member 20\.npy\)"):
        negative.train_batch(0, 1, 8, 0)


def _example_dir():
    for d in (os.environ.get("TORCHREC_DLRM_DIR"), os.path.join(REPO, ".anchor", "torchrec_dlrm")):
        if d and os.path.isfile(os.path.join(d, "scripts", "materialize_synthetic_multihot_dataset.py")):
            return d
    return None


@pytest.mark.skipif(_example_dir() is None, reason="TorchRec's DLRM example is not checked out "
                    "(set TORCHREC_DLRM_DIR, or run benchmarks/bench_torchrec_dlrm.py --extract)")
def test_transcription_writes_what_the_script_writes(onehot, multihot, tmp_path):
    out = tmp_path / "script"
    script = os.path.join(_example_dir(), "scripts", "materialize_synthetic_multihot_dataset.py")
    p = subprocess.run([sys.executable, script, "--in_memory_binary_criteo_path", onehot,
                        "--output_path", str(out), "--copy_labels_and_dense",
                        "--num_embeddings_per_feature", NE_FLAG,
                        "--multi_hot_sizes", ",".join(map(str, MLPERF_DCNV2_MULTI_HOT))],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(os.listdir(multihot))
    for name in os.listdir(out):
        with open(out / name, "rb") as a, open(os.path.join(multihot, name), "rb") as b:
            assert a.read() == b.read(), name
