"""Fault injection for the project's own tests and benchmarks: a worker that dies at a known step, an
evaluation that takes long.

- ``EAGERLOCO_FAULT_KILL="WORKER:STEP[:DELAY_S]"``: that worker's first incarnation SIGKILLs itself
  DELAY_S seconds after finishing inner step STEP (so the kill lands at a known step, mid-way through
  the next one);
- ``EAGERLOCO_FAULT_EVAL_DELAY=S``: the evaluating process spends S more seconds on each evaluation
  (an evaluation that outlasts ``--dist-timeout``);
- ``EAGERLOCO_FAULT_SLOW=FILE``: while FILE exists, holding ``EXTRA_S[:EVERY]``, the process sleeps EXTRA_S
  seconds after each inner step (after each EVERY-th: once a round, a slow uplink): a site slowed for as long as
  a benchmark's schedule keeps the file there.

They are environment variables, not flags, because no real run should ever ask for them, and they
act only in a process that installed them (:func:`install`): a test or a benchmark starts its
processes with :func:`environment`, which puts this package's ``site`` directory and the checkout that
holds the package on PYTHONPATH, and the ``sitecustomize`` there installs them at interpreter start,
watching the run through :mod:`eagerloco.events` (a process forked from one that has them, as a launched
rank is, has them too, and acts on its own environment). The package lives beside eagerloco in the
checkout, not in it: it is never installed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from eagerloco import events
from eagerloco.config import ConfigError, Environment

FAULT_KILL_ENV = "EAGERLOCO_FAULT_KILL"
FAULT_EVAL_DELAY_ENV = "EAGERLOCO_FAULT_EVAL_DELAY"
FAULT_SLOW_ENV = "EAGERLOCO_FAULT_SLOW"
#: The directory whose sitecustomize installs the faults in every process started with it on PYTHONPATH.
SITE_DIR = Path(__file__).resolve().parent / "site"
#: The checkout holding this package, on PYTHONPATH too: the sitecustomize imports it from there.
CHECKOUT = Path(__file__).resolve().parents[1]


def environment(base: Mapping[str, str] | None = None, *, kill: str | None = None,
                eval_delay: float | None = None, slow: Path | None = None) -> dict[str, str]:
    """The environment of a process with faults injected.

    Args:
        base: the environment to add to (default: this process's).
        kill: ``WORKER:STEP[:DELAY_S]`` (see the module docstring), or None.
        eval_delay: extra seconds of each evaluation, or None.
        slow: the file whose presence slows the process (see the module docstring), or None.

    Returns:
        A copy of ``base`` with the fault variables, and this package's site directory and checkout on
        PYTHONPATH.
    """
    env = dict(os.environ if base is None else base)
    paths = [str(SITE_DIR), str(CHECKOUT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if kill is not None:
        env[FAULT_KILL_ENV] = kill
    if eval_delay is not None:
        env[FAULT_EVAL_DELAY_ENV] = str(eval_delay)
    if slow is not None:
        env[FAULT_SLOW_ENV] = str(slow)
    return env


def kill_at(environ: Mapping[str, str] | None = None) -> tuple[int, int, float] | None:
    """(worker, step, delay_s) of ``EAGERLOCO_FAULT_KILL``, or None when unset or in a restarted process.

    Raises:
        ConfigError: the variable is set but malformed.
    """
    env = os.environ if environ is None else environ
    spec = env.get(FAULT_KILL_ENV, "")
    if not spec or Environment.read(env).rejoin:
        return None
    parts = spec.split(":")
    try:
        w, step = int(parts[0]), int(parts[1])
        delay = float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ConfigError(f"{FAULT_KILL_ENV}={spec!r}: expected WORKER:STEP[:DELAY_S]") from None
    return w, step, delay


def eval_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds of ``EAGERLOCO_FAULT_EVAL_DELAY`` (0 when unset).

    Raises:
        ConfigError: the variable is set but not a number of seconds.
    """
    env = os.environ if environ is None else environ
    spec = env.get(FAULT_EVAL_DELAY_ENV, "")
    if not spec:
        return 0.0
    try:
        return max(0.0, float(spec))
    except ValueError:
        raise ConfigError(f"{FAULT_EVAL_DELAY_ENV}={spec!r}: expected seconds") from None


def slow_after(step: int, environ: Mapping[str, str] | None = None) -> float:
    """Seconds to sleep after inner step ``step`` (``EAGERLOCO_FAULT_SLOW``: 0 when unset or its file is absent).

    Raises:
        ConfigError: the file holds something other than ``EXTRA_S[:EVERY]``.
    """
    env = os.environ if environ is None else environ
    path = env.get(FAULT_SLOW_ENV, "")
    try:
        spec = Path(path).read_text().strip() if path else ""
    except FileNotFoundError:
        return 0.0
    if not spec:
        return 0.0
    try:
        parts = spec.split(":")
        extra, every = float(parts[0]), int(parts[1]) if len(parts) > 1 else 1
    except (ValueError, IndexError):
        raise ConfigError(f"{FAULT_SLOW_ENV} file {path}: holds {spec!r}, expected EXTRA_S[:EVERY]") from None
    return extra if step % max(1, every) == 0 else 0.0


def kill_self(delay_s: float) -> None:
    """SIGKILL this process after delay_s seconds (no cleanup, no goodbye: a real crash)."""
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if delay_s <= 0:
        die()
    t = threading.Timer(delay_s, die)
    t.daemon = True
    t.start()


def install() -> None:
    """Watch this process's run for the faults its environment asks for (none: nothing happens).

    The environment is read at each event, not now: a rank forked from a server that installed the
    watchers (``eagerloco launch``'s rank server, the tests' job server) acts on its own environment,
    as a process started with it does.
    """
    def on_step(w: int, step: int) -> None:
        kill = kill_at()
        if kill is not None and w == kill[0] and step == kill[1]:
            kill_self(kill[2])
        seconds = slow_after(step)
        if seconds > 0:
            time.sleep(seconds)

    def on_evaluation(step: int) -> None:
        seconds = eval_delay_s()
        if seconds > 0:
            time.sleep(seconds)

    events.on_inner_step(on_step)
    events.on_evaluation(on_evaluation)


__all__ = ["CHECKOUT", "FAULT_EVAL_DELAY_ENV", "FAULT_KILL_ENV", "FAULT_SLOW_ENV", "SITE_DIR", "environment",
           "eval_delay_s", "install", "kill_at", "kill_self", "slow_after"]
