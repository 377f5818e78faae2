"""How the workers of a run meet: the rendezvous, the agreement there, and the waits both take.

The rendezvous is either each worker its own job meeting at the coordinator (:func:`join_outer_group`), or one
torchrun WORLD of M x R ranks (:func:`init_process_groups`); :class:`Meeting` compares what must match before
the first step. Every wait is bounded, says whom it waits for and ends at once on Ctrl-C: a TCPStore or gloo
group waiting on absent peers blocks in C++ with no line and Ctrl-C ignored.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from eagerloco.comm.errors import PeerError, describe_exception, is_transport_failure
from eagerloco.comm.groups import (
    DEFAULT_TIMEOUT_S,
    HEARTBEAT_PREFIX,
    OUTER_PG_PREFIX,
    DistContext,
    gloo_group,
    process_groups,
    world_backend,
)
from eagerloco.config import ConfigError
from eagerloco.config.checks import host_port
from eagerloco.environment import Environment

T = TypeVar("T")
#: Seconds between the lines saying whom a wait still waits for.
REPORT_EVERY_S = 10.0
#: Where the agreements keep their keys in the run's store.
AGREE_PREFIX = "agree/"
#: The n-th connection (and meeting) of this process meets under its own keys: every process of a run makes
#: the same ones, in the same order (a process may run several runs, or several outer loops).
_MEETINGS = itertools.count()


# ---------------------------------------------------------------------------------------------- bounded waits
def poll(pending: Callable[[], Sequence[T]], timeout_s: float, waiting: Callable[[Sequence[T]], str] | None = None,
         *, interval_s: float = 0.1, report_every_s: float = REPORT_EVERY_S,
         started: float | None = None) -> Sequence[T]:
    """Call ``pending()`` until it returns nothing or ``timeout_s`` has passed since ``started``, printing what is
    pending every ``report_every_s``; returns what was still pending at the deadline (empty: success)."""
    start = time.monotonic() if started is None else started
    last = time.monotonic()
    while True:
        left = pending()
        now = time.monotonic()
        if not left or now - start >= timeout_s:
            return left
        if waiting is not None and now - last >= report_every_s:
            last = now
            print(f"eagerloco: {waiting(left)} ({now - start:.0f} s of {timeout_s:g})", file=sys.stderr, flush=True)
        if interval_s > 0:
            time.sleep(interval_s)


def bounded(fn: Callable[[], T], timeout_s: float, waiting: str, report_every_s: float = REPORT_EVERY_S,
            slack_s: float = 5.0, started: float | None = None) -> T:
    """``fn()``, which may block in C++, run on a daemon thread this one polls, so the wait is bounded, reported
    and ended by Ctrl-C (a call left running dies with the process). TimeoutError after timeout_s + slack_s."""
    result: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # handed to the waiting thread
            result.append((False, e))

    def running() -> list[threading.Thread]:
        t.join(0.1)
        return [] if result else [t]

    t = threading.Thread(target=run, name="eagerloco-rendezvous", daemon=True)
    t.start()
    if poll(running, timeout_s + slack_s, lambda _: waiting, interval_s=0, report_every_s=report_every_s,
            started=started):
        raise TimeoutError(f"{waiting}: no answer within {timeout_s:g} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def wait_for_listener(host: str, port: int, timeout_s: float, waiting: str,
                      report_every_s: float = REPORT_EVERY_S) -> None:
    """Wait until something accepts connections at ``host:port``, probing with plain connections (TimeoutError)."""
    def closed() -> list[str]:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return []
        except socket.gaierror:
            raise
        except OSError:  # refused, unreachable, timed out: not there yet
            return [f"{host}:{port}"]

    if poll(closed, timeout_s, lambda _: waiting, interval_s=0.2, report_every_s=report_every_s):
        raise TimeoutError(f"{waiting}: no answer within {timeout_s:g} s")


# ---------------------------------------------------------------------------------------------- the coordinator
def store_unreachable(e: BaseException) -> bool:
    """Whether e is a store client failing to reach its store (not a key that did not come in time)."""
    text = str(e)
    return type(e).__name__ == "DistNetworkError" or any(
        w in text for w in ("Broken pipe", "Connection reset", "Connection refused", "Failed to recv"))


class StoreView(dist.Store):
    """The keys under ``prefix`` of a store: torch's PrefixStore does not pass ``delete_key`` on to a store
    written in Python (a :class:`CoordinatorClient`, which is a view of its TCPStore client), so ours go through
    this one. Every call goes through :meth:`_call`."""

    def __init__(self, prefix: str, store: dist.Store) -> None:
        super().__init__()
        self.prefix, self.store = prefix, store

    def _call(self, fn: Callable[[dist.Store], T]) -> T:
        return fn(self.store)

    def set(self, key: str, value: Any) -> None:
        self._call(lambda s: s.set(self.prefix + key, value))

    def get(self, key: str) -> bytes:
        return self._call(lambda s: s.get(self.prefix + key))

    def add(self, key: str, value: int) -> int:
        return self._call(lambda s: s.add(self.prefix + key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(lambda s: s.compare_set(self.prefix + key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda s: s.check([self.prefix + k for k in keys]))

    def delete_key(self, key: str) -> bool:
        return self._call(lambda s: s.delete_key(self.prefix + key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(lambda s: s.wait([self.prefix + k for k in keys], *([] if timeout is None else [timeout])))


class CoordinatorClient(StoreView):
    """A client of the coordinator's store that outlives the coordinator's restarts.

    torch's TCPStore client does not reconnect, so this one opens a new client when a call fails and sets again
    the keys this worker keeps (:meth:`keep`): a restarted coordinator starts empty. Only the thread that made
    the client waits for the coordinator (other threads fail at once); away longer than ``timeout_s`` raises
    :class:`PeerError`. Formed gloo groups do not use the store, so exchanges go on meanwhile.
    """

    def __init__(self, host: str, port: int, timeout_s: float, me: str) -> None:
        self.host, self.port, self.timeout_s, self.me = host, port, timeout_s, me
        super().__init__("", self._connect())
        self.kept: dict[str, str] = {}
        self.lost_since: float | None = None
        self.owner = threading.get_ident()  # the thread that waits for a coordinator that restarts
        self._lock = threading.Lock()

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=self.timeout_s))

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def keep(self, key: str, value: str) -> None:
        """Set ``key`` and set it again in a coordinator that restarted."""
        self.kept[key] = value
        self.set(key, value)

    def _call(self, fn: Callable[[dist.Store], T]) -> T:
        client = self.store
        try:
            return fn(client)
        except Exception as e:
            if not store_unreachable(e):
                raise
        self._reconnect(client)
        return fn(self.store)

    def _reconnect(self, failed: dist.Store) -> None:
        with self._lock:
            if self.store is not failed:  # another thread reconnected meanwhile
                return
            now = time.monotonic()
            self.lost_since = self.lost_since or now
            left = self.timeout_s - (now - self.lost_since)
            waiting = f"{self.me}: waiting for the coordinator at {self.where} (it restarted, or the network is cut)"
            try:
                mine = threading.get_ident() == self.owner  # only its thread waits; the others look once
                wait_for_listener(self.host, self.port, max(left, 0.0) if mine else 0.0, waiting)
                self.store = self._connect()
                for key, value in self.kept.items():
                    self.store.set(key, value)
            except Exception as e:
                away = time.monotonic() - self.lost_since
                if away < self.timeout_s:
                    raise
                raise PeerError(f"{self.me} lost the coordinator at {self.where} for {away:.0f} s (--dist-timeout "
                                f"{self.timeout_s:g}): stopping, since the workers that still reach it go on without "
                                "this one; restart it with the same command (and --resume) to rejoin "
                                f"({describe_exception(e)})", []) from None
            self.lost_since = None

    def delete_key(self, key: str) -> bool:
        self.kept.pop(key, None)
        return super().delete_key(key)

    def num_keys(self) -> int:
        return self._call(lambda s: s.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)


def prefixed(prefix: str, store: dist.Store) -> dist.Store:
    """The keys under ``prefix`` of ``store`` (a :class:`StoreView` of a coordinator's client)."""
    python = isinstance(store, (CoordinatorClient, StoreView))
    return StoreView(prefix, store) if python else dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- agreement
def parameter_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the values of ``tensors``: equal digests, bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def shapes_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The parameter names and shapes of a model, in a few words: count, size and a digest."""
    items = [(n, list(p.shape), str(p.dtype)) for n, p in named]
    digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12]
    return f"{len(items)} tensors, {sum(torch.Size(s).numel() for _, s, _ in items):,} values ({digest})"


def publish_and_gather(store: dist.Store, me: int, ids: list[int], mine: Mapping[str, Any], timeout_s: float,
                       name: Callable[[int], str], where: str = "", prefix: str = AGREE_PREFIX,
                       report_every_s: float = REPORT_EVERY_S) -> dict[int, dict[str, Any]]:
    """Publish ``mine`` (JSON) as participant ``me`` and return every participant's, by id."""
    store.set(f"{prefix}{me}", json.dumps(mine, sort_keys=True, default=str))
    at = f" at {where}" if where else ""
    missing = poll(lambda: [i for i in ids if i != me and not store.check([f"{prefix}{i}"])], timeout_s,
                   lambda left: f"{name(me)}: waiting for {', '.join(name(i) for i in left)}{at}",
                   report_every_s=report_every_s)
    if missing:
        raise PeerError(f"{name(me)}: {', '.join(name(i) for i in missing)} did not arrive within {timeout_s:g} s"
                        f"{at}; start every worker with the same rendezvous (and check that each one started)",
                        list(missing))
    return {i: json.loads(store.get(f"{prefix}{i}").decode()) for i in ids}


def differences(everyone: Mapping[int, Mapping[str, Any]], name: Callable[[int], str]) -> list[str]:
    """Each setting whose value differs between participants, with every participant's value."""
    out = []
    for key in sorted({k for settings in everyone.values() for k in settings}):
        values = {i: settings.get(key) for i, settings in everyone.items()}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            out.append(f"{key} (" + ", ".join(f"{name(i)}: {_show(v)}" for i, v in values.items()) + ")")
    return out


def check_agreement(everyone: Mapping[int, Mapping[str, Any]], name: Callable[[int], str], fix: str,
                    fixes: Sequence[tuple[str, str]] = ()) -> None:
    """Raise ConfigError, one line, naming each setting that differs and each participant's value, with ``fix``
    (or a setting's own advice from ``fixes``)."""
    diff = differences(everyone, name)
    if not diff:
        return
    keys = [d.split(" (", 1)[0] for d in diff]
    advice = [next((f for what, f in fixes if k == what or k.startswith(f"{what} ")), fix) for k in keys]
    raise ConfigError(f"the workers disagree on settings that must match: {'; '.join(diff)}. "
                      f"{' '.join(dict.fromkeys(advice))}")


def _show(v: Any) -> str:
    return "absent" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


@dataclass(frozen=True)
class Meeting:
    """Where the processes of a run agree before the first step: the run's store, this process's id among
    the participants, every participant's id, how messages name one, and the store's address."""

    store: Any
    me: int
    ids: list[int]
    name: Callable[[int], str]
    where: str = ""
    prefix: str = field(default_factory=lambda: f"{AGREE_PREFIX}{next(_MEETINGS)}/")

    def gather(self, mine: Mapping[str, Any], topic: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every participant's ``mine`` on ``topic``, by id (:func:`publish_and_gather`)."""
        return publish_and_gather(self.store, self.me, self.ids, mine, timeout_s, self.name, self.where,
                                  prefix=f"{self.prefix}{topic}/")

    def agree(self, mine: Mapping[str, Any], topic: str, timeout_s: float, fix: str,
              fixes: Sequence[tuple[str, str]] = ()) -> None:
        """Compare ``mine`` with every participant's (:func:`check_agreement`)."""
        check_agreement(self.gather(mine, topic, timeout_s), self.name, fix, fixes)


# ---------------------------------------------------------------------------------------------- rendezvous
def init_world(backend: str, timeout_s: float, env: Environment) -> None:
    """``dist.init_process_group`` over the launcher's variables (env://), in a bounded wait."""
    rank, world = env.rank or 0, env.world_size or 1
    where = f"{env.master_addr or 'localhost'}:{env.master_port or '?'}"
    me = f"rank {rank}"
    fix = (f"start all {world} processes of the run (WORLD_SIZE) with the same MASTER_ADDR and MASTER_PORT "
           "(eagerloco launch and torchrun do), and see the other ranks' logs")
    waiting = f"{me}: waiting for the run's {world} processes at {where}"
    # The current GPU is per thread: the waiting thread starts NCCL on this thread's.
    gpu = torch.cuda.current_device() if backend == "nccl" and torch.cuda.is_available() else None

    def init() -> None:
        if gpu is not None:
            torch.cuda.set_device(gpu)
        dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s))

    started = time.monotonic()
    try:
        if rank != 0 and env.master_port is not None:  # the store's client retries with C++ frames: connect once
            wait_for_listener(env.master_addr or "localhost", env.master_port, timeout_s, waiting)  # it listens
        bounded(init, timeout_s, waiting, started=started)
    except TimeoutError:
        raise PeerError(f"{me}: the run's {world} processes did not all arrive at {where} within {timeout_s:g} s; "
                        f"{fix}", []) from None
    except Exception as e:
        if not (is_transport_failure(e) or isinstance(e, OSError)):
            raise
        raise PeerError(f"{me}: the run's rendezvous at {where} failed ({describe_exception(e)}); {fix}", []) from None


def init_process_groups(workers: int, ranks_per_worker: int = 1, backend: str | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S, outer_backend: str | None = "gloo",
                        sharded_outer: bool = False) -> DistContext:
    """Join the run started by torchrun or ``eagerloco launch`` and build the inner and outer groups
    (:func:`~eagerloco.comm.groups.process_groups`)."""
    backend, device = world_backend(workers, ranks_per_worker, backend, timeout_s, outer_backend, sharded_outer)
    env = Environment.read()
    if not dist.is_initialized():
        init_world(backend, timeout_s, env)
    elif dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError("torch.distributed is already initialized with a different rank or world size")
    return process_groups(workers, ranks_per_worker, backend, device, timeout_s, outer_backend, sharded_outer)


@dataclass(frozen=True)
class OuterRendezvous:
    """Where the workers of a run find each other when each is its own job: the coordinator's TCPStore at
    host:port (``eagerloco coordinator``, or the launcher's under ``eagerloco launch --elastic``), which every
    worker's first rank connects to. ``single``: this process is the whole worker (a rank of ``eagerloco launch
    --elastic``, whose RANK and WORLD_SIZE number the workers); else the job's WORLD is the worker's ranks."""

    host: str
    port: int
    worker: int
    workers: int
    single: bool = False

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, addr: str, worker: int | None, workers: int | None, grow: bool = False) -> OuterRendezvous:
        """From ``host:port``, this worker's id and the number of workers; ConfigError if invalid. ``grow``: an id
        beyond the workers is allowed (a worker joining an elastic run under way)."""
        host, port = host_port("outer_addr", str(addr))
        if workers is None or isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"--workers must be an integer >= 1 with --outer-addr, got {workers!r}")
        if (worker is None or isinstance(worker, bool) or not isinstance(worker, int) or worker < 0
                or (worker >= workers and not grow)):
            raise ConfigError(f"--worker-id must be an integer in 0..{workers - 1} (one per job), got {worker!r}")
        return cls(host.strip("[]"), port, worker, workers)


def wait_for_workers(store: dist.Store, me: int, workers: int, timeout_s: float, where: str,
                     report_every_s: float = REPORT_EVERY_S) -> None:
    """Wait until all ``workers`` joined the coordinator, refusing one started with another M."""
    others = [w for w in range(workers) if w != me]

    def missing() -> list[int]:
        present = [w for w in others if store.check([f"eagerloco/join/{w}"])]
        for w in present:
            other = int(store.get(f"eagerloco/size/{w}").decode()) if store.check([f"eagerloco/size/{w}"]) else workers
            if other != workers:
                raise ConfigError(f"the workers at {where} were started with different --workers: worker {me} with "
                                  f"{workers}, worker {w} with {other}; start every worker with the same --workers")
        return [w for w in others if w not in present]

    def names(left: Sequence[int]) -> str:
        return ", ".join(f"worker {w}" for w in left)

    left = poll(missing, timeout_s, lambda left: f"worker {me}: waiting for {names(left)} at {where}",
                report_every_s=report_every_s)
    if left:
        raise PeerError(f"worker {me}: {names(left)} did not join the outer rendezvous at {where} within "
                        f"{timeout_s:g} s; start all {workers} workers with the same --outer-addr and --workers",
                        list(left))


#: Set once the workers formed the run's first outer group: a worker that arrives later joins a run under way.
STARTED_KEY = "eagerloco/started"


def join_outer_group(rdzv: OuterRendezvous, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the other workers as one job of several: this job's WORLD is the worker's inner group.

    WORLD is initialized here (env://) if the job has several processes and nobody did. The job's rank 0
    connects to the coordinator at ``host:port`` and forms the outer gloo group of the M workers under its own
    key prefix; a worker that arrives after the group was formed is a joiner (``ctx.joining``).
    """
    if not (timeout_s > 0):
        raise ConfigError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    env = Environment.read()
    rank, world = (0, 1) if rdzv.single else (env.rank or 0, env.world_size or 1)
    if not dist.is_initialized() and world > 1:
        init_world("nccl" if torch.cuda.is_available() else "gloo", timeout_s, env)
    backend = "gloo"
    if dist.is_initialized() and not rdzv.single:
        rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    local_rank = env.local_rank or 0
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    ctx = DistContext(rank=rank, world_size=world, worker=rdzv.worker, rank_in_worker=rank, workers=rdzv.workers,
                      ranks_per_worker=world, local_rank=local_rank, device=device, backend=backend,
                      timeout_s=timeout_s, separate_jobs=True)
    if rank != 0:
        return ctx
    where, me = rdzv.where, f"worker {rdzv.worker}"
    waiting = f"{me}: waiting for the coordinator at {where}"
    fix = "check --outer-addr and that a coordinator runs there (`eagerloco coordinator`)"
    started = time.monotonic()
    try:  # the store's client only once the coordinator listens: its own retries print C++ frames
        wait_for_listener(rdzv.host, rdzv.port, timeout_s, waiting)
        store = bounded(lambda: CoordinatorClient(rdzv.host, rdzv.port, timeout_s, me), timeout_s, waiting,
                        started=started)
    except TimeoutError:
        raise PeerError(f"{me} cannot reach the coordinator at {where}: no answer within {timeout_s:g} s; {fix}",
                        []) from None
    except Exception as e:
        raise PeerError(f"{me} cannot reach the coordinator at {where} ({describe_exception(e)}); {fix}", []) from None
    store.owner = threading.get_ident()
    ctx.outer_store, ctx.store = store, StoreView(HEARTBEAT_PREFIX, store)
    first = store.add(f"eagerloco/join/{rdzv.worker}", 1) == 1
    if store.check([STARTED_KEY]):
        ctx.joining = True
        return ctx
    if rdzv.worker >= rdzv.workers:
        raise ConfigError(f"--worker-id {rdzv.worker} is beyond --workers {rdzv.workers}: a new worker id joins only "
                          f"an elastic run under way; the run at {where} has not started")
    if not first:
        raise ConfigError(f"two jobs joined {where} as worker {rdzv.worker}: give each job its own --worker-id "
                          f"in 0..{rdzv.workers - 1} (or use a fresh coordinator for a new run)")
    store.set(f"eagerloco/size/{rdzv.worker}", str(rdzv.workers))
    wait_for_workers(store, rdzv.worker, rdzv.workers, timeout_s, where)
    try:
        group = bounded(lambda: gloo_group(dist.PrefixStore(OUTER_PG_PREFIX, store), rdzv.worker, rdzv.workers,
                                           timeout_s), timeout_s, f"{me}: forming the outer group at {where}")
    except Exception as e:
        raise PeerError(f"{me}: the outer rendezvous at {where} did not complete within {timeout_s:g} s "
                        f"({describe_exception(e)}); start all {rdzv.workers} workers with the same --outer-addr "
                        "and --workers", []) from None
    store.keep(STARTED_KEY, "1")
    ctx.outer_group = group
    return ctx


def leave_outer_group(ctx: DistContext) -> None:
    """Shut down and free a group formed across jobs now: gloo's threads end only when the group is freed, and
    freed during interpreter teardown they can abort a process that succeeded (status 134)."""
    group = ctx.outer_group
    if group is not None:
        group.shutdown()
    ctx.outer_group = None
    ctx.store = ctx.outer_store = None
    del group
    gc.collect()
