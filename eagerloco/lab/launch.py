"""``eagerloco launch --kernel-link-gbps``: the launcher's workers behind uplinks the kernel shapes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from eagerloco.lab.kernel_link import JobLink, KernelLink
from eagerloco.launch import run


@dataclass
class KernelShaping:
    """The launcher's :class:`~eagerloco.launch.command.LinkShaping` at ``gbps`` Gbit/s per worker's uplink:
    a launch's workers in namespaces of their own (:class:`KernelLink`), or a job's worker on the bridge of
    its run's jobs (:class:`JobLink`)."""

    gbps: float

    def run_link(self, workers: int) -> KernelLink:
        return KernelLink(workers, self.gbps)

    def job_link(self, port: int, worker_id: int, workers: int) -> JobLink:
        return JobLink(port, worker_id, workers, self.gbps)


def run_shaped(args: argparse.Namespace) -> int:
    """``eagerloco launch`` with ``--kernel-link-gbps``."""
    return run(args, KernelShaping(args.kernel_link_gbps))


__all__ = ["KernelShaping", "run_shaped"]
