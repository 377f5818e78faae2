"""``eagerloco launch --kernel-link-gbps``: the launcher's workers behind uplinks the kernel shapes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from eagerloco.config.checks import host_port
from eagerloco.lab.kernel_link import JobLink, KernelLink
from eagerloco.launch import run

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _local_port(outer_addr: str) -> int:
    """The port of an --outer-addr that names this machine's loopback; ValueError otherwise (the
    kernel-shaped link between jobs emulates a WAN on one machine)."""
    host, port = host_port("outer_addr", outer_addr)
    if host.strip("[]") not in _LOOPBACK:
        raise ValueError(
            f"--kernel-link-gbps with --outer-addr shapes the links between jobs on this machine: give every job "
            f"--outer-addr 127.0.0.1:{port} (the launch reaches the coordinator there through the shaped bridge), "
            f"not {host}; "
            "jobs on separate machines are joined by the real link: drop --kernel-link-gbps there")
    return port


@dataclass
class KernelShaping:
    """The launcher's :class:`~eagerloco.launch.command.LinkShaping` at ``gbps`` Gbit/s per worker's uplink:
    a launch's workers in namespaces of their own (:class:`KernelLink`), or a job's worker on the bridge of
    its run's jobs (:class:`JobLink`)."""

    gbps: float

    def check(self, argv: list[str], outer_addr: str | None) -> None:
        """The kernel shapes the bandwidth (not --bandwidth-gbps), and the links between jobs of this machine."""
        if any(a.split("=")[0] == "--bandwidth-gbps" for a in argv):
            raise ValueError("--kernel-link-gbps shapes the link's bandwidth in the kernel: drop --bandwidth-gbps "
                             "from the train arguments (latency and jitter flags still apply)")
        if outer_addr is not None:
            _local_port(outer_addr)

    @contextmanager
    def link(self, argv: list[str], workers: int, worker_id: int | None,
             out: IO[str]) -> Iterator[tuple[Any, list[str]]]:
        """A launch's workers each in a namespace of its own; or one job's worker in its own namespace behind a
        shaped uplink, on the bridge of the run's jobs, its --outer-addr the bridge's address, where the namespace
        reaches this machine's coordinator."""
        if worker_id is None:
            with KernelLink(workers, self.gbps) as link:
                out.write(f"[launch] kernel-shaped link: {workers} network namespaces, each worker's uplink "
                          f"{self.gbps:g} Gbit/s (tbf), rendezvous at {link.master_addr}\n")
                out.flush()
                yield link, argv
            return
        i = len(argv) - 1 - argv[::-1].index("--outer-addr")  # the one the launcher appended
        outer_addr = argv[i + 1]
        port = _local_port(outer_addr)
        with JobLink(port, worker_id, workers, self.gbps) as link:
            addr = f"{link.master_addr}:{port}"  # the coordinator, seen from the namespace
            out.write(f"[launch] kernel-shaped link: worker {worker_id} in network namespace {link.ns}, its uplink "
                      f"{self.gbps:g} Gbit/s (tbf) on bridge {link.bridge}; outer rendezvous {outer_addr} -> {addr}\n")
            out.flush()
            yield link, [*argv[:i + 1], addr, *argv[i + 2:]]


def run_shaped(args: argparse.Namespace) -> int:
    """``eagerloco launch`` with ``--kernel-link-gbps``."""
    return run(args, KernelShaping(args.kernel_link_gbps))
