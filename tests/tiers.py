"""The test tiers: markers `processes`, `root`, `slow` and `network` (pyproject.toml), and the hooks that keep them.

`make test-fast` runs the tests marked none of them. A test that starts an OS process without the
`processes` marker fails at teardown, naming what it started: every way a Python process starts one
(subprocess, multiprocessing, os.fork / posix_spawn / system) is watched while the suite runs. Module-
and session-scoped fixtures count for the test whose setup or teardown runs them. tests/conftest.py
imports the hooks.
"""

from __future__ import annotations

import functools
import multiprocessing.util
import os
import platform
import subprocess
from collections.abc import Callable, Generator

import pytest


class ProcessWatch:
    """Notes what a test not marked `processes` starts (`item`: the test running now)."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []

    def note(self, what: str) -> None:
        item = self.item
        if item is not None and item.get_closest_marker("processes") is None:
            self.started.append(what)

    def wrap(self, owner: object, name: str, describe: Callable[..., str]) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return

        @functools.wraps(real)
        def watched(*args: object, **kwargs: object) -> object:
            self.note(describe(*args, **kwargs))
            return real(*args, **kwargs)

        setattr(owner, name, watched)


_WATCH = ProcessWatch()


def _command(cmd: object) -> str:
    parts = cmd if isinstance(cmd, (list, tuple)) else [cmd]
    return " ".join(os.fsdecode(p) if isinstance(p, bytes) else str(p) for p in parts)


def pytest_configure(config: pytest.Config) -> None:
    # platform.processor() runs `uname -p` once per process and caches it (eagerloco.device names the
    # CPU with it): asked here, so that no test is blamed for whichever first asks.
    platform.processor()
    _WATCH.wrap(subprocess.Popen, "_execute_child", lambda popen, args, *a, **k: _command(args))
    _WATCH.wrap(multiprocessing.util, "spawnv_passfds", lambda path, args, *a, **k: _command(args))
    _WATCH.wrap(os, "fork", lambda: "os.fork()")
    _WATCH.wrap(os, "forkpty", lambda: "os.forkpty()")
    _WATCH.wrap(os, "system", lambda cmd: _command(cmd))
    for name in ("posix_spawn", "posix_spawnp"):
        _WATCH.wrap(os, name, lambda path, argv, *a, **k: _command(argv))


# Scheduling: `make test` runs whole files on 3 pytest-xdist workers, in collection order. There the
# files that take longest (on 2 cores) are collected first, so that none of them starts last while
# the other workers have nothing left to do. The order within a file is kept; a run without xdist keeps
# the usual order.
LONGEST_FIRST = ("test_sites.py", "test_dist_train.py", "test_signals.py", "test_quorum_jobs.py",
                 "test_sites_entrypoints.py", "test_dist_ranks.py", "test_quorum_jobs_members.py", "test_faults.py",
                 "test_hooks_jobs.py", "test_netshape.py", "test_integrations_lightning.py",
                 "test_integrations_hf.py", "test_distributed.py", "test_checkpoint.py", "test_integrations_kill.py",
                 "test_nothing_lost.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _WATCH.item, _WATCH.started = item, []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    result = yield
    started, _WATCH.started = _WATCH.started, []
    if started:
        pytest.fail(f"{item.nodeid} started {len(started)} process(es) without the `processes` marker "
                    f"(add @pytest.mark.processes, or pytestmark for the module): {started[0]}", pytrace=False)
    return result
