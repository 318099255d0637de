"""``python -m torchrec_ftrl.data.preprocess IN... --out DIR [--workers N] [--format tsv|kaggle-csv]``:
convert raw Criteo files to TorchRec's binary layout (one ``PREFIX_{dense,sparse,labels}.npy``
triplet per input file, see :mod:`.npy_layout`), in parallel over files.

``PREFIX`` is the input's file name without ``.gz`` and then without ``.tsv`` / ``.txt`` / ``.csv``
(``day_0.gz`` -> ``day_0``). A process pool of ``--workers`` processes converts one file each at a
time (:func:`.npy_convert.convert_file`); a tqdm bar counts input bytes. Resume: an input whose three
arrays already exist in ``DIR`` complete (headers, sizes, row counts and dtypes agree) is skipped
(``--force`` redoes it); any other final file of its prefix is deleted before it is converted again.
Arrays are written under hidden temporary names and renamed when complete, so a crash leaves no
partial array under a final name. One run per output folder at a time.

Exit status: 0 when every file is converted or skipped; 2 with one ``preprocess: error: ...`` line
per problem for bad paths or flags (before any conversion) and for files that cannot be converted;
1 when a worker process died.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import queue as queue_lib
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import List, Optional, Sequence, Tuple

from .npy_convert import FORMATS, ConvertError, convert_file, convert_file_torchrec, is_converted
from .npy_layout import ARRAYS, array_path

_queue = None  # a worker's progress queue (set by _init_worker)


def prefix_of(path: str) -> str:
    """``day_0.gz`` -> ``day_0``; ``train.txt`` -> ``train``; ``a.b.tsv`` -> ``a.b``."""
    name = os.path.basename(path)
    if name.endswith(".gz"):
        name = name[:-3]
    for ext in (".tsv", ".txt", ".csv"):
        if name.endswith(ext):
            return name[:-len(ext)]
    return name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess",
        description="Convert raw Criteo TSV day files (or the Kaggle train.txt / CSV) to TorchRec's "
                    "binary layout PREFIX_{dense,sparse,labels}.npy, one triplet per file.")
    p.add_argument("inputs", nargs="+", metavar="IN", help="raw Criteo files (plain or .gz)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created if absent)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes converting files in parallel (default: min(files, CPU cores))")
    p.add_argument("--format", choices=sorted(FORMATS), default="tsv",
                   help="tsv: 40 TAB-separated fields label,I1..I13,C1..C26, no header (1TB days, "
                        "Kaggle train.txt); kaggle-csv: header Id,Label,I1..,C26, comma-separated")
    p.add_argument("--engine", choices=("stream", "torchrec"), default="stream",
                   help="stream: bounded memory, malformed rows skipped and counted; torchrec: "
                        "BinaryCriteoUtils.tsv_to_npys (plain tsv only, whole file in memory)")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed row")
    p.add_argument("--force", action="store_true", help="convert again inputs already converted")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def check_inputs(args: argparse.Namespace) -> List[str]:
    """Problems with the paths and flags, one line each (empty: fine)."""
    errors = []
    for path in args.inputs:
        if not os.path.exists(path):
            errors.append(f"{path}: input file not found")
        elif not os.path.isfile(path):
            errors.append(f"{path}: not a file (give the raw files themselves, not a folder)")
        elif not os.access(path, os.R_OK):
            errors.append(f"{path}: not readable")
    seen = {}
    for path in args.inputs:
        pre = prefix_of(path)
        if pre in seen and os.path.abspath(seen[pre]) != os.path.abspath(path):
            errors.append(f"{path}: output prefix {pre!r} is also that of {seen[pre]}")
        seen.setdefault(pre, path)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        errors.append(f"{args.out}: --out exists and is not a folder")
    if args.workers is not None and args.workers < 1:
        errors.append(f"--workers must be >= 1, got {args.workers}")
    if args.engine == "torchrec":
        if args.format != "tsv":
            errors.append(f"--engine torchrec reads only --format tsv, got {args.format}")
        errors += [f"{p}: --engine torchrec cannot read .gz files" for p in args.inputs
                   if p.endswith(".gz")]
    return errors


def _init_worker(queue) -> None:
    global _queue
    _queue = queue


def _report(n: int) -> None:
    if _queue is not None and n:
        _queue.put(n)


def _convert(job: Tuple[str, str, str, str, str, bool]):
    """One input (in a worker or inline): delete stale files of its prefix, then convert."""
    in_path, out, prefix, fmt, engine, strict = job
    for kind in ARRAYS:
        p = array_path(out, prefix, kind)
        if os.path.exists(p):
            os.remove(p)
    if engine == "torchrec":
        res = convert_file_torchrec(in_path, out, prefix)
        _report(os.path.getsize(in_path))
        return res
    return convert_file(in_path, out, prefix, fmt, strict, progress=_report)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; returns the exit status (also when called from Python)."""
    args = build_parser().parse_args(argv)
    errors = check_inputs(args)
    if errors:
        for e in errors:
            print(f"preprocess: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        print(f"preprocess: error: {args.out}: cannot create the output folder ({e.strerror})",
              file=sys.stderr, flush=True)
        return 2
    todo, skipped = [], []
    for path in dict.fromkeys(args.inputs):  # a path given twice is converted once
        pre = prefix_of(path)
        if not args.force and is_converted(args.out, pre):
            skipped.append(pre)
            print(f"{pre}: complete in {args.out}, skipped", flush=True)
        else:
            todo.append((path, args.out, pre, args.format, args.engine, args.strict))
    workers = min(len(todo), args.workers or os.cpu_count() or 1)
    total = sum(os.path.getsize(j[0]) for j in todo)
    bar = None
    if todo and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", dynamic_ncols=True)
    results, failures, status = [], [], 0
    try:
        if workers <= 1:
            _init_worker(_InlineQueue(bar))
            for job in todo:
                try:
                    results.append(_convert(job))
                except ConvertError as e:
                    failures.append(str(e))
        else:
            status = _run_pool(todo, workers, bar, results, failures)
    finally:
        _init_worker(None)
        if bar is not None:
            bar.close()
    for r in results:
        print(f"{r.prefix}: {r.stats.summary()}", flush=True)
    for f in failures:
        print(f"preprocess: error: {f}", file=sys.stderr, flush=True)
    if status:
        return status
    if failures:
        return 2
    print(f"{args.out}: {len(results)} converted, {len(skipped)} skipped", flush=True)
    return 0


class _InlineQueue:
    """The progress queue of an inline run: updates the bar at once."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def put(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)


def _run_pool(todo, workers: int, bar, results: list, failures: list) -> int:
    """Convert ``todo`` in a process pool (fork); returns 1 if a worker died, else 0."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()

    def drain() -> None:
        while True:
            try:
                n = queue.get_nowait()
            except queue_lib.Empty:
                return
            if bar is not None:
                bar.update(n)

    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                initargs=(queue,)) as pool:
        pending = {pool.submit(_convert, job) for job in todo}
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            drain()
            for fut in done:
                try:
                    results.append(fut.result())
                except ConvertError as e:
                    failures.append(str(e))
                except BrokenProcessPool as e:
                    print(f"preprocess: error: a worker process died ({e}); run the same "
                          f"command again to resume", file=sys.stderr, flush=True)
                    for f in pending:
                        f.cancel()
                    return 1
        drain()
    return 0


if __name__ == "__main__":
    sys.exit(main())
