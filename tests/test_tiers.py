"""The tiers' guard (tests/tiers.py): a test that starts a process without the `processes` marker fails
at teardown, naming what it started; a marked one, or one that starts nothing, passes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SPAWNING_TESTS = '''
import multiprocessing
import os
import subprocess
import sys

import pytest


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_unmarked_multiprocessing_spawn():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


@pytest.fixture(scope="module")
def started_once():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_module_fixture(started_once):
    pass


@pytest.mark.processes
def test_marked(started_once):
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_no_process():
    pass
'''


@pytest.mark.processes
def test_a_process_started_without_the_marker_fails_the_test_naming_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tiers import pytest_configure, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401\n")
    (tmp_path / "test_spawning.py").write_text(textwrap.dedent(SPAWNING_TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(HERE)  # tiers.py; the inner run imports no torch
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "6 passed, 4 errors" in out, out
    for name, what in (("test_unmarked_subprocess", f"{sys.executable} -c pass"), ("test_unmarked_fork", "os.fork()"),
                       ("test_unmarked_multiprocessing_spawn", "multiprocessing"),
                       ("test_unmarked_module_fixture", f"{sys.executable} -c pass")):
        # the failure's own line; the short summary repeats it after "ERROR ", cut to the terminal's width
        lines = [ln for ln in out.splitlines() if ln.startswith(f"test_spawning.py::{name} started")]
        assert len(lines) == 1 and "without the `processes` marker" in lines[0] and what in lines[0], out
    assert "test_marked started" not in out and "test_no_process started" not in out, out
