"""How a run's workers are started and reach each other: none of it changes the numbers."""

from __future__ import annotations

from dataclasses import dataclass

from eagerloco.config.checks import check_choice, check_int_at_least, check_switch, host_port, is_finite, setting
from eagerloco.environment import Environment
from eagerloco.errors import ConfigError

BACKENDS = ("gloo", "nccl")
_GROUP = "multi-process"
#: A week: longer waits than this are no timeout (and overflow the timedelta torch.distributed takes).
MAX_DIST_TIMEOUT = 7 * 24 * 3600.0


@dataclass
class RuntimeConfig:
    """Where the workers run and how they meet. In one process by default; under ``eagerloco launch`` or
    torchrun one rank per process; with ``outer_addr`` each worker a job of its own."""

    ranks_per_worker: int | None = setting(None, group=_GROUP, shown_default="the launcher's, else 1")
    """R: ranks per worker, data-parallel inside it."""
    fsdp: bool = setting(False, group=_GROUP)
    """Shard each worker's parameters, gradients and optimizer state over its ranks (FSDP2) instead of
    replicating them; every rank then exchanges its own shard with the same rank of the other workers,
    each over 1/R of the worker's link (needs ranks_per_worker 2 or more)."""
    backend: str | None = setting(None, choices=BACKENDS, group=_GROUP, shown_default="nccl with CUDA, else gloo")
    """Backend of the group inside each worker."""
    outer_backend: str = setting("gloo", choices=BACKENDS, group=_GROUP)
    """Backend of the outer group between workers: gloo (payloads move through pinned host memory and a
    dead peer is an exception) or nccl (payloads stay on the GPU)."""
    dist_timeout: float = setting(300.0, group=_GROUP)
    """Seconds before a silent peer (no heartbeat, or a collective that stopped) is declared dead, above 0 and at
    most 604800 (a week); a peer alive but behind is waited for as long as its inner steps advance, each
    within this."""
    outer_addr: str | None = setting(None, metavar="HOST:PORT", group=_GROUP,
                                     shown_default="$EAGERLOCO_OUTER_ADDR")
    """Each worker its own job (one process, started on its own): the coordinator (`eagerloco coordinator`) at
    this address and port; every job passes the same workers and its own worker_id (and its own out)."""
    worker_id: int | None = setting(None, metavar="I", group=_GROUP, shown_default="$EAGERLOCO_WORKER_ID")
    """This job's worker, 0..M-1, with outer_addr."""
    elastic: bool = setting(False, group="faults")
    """Multi-process: when a worker dies the others go on (mean over the workers present); without it they
    stop with an error naming it. A worker that comes back is admitted again at a round boundary: under
    `eagerloco launch` with --rejoin, across separate jobs (--outer-addr) when started against the run."""
    rejoin: bool = setting(False, group="faults")
    """This process comes back into a running elastic run (environment: the run's MASTER_ADDR,
    MASTER_PORT and WORLD_SIZE, RANK = its worker id); a live worker hands it the current state at the
    next round boundary."""
    kernel_link_gbps: float | None = setting(None, cli=False)
    """The uplink rate (Gbit/s) the kernel shapes for this worker (``eagerloco launch --kernel-link-gbps``
    sets it through the environment); None: the whole link is emulated."""

    def resolve(self, env: Environment) -> RuntimeConfig:
        """Fill what was left to the environment (the launcher's R, the outer rendezvous, a restart,
        the kernel's link); returns self."""
        if self.ranks_per_worker is None:
            self.ranks_per_worker = env.ranks_per_worker or 1
        if self.outer_addr is None and env.outer_addr:
            self.outer_addr = env.outer_addr
            if self.worker_id is None:
                self.worker_id = env.worker_id
        self.rejoin = self.rejoin or env.rejoin
        if self.kernel_link_gbps is None:
            self.kernel_link_gbps = env.kernel_link_gbps
        return self

    def kind(self, env: Environment) -> str:
        """Which runtime runs this process (a key of :data:`eagerloco.train.RUNTIMES`)."""
        if self.outer_addr:
            return "job"
        if env.launched:
            return "elastic" if self.elastic else "distributed"
        return "inprocess"

    def validate(self, workers: int, env: Environment, device: str = "auto") -> RuntimeConfig:
        """Resolve, then check the settings against each other, ``workers`` (M), ``env`` and ``device`` (elastic
        groups are CPU-only); ConfigError naming the setting and the fix."""
        self.resolve(env)
        for name in ("fsdp", "elastic", "rejoin"):
            check_switch(name, getattr(self, name))
        check_int_at_least("ranks_per_worker", self.ranks_per_worker, 1)
        if self.backend is not None:
            check_choice("backend", self.backend, BACKENDS)
        check_choice("outer_backend", self.outer_backend, BACKENDS)
        t = self.dist_timeout
        if not is_finite(t) or not 0 < t <= MAX_DIST_TIMEOUT:
            raise ConfigError(f"--dist-timeout must be a number of seconds above 0 and at most {MAX_DIST_TIMEOUT:g} "
                              f"(a week), got {t!r}")
        r = self.ranks_per_worker
        assert r is not None  # resolve() filled it
        kind = self.kind(env)
        if kind == "job":
            self._validate_job(workers, env)
        elif self.worker_id is not None:
            raise ConfigError("--worker-id needs --outer-addr HOST:PORT (worker 0's outer rendezvous); without it "
                              "the workers run in this process or under `eagerloco launch`")
        if kind == "inprocess" and (r != 1 or self.fsdp):
            flag = "--fsdp" if self.fsdp else "--ranks-per-worker"
            raise ConfigError(f"{flag} needs several processes: use `eagerloco launch` or torchrun")
        launched = kind in ("distributed", "elastic")  # (a job under `eagerloco launch` is one process of its own)
        if launched and env.workers is not None and (env.workers, env.ranks_per_worker or 1) != (workers, r):
            raise ConfigError(
                f"the launcher started {env.workers} workers x {env.ranks_per_worker or 1} ranks, but --workers "
                f"{workers} and --ranks-per-worker {r} were passed to train; pass the same numbers to both"
            )
        if self.fsdp and r < 2:
            raise ConfigError(f"--fsdp shards each worker's model over its ranks, but there is {r} rank per worker: "
                              "pass --ranks-per-worker 2 or more (to the launcher and to train), or drop --fsdp")
        self._validate_elastic(kind, device)
        return self

    def _validate_job(self, workers: int, env: Environment) -> None:
        host_port("outer_addr", str(self.outer_addr))
        w = self.worker_id
        if w is None or isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < (1 << 20 if self.elastic
                                                                                     else workers):
            raise ConfigError(f"--worker-id must be an integer in 0..{workers - 1} (one per job; beyond, with "
                              f"--elastic, a worker joining a run under way), got {w!r}")
        if (env.world_size or 1) > 1:
            raise ConfigError("`eagerloco train --outer-addr` runs one process per worker; start it with python, "
                              "not torchrun, or make each worker a job of several ranks with the hook API "
                              "(eagerloco.outer_loop, examples/)")
        if self.rejoin:
            raise ConfigError("--rejoin is for `eagerloco launch --elastic` runs; with --outer-addr --elastic a "
                              "worker started against a run under way joins it (--resume: from its own checkpoints)")

    def _validate_elastic(self, kind: str, device: str) -> None:
        if self.rejoin and not self.elastic:
            raise ConfigError("--rejoin needs --elastic: only an elastic run admits a worker that comes back")
        if not self.elastic:
            return
        if kind == "inprocess":
            raise ConfigError(
                "--elastic needs the multi-process runtime, where workers can die and come back: "
                "`eagerloco launch --workers M --elastic -- <train args> --elastic`, torchrun, or one job per "
                "worker (--outer-addr HOST:PORT --worker-id I); the in-process runtime has nothing to lose"
            )
        if kind == "elastic":
            if self.ranks_per_worker != 1:
                raise ConfigError(
                    "--elastic supports one rank per worker (--ranks-per-worker 1): a worker of several ranks "
                    "would need its inner group re-formed as well"
                )
            if self.backend == "nccl" or self.outer_backend == "nccl" or device.startswith("cuda"):
                raise ConfigError("--elastic re-forms gloo groups on the CPU; drop --backend nccl, --outer-backend "
                                  "nccl and --device cuda")
