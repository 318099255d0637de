#!/usr/bin/env python3
"""Reader throughput, rows/s in one process: the binary layout through ``BinarySource.train_batches``
against the raw TSV through ``FileSource.train_batches`` (the job's two file readers; the TSV with
``CTRFileReader``'s arrow parser and with its per-line Python parser), and the TSV -> binary
converter (``npy_convert.convert_file``, one preprocess worker).

    python benchmarks/bench_readers.py [--data TSV] [--rows 1048576] [--tsv-rows 131072]
                                       [--batch-size 8192] [--binary-dense text|stored] [--json PATH]

The Criteo sample (``$TORCHREC_FTRL_DATA/criteo/criteo_dac_combined.tsv`` by default) is repeated to
``--rows`` rows for the binary layout and ``--tsv-rows`` rows for the TSV in a temporary folder; the
split is the job's default ``every:10``; 26 tables of 10,000 rows. A timed pass reads every training
row once (``ceil(n_train / batch)`` batches) after one warm-up batch; the figure is the best of
``--repeats`` passes (one pass for the per-line TSV parser). The files were just written, so they are in
the page cache: this measures decoding and batch building, not the disk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(os.environ.get("TORCHREC_FTRL_DATA", os.path.join(REPO, "..", "shared", "data")),
                            "criteo", "criteo_dac_combined.tsv")


def _time_source(src, batch_size: int, repeats: int) -> tuple:
    """(best rows/s, batches per pass) of ``train_batches(0, 1, batch_size)``."""
    n_batches = math.ceil(src_train_rows(src) / batch_size)
    best = 0.0
    for _ in range(repeats):
        it = src.train_batches(0, 1, batch_size)
        next(it)  # warm-up: opens the maps / the file
        t0 = time.perf_counter()
        for _ in range(n_batches):
            next(it)
        best = max(best, n_batches * batch_size / (time.perf_counter() - t0))
    return best, n_batches


def src_train_rows(src) -> int:
    if hasattr(src, "num_train_rows"):
        return src.num_train_rows()
    n = src.reader.count_valid()
    return sum(1 for i in range(n) if not src.split.is_validation(i, n))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA, help="raw Criteo TSV to repeat")
    p.add_argument("--rows", type=int, default=1 << 20, help="rows of the binary layout")
    p.add_argument("--tsv-rows", type=int, default=1 << 17, help="rows of the TSV")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--binary-dense", choices=("text", "stored"), default="text")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)

    from torchrec_ftrl.data import BinarySource, CRITEO_SPEC, CTRFileReader, FileSource, Split
    from torchrec_ftrl.data.npy_convert import convert_file

    with open(a.data, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        tsv = os.path.join(tmp, "tiled.tsv")
        with open(tsv, "w", encoding="utf-8") as f:
            reps = math.ceil(a.tsv_rows / len(lines))
            f.writelines((lines * reps)[:a.tsv_rows])
        t0 = time.perf_counter()
        conv = convert_file(tsv, tmp, "tiled")
        convert_rows_s = conv.rows / (time.perf_counter() - t0)

        binary = os.path.join(tmp, "binary")
        os.makedirs(binary)
        for kind in ("dense", "sparse", "labels"):
            arr = np.load(os.path.join(tmp, f"tiled_{kind}.npy"))
            reps = math.ceil(a.rows / arr.shape[0])
            np.save(os.path.join(binary, f"sample_{kind}.npy"), np.tile(arr, (reps, 1))[:a.rows])
            del arr

        split = Split.parse("every:10")
        bin_src = BinarySource(binary, 10_000, split, dense=a.binary_dense)
        bin_rows_s, bin_batches = _time_source(bin_src, a.batch_size, a.repeats)
        arrow_src = FileSource(CTRFileReader(tsv, CRITEO_SPEC, 10_000, parser="arrow"), split)
        arrow_rows_s, tsv_batches = _time_source(arrow_src, a.batch_size, a.repeats)
        tsv_src = FileSource(CTRFileReader(tsv, CRITEO_SPEC, 10_000, parser="python"), split)
        tsv_rows_s, _ = _time_source(tsv_src, a.batch_size, 1)

    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), "
                   f"Python {platform.python_version()}, numpy {np.__version__}",
        "load_avg_1min_at_end": os.getloadavg()[0],
        "batch_size": a.batch_size, "split": "every:10", "num_embeddings": 10_000,
        "binary": {"rows": a.rows, "batches_per_pass": bin_batches, "dense": a.binary_dense,
                   "rows_per_s": bin_rows_s},
        "tsv_arrow": {"rows": a.tsv_rows, "batches_per_pass": tsv_batches, "rows_per_s": arrow_rows_s},
        "tsv": {"rows": a.tsv_rows, "batches_per_pass": tsv_batches, "rows_per_s": tsv_rows_s,
                "parser": "python"},
        "convert_tsv_to_binary": {"rows": conv.rows, "rows_per_s": convert_rows_s},
    }
    print(f"| reader | rows | rows/s (one process) |\n| --- | --- | --- |\n"
          f"| binary layout, BinarySource.train_batches (dense={a.binary_dense}) | {a.rows:,} | "
          f"{bin_rows_s:,.0f} |\n"
          f"| raw TSV, FileSource.train_batches (arrow parser) | {a.tsv_rows:,} | {arrow_rows_s:,.0f} |\n"
          f"| raw TSV, FileSource.train_batches (per-line parser) | {a.tsv_rows:,} | {tsv_rows_s:,.0f} |\n"
          f"| TSV -> binary, npy_convert.convert_file (one worker) | {conv.rows:,} | "
          f"{convert_rows_s:,.0f} |")
    print(f"batch {a.batch_size}, split every:10, {res['machine']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
