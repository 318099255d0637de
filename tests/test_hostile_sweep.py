"""The hostile sweep (issue 51): several hundred calls of a careless or hostile caller, each changing ONE
thing of a valid call, through the public ops ``torch.ops.torchrec_ftrl.*`` (the compiled CPU kernel
and the PyTorch implementation), the TBE (layouts, backends, bounds modes FATAL and WARNING), its
``load_state_dict`` and ``import_ftrl_tables``. The cases and what each expects: tests/hostile_cases.py.

Each case runs in its own forked child of one server process (``python tests/hostile_cases.py``,
started once per module), so a crash is the case's own: a child killed by a signal (SIGSEGV, SIGABRT
of a corrupted heap, also after the case returned) or exiting non-zero fails the case by name, as does
a missing error, a message that does not name the argument, or state changed by a call that raised.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from hostile_cases import CASES

TESTS = os.path.join(REPO, "tests")


class Server:
    """The fork server: one JSON line per case name written to its stdin."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, os.path.join(TESTS, "hostile_cases.py")], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._line()
        assert json.loads(ready) == {"ready": len(CASES)}, ready

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"the hostile-case server died (exit {self.proc.poll()})"
        return line

    def run(self, name: str) -> dict:
        if self.proc.poll() is not None:   # a server that died fails one case, not the rest
            self.__init__()
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def test_the_sweep_is_large_enough():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_case(server, case):
    report = server.run(case)
    assert report["name"] == case
    assert report["status"] == "exit 0", f"{case}: the child ended by {report['status']} ({report['error']})"
    assert report["ok"], f"{case}: {report['error']}"
