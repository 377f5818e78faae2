"""``train(cfg)``: one run of this process, with the runtime its settings and environment select."""

from __future__ import annotations

from typing import Any

from eagerloco.config import Environment, TrainConfig
from eagerloco.train.distributed import DistributedRuntime
from eagerloco.train.elastic import ElasticRuntime
from eagerloco.train.inprocess import InProcessRuntime
from eagerloco.train.job import JobRuntime
from eagerloco.train.runtime import Runtime
from eagerloco.train.trainer import Trainer

#: The runtime of each kind (:meth:`eagerloco.config.RuntimeConfig.kind`).
RUNTIMES: dict[str, type[Runtime]] = {"inprocess": InProcessRuntime, "distributed": DistributedRuntime,
                                      "elastic": ElasticRuntime, "job": JobRuntime}


def train(cfg: TrainConfig, env: Environment | None = None, *, validated: bool = False) -> dict[str, Any] | None:
    """Train: M workers in this process; under ``eagerloco launch`` or torchrun this rank's share; with
    ``cfg.runtime.outer_addr`` one worker as a job of its own. ``cfg.resume`` continues from the newest
    valid checkpoint with the numbers of an uninterrupted run.

    Args:
        cfg: the run's settings.
        env: this process's environment (default: read it).
        validated: ``cfg`` was validated against ``env`` already: skip the check.

    Returns:
        The summary on the reporting process (also in ``<out>/summary.json``); None on the others.

    Raises:
        ConfigError: an invalid setting, or a checkpoint or launch that does not fit them.
        DataError: the data cannot be fetched or read.
        PeerError: another worker died or stopped answering; the message names it.
    """
    env = Environment.read() if env is None else env
    if not validated:
        cfg.validate(env)
    runtime = RUNTIMES[cfg.runtime.kind(env)](cfg, env)
    return Trainer(cfg, runtime).run()
