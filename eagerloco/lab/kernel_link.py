"""A slow link shaped by the kernel: one network namespace per worker, each worker's uplink limited (root only;
the processes learn the rate from :data:`~eagerloco.environment.KERNEL_LINK_ENV`).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Self

from filelock import FileLock

from eagerloco.config import ConfigError
from eagerloco.environment import KERNEL_LINK_ENV
from eagerloco.procs import pid_alive

_PREFIX = "eloc"  # namespaces eloc<pid>w<worker>, bridge elbr<pid>, host-side veth elh<pid>w<worker>
# One run of separate jobs (JobLink): bridge elbj<port>, host-side veth elj<port>w<worker>; namespaces as above.
_JOB_BRIDGE, _JOB_VETH = "elbj", "elj"
_IFACE = "eth0"  # the worker side of its veth pair, inside its namespace


class LinkShapingError(ConfigError):
    """Kernel shaping is not possible here; the message says why and what to do instead."""


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LinkShapingError(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def tbf_args(bandwidth_gbps: float) -> list[str]:
    """The tbf qdisc parameters for a rate: a burst of at least 64 KiB (an offloaded segment; tbf drops a packet
    larger than its bucket) and one 250 Hz tick of data, a queue of four bursts or 4 MiB (TCP sees a slow link)."""
    rate_bytes = bandwidth_gbps * 1e9 / 8
    burst = max(64 * 1024, int(rate_bytes / 250))
    limit = max(4 * burst, 4 * 1024 * 1024)
    return ["rate", f"{int(bandwidth_gbps * 1e9)}bit", "burst", str(burst), "limit", str(limit)]


def _check_sizes(workers: int, bandwidth_gbps: float) -> None:
    if not (isinstance(bandwidth_gbps, (int, float)) and math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise LinkShapingError(
            f"--kernel-link-gbps must be a positive, finite number of Gbit/s, got {bandwidth_gbps!r}"
        )
    if workers > 240:
        raise LinkShapingError(f"--kernel-link-gbps supports at most 240 workers (one /24 subnet), got {workers}")


def _setup_lock() -> FileLock:
    """Serializes building and removing links across the processes of this machine (root's, so one
    file): subnets are picked and a shared bridge is made, joined and removed under it."""
    return FileLock(os.path.join(tempfile.gettempdir(), "eagerloco-kernel-link.lock"))


def _free_subnet(start: int) -> str:
    """A 10.213.X (a /24) no interface here uses yet, trying X = start mod 250 first."""
    used = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for i in range(250):
        x = (start + i) % 250
        if f" 10.213.{x}." not in used:
            return f"10.213.{x}"
    raise LinkShapingError("every 10.213.X.0/24 subnet is in use here: remove stale bridges (elbr*, elbj*) and retry")


def _add_bridge(bridge: str, addr: str, made: list[tuple[str, str]]) -> None:
    _run(["ip", "link", "add", bridge, "type", "bridge"])
    made.append(("link", bridge))
    _run(["ip", "addr", "add", f"{addr}/24", "dev", bridge])
    _run(["ip", "link", "set", bridge, "up"])


def _add_uplink(ns: str, host: str, bridge: str, addr: str, bandwidth_gbps: float,
                made: list[tuple[str, str]]) -> None:
    """Join namespace ns to bridge by a veth pair (host-side end named host, eth0 inside at addr/24)
    whose namespace end sends through a tbf of bandwidth_gbps."""
    _run(["ip", "link", "add", host, "type", "veth", "peer", "name", _IFACE, "netns", ns])
    made.append(("link", host))
    _run(["ip", "link", "set", host, "master", bridge])
    _run(["ip", "link", "set", host, "up"])
    _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", _IFACE])
    _run(["ip", "-n", ns, "link", "set", _IFACE, "up"])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    r = _run(["tc", "-n", ns, "qdisc", "add", "dev", _IFACE, "root", "tbf", *tbf_args(bandwidth_gbps)], check=False)
    if r.returncode != 0:
        raise LinkShapingError(
            f"this kernel cannot shape traffic with a token-bucket filter (tc qdisc tbf: "
            f"{(r.stderr or r.stdout).strip()}); it needs sch_tbf. Use the emulated link instead "
            "(--bandwidth-gbps among the train arguments)"
        )


def _remove(made: list[tuple[str, str]]) -> None:
    """Remove what was made (a namespace takes its veth end with it), newest first."""
    while made:
        kind, name = made.pop()
        _run(["ip", "netns" if kind == "ns" else "link", "del", name], check=False)


class _ShapedLink:
    """What both shaped links share: the bridge's address, the processes' environment, building under the lock."""

    def __init__(self, workers: int, bandwidth_gbps: float, tag: int | None) -> None:
        _check_sizes(workers, bandwidth_gbps)
        self.workers, self.bandwidth_gbps = workers, float(bandwidth_gbps)
        self.tag = os.getpid() if tag is None else tag
        self.subnet = ""  # "10.213.X", picked (or read from a job bridge) on entry
        self._made: list[tuple[str, str]] = []  # ("ns" | "link", name), in creation order

    @property
    def master_addr(self) -> str:
        """The bridge's address: the launcher's store, seen from the namespaces."""
        return f"{self.subnet}.1"

    def env(self) -> dict[str, str]:
        """What every process in a namespace needs; gloo binds to the interface the other workers reach."""
        return {KERNEL_LINK_ENV: repr(self.bandwidth_gbps), "GLOO_SOCKET_IFNAME": _IFACE,
                "MASTER_ADDR": self.master_addr}

    def __enter__(self) -> Self:
        KernelLink.check()
        with _setup_lock():
            remove_stale()
            try:
                self._setup()
            except BaseException:
                _remove(self._made)
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:  # each link's own: build it, recording in self._made what it makes
        raise NotImplementedError

    def close(self) -> None:
        """Remove what was made, newest first."""
        _remove(self._made)


class KernelLink(_ShapedLink):
    """Namespaces, bridge and shaped uplinks of ``eagerloco launch --kernel-link-gbps B``; a context manager that
    removes them.

    The bytes really cross a link of B Gbit/s (gloo's chunks and round trips, TCP under a rate limit), where the
    default link is emulated in user space. A bridge in the launcher's namespace holds the store's address; each
    worker's processes run in their own namespace, joined by a veth pair whose worker end sends through a tbf, so
    only traffic between workers is shaped. Latency and jitter stay emulated (kernels often lack ``sch_netem``).
    ``ip``/``tc`` through subprocess: a dozen fixed commands of iproute2, on every machine that can do this.

    Use ``command(cmd, worker)`` to run a process in a worker's namespace, ``master_addr`` and ``env()``."""

    def __init__(self, workers: int, bandwidth_gbps: float, tag: int | None = None) -> None:
        super().__init__(workers, bandwidth_gbps, tag)
        self.bridge = f"elbr{self.tag}"

    def namespace(self, worker: int) -> str:
        return f"{_PREFIX}{self.tag}w{worker}"

    def command(self, cmd: Sequence[str], worker: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(worker), *cmd]

    @staticmethod
    def check() -> None:
        """Raise LinkShapingError unless this machine can shape a link in the kernel."""
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            raise LinkShapingError(
                "--kernel-link-gbps needs root (it creates network namespaces and traffic-control qdiscs); "
                "run as root, or drop it and use the emulated link (--bandwidth-gbps among the train arguments)"
            )
        missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
        if missing:
            raise LinkShapingError(
                f"--kernel-link-gbps needs the iproute2 commands {' and '.join(missing)}, which are not on PATH; "
                "install iproute2 (apt-get install iproute2) or use the emulated link (--bandwidth-gbps)"
            )

    def _setup(self) -> None:
        self.subnet = _free_subnet(self.tag)
        _add_bridge(self.bridge, self.master_addr, self._made)
        for w in range(self.workers):
            ns = self.namespace(w)
            _run(["ip", "netns", "add", ns])
            self._made.append(("ns", ns))
            _add_uplink(ns, f"elh{self.tag}w{w}", self.bridge, f"{self.subnet}.{10 + w}", self.bandwidth_gbps,
                        self._made)


class JobLink(_ShapedLink):
    """One job's worker behind a shaped uplink on a bridge the jobs of one run share on one machine (``eagerloco
    launch --outer-addr 127.0.0.1:PORT --worker-id I --kernel-link-gbps B``).

    The bridge is named after the outer port (``elbj<port>``), its subnet picked by the first job; worker I is
    10.213.X.(10 + I) in namespace ``eloc<pid>w<I>``; the run's coordinator on this machine is reached at the
    bridge's own address (:attr:`master_addr`). Changes happen under one machine-wide lock; the last job removes the
    bridge, the next one a killed job's leftovers, and a second claim of the same worker (``elj<port>w<I>`` taken)
    is refused."""

    def __init__(self, port: int, worker: int, workers: int, bandwidth_gbps: float, tag: int | None = None) -> None:
        super().__init__(workers, bandwidth_gbps, tag)
        self.port, self.worker = port, worker
        self.bridge = f"{_JOB_BRIDGE}{port}"
        self.uplink = f"{_JOB_VETH}{port}w{worker}"
        self.ns = f"{_PREFIX}{self.tag}w{worker}"

    def command(self, cmd: Sequence[str], worker: int = 0) -> list[str]:
        """cmd run in this job's namespace (worker: as for KernelLink; this job has one)."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def _setup(self) -> None:
        subnet = _bridge_subnet(self.bridge)
        if subnet is None:
            self.subnet = _free_subnet(self.port)
            _add_bridge(self.bridge, self.master_addr, self._made)
        else:
            self.subnet = subnet
        r = _run(["ip", "link", "show", "dev", self.uplink], check=False)
        if r.returncode == 0:
            raise LinkShapingError(
                f"worker {self.worker} of the run at port {self.port} already runs on this machine (its uplink "
                f"{self.uplink} exists): give each job its own --worker-id, or a new run another --outer-addr port"
            )
        _run(["ip", "netns", "add", self.ns])
        self._made.append(("ns", self.ns))
        _add_uplink(self.ns, self.uplink, self.bridge, f"{self.subnet}.{10 + self.worker}", self.bandwidth_gbps,
                    self._made)

    def close(self) -> None:
        """Remove this job's namespace (and with it its uplink); the last job out removes the bridge."""
        with _setup_lock():
            _remove([m for m in self._made if m != ("link", self.bridge)])
            self._made.clear()
            _remove_idle_job_bridges()


def _bridge_subnet(bridge: str) -> str | None:
    """The 10.213.X of a job bridge that exists, else None."""
    r = _run(["ip", "-o", "-4", "addr", "show", "dev", bridge], check=False)
    if r.returncode != 0:
        return None
    # "5: elbj29600    inet 10.213.7.1/24 scope global elbj29600 ..."
    for word in r.stdout.split():
        if word.startswith("10.213.") and word.endswith(".1/24"):
            return word[: -len(".1/24")]
    raise LinkShapingError(f"the bridge {bridge} exists without its 10.213.X.1/24 address; remove it "
                           f"(ip link del {bridge}) and start the jobs again")


def _remove_idle_job_bridges() -> list[str]:
    """Remove every job bridge (elbj<port>) no uplink is attached to; call under _setup_lock, where a
    bridge being built already has its first uplink."""
    removed = []
    links = _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout
    for line in links.splitlines():
        fields = line.split(": ")
        name = fields[1].split("@")[0] if len(fields) > 1 else ""
        if name.startswith(_JOB_BRIDGE) and name[len(_JOB_BRIDGE):].isdigit():
            if not _run(["ip", "-o", "link", "show", "master", name], check=False).stdout.strip():
                _run(["ip", "link", "del", name], check=False)
                removed.append(name)
    return removed


def remove_stale() -> list[str]:
    """Remove namespaces and bridges left by a launcher that was killed (its pid is gone), and the
    job bridges those leave without members; call under _setup_lock."""
    removed = []
    ns = _run(["ip", "netns", "list"], check=False).stdout.split()
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    # `ip -o link show` lines read "7: elh123w0@if2: <BROADCAST,...> mtu ...".
    names = [fields[1].split("@")[0] for line in links.splitlines() if len(fields := line.split(": ")) > 1]
    for kind, candidates in (("netns", ns), ("link", names)):
        for name in candidates:
            pid = owner_pid(name)
            if pid is not None and not pid_alive(pid):
                _run(["ip", kind, "del", name], check=False)
                removed.append(name)
    return removed + _remove_idle_job_bridges()


def owner_pid(name: str) -> int | None:
    """The launcher pid a namespace (eloc<pid>w<worker>) or bridge (elbr<pid>) is named after, else None."""
    if name.startswith(_PREFIX):
        pid, sep, worker = name[len(_PREFIX):].partition("w")
        return int(pid) if pid.isdigit() and sep and worker.isdigit() else None
    if name.startswith("elbr") and name[4:].isdigit():
        return int(name[4:])
    return None
