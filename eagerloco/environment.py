"""The process environment, read in this one place: what a launcher or the user set for this process.

Everything eagerloco reads from the environment is a field of :class:`Environment` (no other module reads
``os.environ``); a launcher passes it on with :meth:`Environment.for_child`. The one variable written here is
torch's own log level (:func:`quiet_torch_cpp_warnings`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from eagerloco.errors import ConfigError

#: Set by ``eagerloco launch`` on every process it starts: the run's number of workers and ranks per worker.
WORKERS_ENV, RANKS_PER_WORKER_ENV = "EAGERLOCO_WORKERS", "EAGERLOCO_RANKS_PER_WORKER"
#: An outer rendezvous across separate jobs (defaults of ``--outer-addr`` and ``--worker-id``).
OUTER_ADDR_ENV, WORKER_ID_ENV = "EAGERLOCO_OUTER_ADDR", "EAGERLOCO_WORKER_ID"
#: Set by ``eagerloco launch --elastic`` on a process it restarts: join the live workers.
REJOIN_ENV = "EAGERLOCO_REJOIN"
#: Set by ``eagerloco launch`` on every process it starts: the launcher's process id.
LAUNCHER_PID_ENV = "EAGERLOCO_LAUNCHER_PID"
#: Set by ``eagerloco launch --kernel-link-gbps``: the uplink rate in Gbit/s the kernel shapes (the runtime
#: then emulates only latency and jitter, and records the rate as the run's link bandwidth).
KERNEL_LINK_ENV = "EAGERLOCO_KERNEL_LINK_GBPS"
#: The data cache (default of ``--data-dir``).
DATA_DIR_ENV = "EAGERLOCO_DATA_DIR"


#: The level below which torch's C++ log lines are dropped by the command line, unless the caller sets one.
TORCH_CPP_LOG_LEVEL = "ERROR"


def quiet_torch_cpp_warnings() -> None:
    """Drop torch's C++ warnings (``TORCH_CPP_LOG_LEVEL``, read when its library loads) unless the caller set a level.

    A store whose host is gone makes every later store call log the C++ stack of its error before the error the
    run turns into one line naming the worker."""
    if "torch" not in sys.modules:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", TORCH_CPP_LOG_LEVEL)


@dataclass(frozen=True)
class Environment:
    """What the environment says about this process (None: the variable is unset or empty)."""

    rank: int | None = None
    """RANK: this process's global rank under a launcher."""
    world_size: int | None = None
    """WORLD_SIZE: processes of the launcher's world."""
    local_rank: int | None = None
    """LOCAL_RANK: this process's rank on its host."""
    local_world_size: int | None = None
    """LOCAL_WORLD_SIZE: processes of the world on this host."""
    master_addr: str | None = None
    """MASTER_ADDR: the host of the launcher's store."""
    master_port: int | None = None
    """MASTER_PORT: the port of the launcher's store."""
    workers: int | None = None
    """EAGERLOCO_WORKERS: M, as given to ``eagerloco launch``."""
    ranks_per_worker: int | None = None
    """EAGERLOCO_RANKS_PER_WORKER: R, as given to ``eagerloco launch``."""
    outer_addr: str | None = None
    """EAGERLOCO_OUTER_ADDR: the coordinator's HOST:PORT when each worker is its own job."""
    worker_id: int | None = None
    """EAGERLOCO_WORKER_ID: this job's worker id, with the outer rendezvous."""
    rejoin: bool = False
    """EAGERLOCO_REJOIN=1: this process was restarted into a running elastic run."""
    launcher_pid: int | None = None
    """EAGERLOCO_LAUNCHER_PID: the process whose end ends this one: the launcher that started it, or the
    launcher's rank server that forked it."""
    kernel_link_gbps: float | None = None
    """EAGERLOCO_KERNEL_LINK_GBPS: the uplink rate the kernel shapes for this process's worker."""
    data_dir: str | None = None
    """EAGERLOCO_DATA_DIR: the data cache."""

    @staticmethod
    def adopt(environ: Mapping[str, str]) -> None:
        """Make this process's environment exactly ``environ``: a rank forked by the rank server takes the one its
        launcher gave it. The one place the process environment is written."""
        os.environ.clear()
        os.environ.update(environ)

    @staticmethod
    def for_child(**updates: str) -> dict[str, str]:
        """The environment of a process this one starts: this one's with ``updates`` (a launcher's)."""
        return {**os.environ, **updates}

    @property
    def launched(self) -> bool:
        """Whether a launcher started this process as one rank of a world (RANK and WORLD_SIZE set)."""
        return self.rank is not None and self.world_size is not None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """This process's environment (or ``environ``); ConfigError naming a variable set to something it cannot be."""
        env = os.environ if environ is None else environ

        def text(name: str) -> str | None:
            value = env.get(name)
            return value if value else None

        def integer(name: str) -> int | None:
            value = text(name)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name} must be an integer, got {value!r}") from None

        kernel = text(KERNEL_LINK_ENV)
        try:
            gbps = None if kernel is None else float(kernel)
        except ValueError:
            gbps = math.nan
        if gbps is not None and not (math.isfinite(gbps) and gbps > 0):
            raise ConfigError(f"{KERNEL_LINK_ENV}={kernel!r} is not a number of Gbit/s (it is set by eagerloco "
                              "launch --kernel-link-gbps; unset it)")
        return cls(
            rank=integer("RANK"), world_size=integer("WORLD_SIZE"), local_rank=integer("LOCAL_RANK"),
            local_world_size=integer("LOCAL_WORLD_SIZE"), master_addr=text("MASTER_ADDR"),
            master_port=integer("MASTER_PORT"), workers=integer(WORKERS_ENV),
            ranks_per_worker=integer(RANKS_PER_WORKER_ENV), outer_addr=text(OUTER_ADDR_ENV),
            worker_id=integer(WORKER_ID_ENV), rejoin=text(REJOIN_ENV) == "1",
            launcher_pid=integer(LAUNCHER_PID_ENV), kernel_link_gbps=gbps, data_dir=text(DATA_DIR_ENV),
        )
