"""The docs run as written: every ``python`` and ``bash`` block of README.md and docs/*.md, through
sybil (``python`` blocks each in a fresh interpreter, as a user runs a snippet, so what one starts
(process groups and their threads) never reaches the test process, whose later tests fork
DataLoader workers; ``bash`` blocks under ``bash -e``;
both in a scratch copy of the checkout whose ``../shared/data`` is the sample data), asserting the
figures the docs state beside them (``<!-- expect: TEXT -->``). The kinds of block and where the
others run: ``benchmarks/doc_commands.py``. Also: every block has a known kind, the docs have no
indented code blocks, ``benchmarks/gpu_doc_commands.sh`` is the one generated from the docs, and
the versions in ``bash install`` blocks are the pinned ones.
"""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, data_dir

pytest.importorskip("sybil", reason="needs sybil (requirements.txt); the GPU machine's bundle has none")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import doc_commands  # noqa: E402

BLOCKS = doc_commands.all_blocks()
RUN = [b for b in BLOCKS if b.info in doc_commands.RUN_IN_CI]
# what a scratch checkout links to: the package, the scripts, the build files
CHECKOUT = ("torchrec_ftrl", "examples", "benchmarks", "Makefile", "pyproject.toml", "requirements.txt")


def _id(b):
    return f"{b.path}:{b.line}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """``ROOT/checkout`` (links to the checkout's files; outputs land there) and ``ROOT/shared/data``
    (a link to the sample data), so commands written for the checkout run unchanged."""
    root = tmp_path_factory.mktemp("docs")
    checkout = root / "checkout"
    checkout.mkdir()
    for name in CHECKOUT:
        os.symlink(os.path.join(REPO, name), checkout / name)
    (root / "shared").mkdir()
    os.symlink(data_dir(), root / "shared" / "data")
    return checkout


def _env() -> dict:
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")


def _python(block, cwd):
    """A child interpreter in ``cwd`` where sybil parses the block's document and evaluates the
    example at the block's line (each snippet is complete)."""
    code = ("from sybil import Document\n"
            "from sybil.parsers.markdown import PythonCodeBlockParser\n"
            f"doc = Document.parse({os.path.join(REPO, block.path)!r}, PythonCodeBlockParser())\n"
            f"(example,) = [e for e in doc if e.line == {block.line}]\n"
            "example.evaluate()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


def _bash(block, cwd):
    if "../shared/data" in block.source and not os.path.isdir(data_dir()):
        pytest.skip(f"the sample data is not at {data_dir()}")
    p = subprocess.run(["bash", "-eo", "pipefail", "-c", block.source], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for text in block.expect:
        assert doc_commands.expect_found(text, out), \
            f"{_id(block)}: expected {text!r} in the output:\n{out[-4000:]}"


@pytest.mark.parametrize("block", RUN, ids=[_id(b) for b in RUN])
def test_block_runs_as_written(block, scratch):
    if block.info == "python":
        _python(block, scratch)      # files a snippet writes land in the scratch checkout
    else:
        _bash(block, scratch)


def test_every_block_has_a_known_kind():
    unknown = [(_id(b), b.info) for b in BLOCKS if b.info not in doc_commands.KINDS]
    assert not unknown, f"fence info strings must be one of {doc_commands.KINDS}: {unknown}"
    expect_elsewhere = [_id(b) for b in BLOCKS if b.expect and b.info != "bash"]
    assert not expect_elsewhere, f"<!-- expect --> only above bash blocks: {expect_elsewhere}"


def test_docs_have_no_indented_code_blocks():
    """An indented block (4 spaces after a blank line, outside fences and lists) has no kind."""
    found = []
    for path in doc_commands.doc_paths():
        fence, prev_blank, in_list = False, True, False
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            for i, line in enumerate(f.read().split("\n"), 1):
                if line.lstrip().startswith("```"):
                    fence = not fence
                elif not fence and line.strip():
                    if re.match(r"\s*([-*+]|\d+\.)\s", line):
                        in_list = True
                    elif not line.startswith(" "):
                        in_list = False
                    if line.startswith("    ") and prev_blank and not in_list:
                        found.append(f"{path}:{i}")
                prev_blank = not line.strip()
    assert not found, f"indented code blocks (use a fence with a kind): {found}"


def test_gpu_script_is_generated_from_the_docs():
    with open(doc_commands.SCRIPT, encoding="utf-8") as f:
        assert f.read() == doc_commands.script_text(), \
            "run `python benchmarks/doc_commands.py --write` after editing gpu/long blocks"


def test_gpu_script_runs_its_blocks_and_reports(tmp_path):
    """The generated script's own logic, on CPU: a block that passes, one that fails, the budget."""
    script = doc_commands.script_text()
    head = script.split("\nrun_block ")[0]
    demo = head + "\n" + "\n".join([
        "run_block ok \"$OUT/a.log\" <<'DOCEOF'", "echo fine", "DOCEOF",
        "run_block bad \"$OUT/b.log\" <<'DOCEOF'", "false", "echo never", "DOCEOF",
        "run_block data \"$OUT/d.log\" <<'DOCEOF'", "ls ../shared/data", "DOCEOF",
        "BUDGET=-1", "run_block late \"$OUT/c.log\" <<'DOCEOF'", "echo late", "DOCEOF", ""])
    p = subprocess.run(["bash", "-c", demo], cwd=REPO, env=dict(os.environ, OUT=str(tmp_path)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    report = (tmp_path / "gpu_doc_commands.md").read_text()
    assert "| ok | 0 |" in report and "fine" in report
    assert "| bad | 1 |" in report and "never" not in (tmp_path / "b.log").read_text()
    assert "| late | skipped (budget) |" in report and not (tmp_path / "c.log").exists()
    assert ("| data | skipped (no ../shared/data) |" in report) != os.path.isdir(
        os.path.join(os.path.dirname(REPO), "shared", "data"))


def _pins():
    pins = {}
    for name in ("requirements.txt", "requirements-torchrec.txt", "requirements-tensorflow.txt"):
        with open(os.path.join(REPO, name)) as f:
            for line in f:
                m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
                if m:
                    pins[m.group(1).lower()] = m.group(2)
    return pins


def test_install_blocks_name_the_pinned_versions():
    pins, checked = _pins(), 0
    for b in BLOCKS:
        if b.info != "bash install":
            continue
        for line in b.source.splitlines():
            command = line.split("#")[0]
            for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s'\"]*)", command):
                assert pins.get(name.lower()) == version, f"{_id(b)}: {name}=={version}, pinned {pins.get(name.lower())}"
                checked += 1
    assert checked >= 3


@pytest.mark.parametrize("text,output,found", [
    ("AUC 0.6576", "validation AUC 0.6576 logloss", True),
    ("AUC 0.6576", "validation AUC 0.6579 logloss", False),
    ("AUC 0.658±0.003", "validation AUC 0.6579 logloss", True),
    ("AUC 0.658±0.003", "validation AUC 0.6549 logloss", False),
    ("AUC 0.658±0.003, loss 1.0±0.1", "AUC 0.6579, loss 1.04", True),
    ("AUC 0.658±0.003, loss 1.0±0.1", "AUC 0.6579, loss 1.2", False),
    ("AUC 0.658±0.003", "step 50: AUC 0.7069\nstep 119: AUC 0.6581", True),
    ("AUC 0.658±0.003", "AUC 0.6619", False),                    # a number is read whole
    ("AUC 0.658±0.003", "AUC 10.658", False),
    ("| 0.658±0.003 |", "| 0.7 | 0.658 |", True),                # matches may overlap
    ("a 1±0.1 a 2±0.1", "a 5 a 1 a 2", True),
    ("0.658±0.003", "range 0.5-0.658", True),                    # a range's dash is no sign
    ("0.658±0.003", "x -0.658", False),                          # a minus sign is
    ("-0.658±0.003", "x -0.658", True),
    ("loss (1.0±0.1) [a]", "loss (1.05) [a]", True),             # regex characters are literal
])
def test_expect_tolerance(text, output, found):
    """``X±TOL`` in an expect TEXT matches a printed number within TOL of X, other text literally."""
    assert doc_commands.expect_found(text, output) is found
