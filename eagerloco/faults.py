"""Fault settings: elastic membership, rejoining, emulated stragglers, and fault injection.

The settings live on :class:`eagerloco.train.TrainConfig` (``elastic``, ``rejoin``,
``slow_workers``) so that the command line, TOML files and the API share one validation; this
module parses and checks them. The protocol itself is in :mod:`eagerloco.comm.elastic`.

Fault injection (tests and benchmarks): ``EAGERLOCO_FAULT_KILL="WORKER:STEP[:DELAY_S]"`` makes
that worker's first incarnation SIGKILL itself DELAY_S seconds after finishing inner step STEP
(so the kill lands at a known step, mid-way through the next one). It is an environment
variable, not a flag, because no real run should ever ask for it.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from typing import Any

from eagerloco.config import ConfigError

FAULT_KILL_ENV = "EAGERLOCO_FAULT_KILL"
#: Set by ``eagerloco launch --elastic`` on a process it restarts: join the live workers.
REJOIN_ENV = "EAGERLOCO_REJOIN"


def parse_slow_workers(specs: Any, workers: int | None = None) -> dict[int, float]:
    """``["1:1.5", ...]`` -> {worker: factor}; raises ConfigError naming the bad entry and the fix."""
    if specs is None:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"--slow-worker must be given as ID:FACTOR (repeatable), got {specs!r}")
    out: dict[int, float] = {}
    for spec in specs:
        text = str(spec).strip()
        wid, sep, fac = text.partition(":")
        try:
            if not sep:
                raise ValueError
            w, f = int(wid), float(fac)
        except ValueError:
            raise ConfigError(
                f"--slow-worker {text!r}: expected ID:FACTOR, e.g. --slow-worker 1:1.5 "
                "(worker 1 takes 1.5x as long per inner step)"
            ) from None
        if w < 0 or (workers is not None and w >= workers):
            hi = f"0..{workers - 1}" if workers is not None else ">= 0"
            raise ConfigError(f"--slow-worker {text!r}: worker id must be in {hi} (--workers {workers})")
        if not math.isfinite(f) or f < 1.0:
            raise ConfigError(
                f"--slow-worker {text!r}: FACTOR must be a finite number >= 1 (how many times slower), got {fac}"
            )
        if w in out:
            raise ConfigError(f"--slow-worker: worker {w} is given twice; give each worker once")
        out[w] = f
    return out


def validate_faults(cfg: Any) -> None:
    """Check the fault settings of a TrainConfig (called from its validate())."""
    for name in ("elastic", "rejoin"):
        v = getattr(cfg, name)
        if not isinstance(v, bool):
            raise ConfigError(f"--{name} is a switch (true/false), got {v!r}")
    parse_slow_workers(cfg.slow_workers, cfg.workers)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.rejoin and not cfg.elastic:
        raise ConfigError("--rejoin needs --elastic: only an elastic run admits a worker that comes back")
    if cfg.elastic and not distributed:
        raise ConfigError(
            "--elastic needs the multi-process runtime, where workers can die and come back: "
            "`eagerloco launch --workers M --elastic -- <train args> --elastic` or torchrun; "
            "the in-process runtime has nothing to lose"
        )


def slowdown_for(cfg: Any, worker: int) -> float:
    """How many times slower than measured this worker's inner steps are (1.0: not a straggler)."""
    return parse_slow_workers(getattr(cfg, "slow_workers", None)).get(worker, 1.0)


def rejoining(cfg: Any) -> bool:
    """Whether this process comes back into a running elastic run (flag or launcher restart)."""
    return bool(cfg.rejoin) or os.environ.get(REJOIN_ENV, "") == "1"


def kill_hook(worker: int) -> tuple[int, float] | None:
    """(step, delay_s) at which this process must kill itself, from EAGERLOCO_FAULT_KILL."""
    spec = os.environ.get(FAULT_KILL_ENV, "")
    if not spec or os.environ.get(REJOIN_ENV, "") == "1":
        return None
    parts = spec.split(":")
    try:
        w, step = int(parts[0]), int(parts[1])
        delay = float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ConfigError(f"{FAULT_KILL_ENV}={spec!r}: expected WORKER:STEP[:DELAY_S]") from None
    return (step, delay) if w == worker else None


def kill_self(delay_s: float) -> None:
    """SIGKILL this process after delay_s seconds (no cleanup, no goodbye: a real crash)."""
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if delay_s <= 0:
        die()
    t = threading.Timer(delay_s, die)
    t.daemon = True
    t.start()


__all__ = [
    "FAULT_KILL_ENV",
    "REJOIN_ENV",
    "kill_hook",
    "kill_self",
    "parse_slow_workers",
    "rejoining",
    "slowdown_for",
    "validate_faults",
]
