"""Heartbeats of the outer ranks in the run's store, and the diagnosis read from them on a failure.

Every outer rank writes ``hb/<worker>[/<channel>]`` = "wall time, last exchange entered, state, step, inner
steps done"; when a collective fails the survivors name the workers whose heartbeat went stale, that closed,
or that never reached the failed exchange. Before a collective a worker waits for a peer that is behind but
still stepping (:meth:`Heartbeat.wait_for_peers`): slow is not dead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch.distributed as dist

from eagerloco import events
from eagerloco.comm.errors import PEER_EXIT_CODE, PeerError

#: How often each outer rank refreshes its heartbeat in the store (seconds).
HEARTBEAT_S = 1.0

Suspects = list[tuple[int, str]]


class Beat(NamedTuple):
    """One heartbeat as :meth:`Heartbeat.publish` writes it."""

    at: float  # wall time
    entered: int  # the last exchange entered
    state: str  # up, failed or closed
    step: int
    steps_done: int  # inner steps completed

    def age(self) -> float:
        return time.time() - self.at


def read_beat(store: dist.Store, key: str) -> Beat | None:
    """The heartbeat at ``key``; None before the first one."""
    if not store.check([key]):
        return None
    at, entered, state, step, done = store.get(key).decode().split()
    return Beat(float(at), int(entered), state, int(step), int(done))


class Heartbeat:
    """One outer rank's heartbeat: a thread that publishes it, and a reader of the others'. The communication
    thread never talks to the store itself (a slow store must not delay exchanges): it calls :meth:`announce`."""

    def __init__(self, store: dist.Store | None, worker: int, channel: int = 0, interval_s: float = HEARTBEAT_S,
                 progress: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self.store, self.worker, self.channel = store, worker, channel
        self.interval_s = interval_s
        #: A heartbeat older than this marks its worker gone or frozen.
        self.stale_s = max(3 * interval_s, 2.0)
        self.state = "up"
        self._progress = progress
        #: Inner steps this worker completed (announced through :mod:`eagerloco.events`): a slow peer's progress.
        self.steps_done = 0
        self._unwatch = events.on_inner_step(self._count_step)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self.publish()
            self._thread = threading.Thread(target=self._loop, name="eagerloco-hb", daemon=True)
            self._thread.start()

    def key(self, w: int) -> str:
        """The store key of worker w's heartbeat on this channel."""
        return f"hb/{w}" if self.channel == 0 else f"hb/{w}/{self.channel}"

    def announce(self, state: str | None = None) -> None:
        """Have the heartbeat thread publish now (a new exchange entered, or a new state)."""
        if state is not None:
            self.state = state
        self._wake.set()

    def publish(self) -> None:
        """Write this worker's heartbeat: time, last exchange entered, state (up, failed, closed), step."""
        if self.store is None:
            return
        with self._lock:
            entered, step = self._progress()
            try:
                self.store.set(self.key(self.worker),
                               f"{time.time():.3f} {entered} {self.state} {step} {self.steps_done}")
            except Exception:  # the store is away (a coordinator restarting): the next beat tries again
                pass

    def stop(self, state: str) -> None:
        """Stop the thread and publish a last heartbeat with this state ("failed" or "closed")."""
        self._unwatch()
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2.0)
        self.state = state
        self.publish()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.publish()

    def _count_step(self, worker: int, step: int) -> None:
        if worker == self.worker:
            self.steps_done = step
            self.announce()  # the peers that wait for this worker see its progress at once

    def wait_for_peers(self, seq: int, members: list[int], names: Mapping[int, str], patience_s: float,
                       cancel: threading.Event) -> None:
        """Before exchange seq's collective, wait for peers that have not entered it yet while they are alive and
        stepping, so the collective's timeout only ever meets a silent peer.

        Returns at once when every peer has entered or is at this worker's step, or one is silent or gone (the
        collective then fails and :meth:`diagnose` names it). PeerError when a live peer's steps stall ``patience_s``.
        """
        if self.store is None:
            return
        mine, pause, seen = self.steps_done, 0.002, {}  # seen: peer -> (its progress, when that last changed)
        while not cancel.is_set():
            now, behind = time.monotonic(), []
            for w in members:
                if w == self.worker:
                    continue
                try:
                    beat = read_beat(self.store, self.key(w))
                    if beat is None:
                        return
                    if beat.entered >= seq or beat.steps_done >= mine:
                        continue
                    if beat.state != "up" or beat.age() > self.stale_s or exit_note(self.store, w):
                        return
                except Exception:  # the store is gone: the collective fails and the diagnosis says why
                    return
                progress = (beat.entered, beat.step, beat.steps_done)
                if w not in seen or seen[w][0] != progress:
                    seen[w] = (progress, now)
                elif now - seen[w][1] > patience_s:
                    raise PeerError(
                        f"outer exchange #{seq}: {names.get(w, f'worker {w}')} has not reached exchange #{seq} and is "
                        f"alive but took no inner step for {patience_s:g} s (it last entered #{beat.entered}, "
                        f"{beat.steps_done} inner steps done): it "
                        f"is slow or stuck, not dead. If its inner steps are that slow, raise --dist-timeout (now "
                        f"{patience_s:g} s) above one of them; else check its log, then restart all workers and "
                        "resume from the last checkpoint", [w])
                behind.append(w)
            if not behind:
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    # -- diagnosis ----------------------------------------------------------------------------------

    def diagnose(self, seq: int, members: list[int], names: Mapping[int, str],
                 cancel: threading.Event) -> tuple[list[int], list[str]]:
        """Which workers look responsible for the failure of exchange seq, with a note each. Strong evidence (stale,
        closed) wins over weak (not there yet), reported only after waiting long enough for a death to show."""
        if self.store is None:
            return [], ["no heartbeat store, so the failed worker is unknown"]
        deadline = time.monotonic() + self.stale_s + self.interval_s
        while True:
            found = self._read_peers(seq, members, names)
            if isinstance(found, str):
                return [], [found]
            strong, weak = found
            final = time.monotonic() >= deadline or cancel.is_set()
            if strong or final:
                chosen = strong or weak
                return [w for w, _ in chosen], [note for _, note in chosen]
            time.sleep(min(0.2, self.interval_s))

    def _read_peers(self, seq: int, members: list[int], names: Mapping[int, str]) -> tuple[Suspects, Suspects] | str:
        """(strong, weak) suspects with a note each, or why the store could not be read."""
        assert self.store is not None
        strong: Suspects = []
        weak: Suspects = []
        gave_up: Suspects = []
        now = time.time()
        for w in members:
            if w == self.worker:
                continue
            name, key = names.get(w, f"worker {w}"), self.key(w)
            try:
                beat = read_beat(self.store, key)
            except Exception as e:
                return f"the rendezvous store is unreachable ({str(e).splitlines()[0][:120]})"
            if beat is None:
                strong.append((w, f"{name} never started its outer communicator"))
                continue
            age, last, state = now - beat.at, beat.entered, beat.state
            if state == "failed":  # a fellow survivor that already gave up: named only where nothing else is
                gave_up.append((w, f"{name} gave up on this exchange first (its own line says why)"))
                continue
            ended = exit_note(self.store, w)
            if ended:  # the launcher saw its process end: no need to wait for a stale heartbeat
                strong.append((w, f"{name} is gone: {ended} (after exchange #{last})"))
            elif state == "closed":
                strong.append((w, f"{name} closed its communicator after exchange #{last} (done or quit)"))
            elif age > self.stale_s:
                note = f"{name} is gone or frozen (last heartbeat {age:.1f} s ago, at exchange #{last})"
                strong.append((w, note))
            elif last < seq:
                weak.append((w, f"{name} has not reached exchange #{seq} (alive, last entered #{last})"))
        return strong, weak or gave_up


def exit_note(store: dist.Store, w: int) -> str:
    """How worker w's process ended ("its process was killed by signal 9", "its global rank 1 exited
    with code 3"), as ``eagerloco launch`` recorded it; '' when it did not (or under torchrun)."""
    try:
        if not store.check([f"exited/{w}"]):
            return ""
        rc = int(store.get(f"exited/{w}").decode())
        rank = store.get(f"exited-rank/{w}").decode() if store.check([f"exited-rank/{w}"]) else ""
    except Exception:
        return ""
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    return f"its global rank {rank} {how}" if rank else f"its process {how}"


def wait_for_evaluation(store: dist.Store, step: int, me: int, evaluators: Iterable[int], patience_s: float,
                        role: str, *, wait: bool = True, survive: bool = False) -> None:
    """Say that this worker evaluated at ``step`` (if it is one of ``evaluators``), then wait, with no deadline,
    for each other evaluator to say so while it shows signs of life.

    Evaluating may outlast the collective timeout, so the others wait here and give up only when its process
    ended or its heartbeat is older than ``patience_s``: PeerError names it (``survive``: left to the elastic
    membership change that follows). ``role`` says what an evaluator is doing, in that error.
    """
    evaluators = list(evaluators)
    if me in evaluators:
        store.set(f"evaluated/{step}/{me}", "1")
    for worker in evaluators if wait else ():
        key, hb, name = f"evaluated/{step}/{worker}", f"hb/{worker}", f"worker {worker} ({role})"
        try:
            while worker != me and not store.check([key]):
                gone = exit_note(store, worker)
                if gone:
                    raise PeerError(f"{name} is gone while the others waited for it ({key}): {gone}. "
                                    "Check its log, then resume from the last checkpoint.", [worker])
                beat = read_beat(store, hb)
                age = beat.age() if beat is not None else 0.0
                if age > patience_s:
                    raise PeerError(f"{name} is frozen or gone while the others waited for it ({key}): its last "
                                    f"heartbeat is {age:.1f} s old (--dist-timeout {patience_s:g} s). Check its log, "
                                    "then resume from the last checkpoint.", [worker])
                time.sleep(0.2)
        except PeerError:
            if not survive:
                raise
        except Exception as e:
            if not survive:
                raise PeerError(f"the run's store became unreachable while waiting for {name} ({key}: "
                                f"{str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); is the launcher "
                                "still running?", []) from e


def blame_ranks(store: dist.Store, me: int, world: int, ranks_per_worker: int, what: str,
                wait_s: float = 5 * HEARTBEAT_S) -> PeerError:
    """The PeerError for a collective of this process's own (a checkpoint, the inner group) that failed, naming
    the ranks whose process ended or whose ``rank/hb/<rank>`` went stale; evidence is awaited up to ``wait_s``."""
    stale_s = max(3 * HEARTBEAT_S, 2.0)
    deadline = time.monotonic() + wait_s
    while True:
        # A recorded end (killed, exited) outweighs a stale heartbeat: ranks that gave up for that failure stop
        # beating while they shut down, slowly on a busy machine, and would be blamed beside the cause.
        ended: list[tuple[str, int]] = []
        stale: list[tuple[str, int]] = []
        followers = []
        for g in range(world):
            if g == me:
                continue
            who = f"global rank {g} (worker {g // ranks_per_worker})"
            try:
                if store.check([f"rank/exited/{g}"]):
                    rc = int(store.get(f"rank/exited/{g}").decode())
                    if rc == PEER_EXIT_CODE:  # it stopped for a failed peer too: a witness, not a cause
                        followers.append(f"{who} stopped for a failed peer")
                        continue
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    ended.append((f"{who} {how}", g // ranks_per_worker))
                elif (beat := read_beat(store, f"rank/hb/{g}")) is not None:
                    age = beat.age()
                    if age > stale_s:
                        stale.append((f"{who} is frozen or gone (last heartbeat {age:.1f} s ago)",
                                      g // ranks_per_worker))
            except Exception:
                break
        found_ranks = ended or stale
        notes, workers = [n for n, _ in found_ranks], [w for _, w in found_ranks]
        if ended or time.monotonic() >= deadline:  # a stale heartbeat alone: the launcher may record an end yet
            break
        time.sleep(0.2)
    notes = notes or followers
    found = "; ".join(notes) if notes else "no other rank looks dead or frozen"
    advice = "Check its log" if len(notes) == 1 else "Check the logs" if notes else "Check every rank's log"
    return PeerError(f"global rank {me} stopped: {what} failed: {found}. {advice}, then restart all workers and "
                     "resume from the last checkpoint.", sorted(set(workers)))
