"""Elastic membership: workers die and come back, the others go on (see :class:`Membership`)."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.errors import PeerError, describe_exception
from eagerloco.comm.groups import HEARTBEAT_PREFIX, OUTER_PG_PREFIX, gloo_group
from eagerloco.comm.heartbeat import read_beat
from eagerloco.comm.init_sync import broadcast_parameters
from eagerloco.comm.ops import BARRIER
from eagerloco.comm.rendezvous import poll, prefixed
from eagerloco.config import OuterConfig

T = TypeVar("T")
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_POLL_S = 0.05
_STALE_S = 4.0  # a heartbeat older than this marks its worker gone (they are written every second)
_REJOIN_FIX = ("Are the other workers running with --elastic? Otherwise restart the run from the last checkpoint "
               "with --resume")


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x != ""]


def outer_digest(params: list[torch.Tensor]) -> str:
    """SHA-256 of the outer parameters' bytes: equal digests, bit-identical parameters."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


class Membership:
    """This worker's view of who is in the run, and the protocol that changes it.

    torch.distributed cannot shrink or grow a process group, so membership moves in epochs: every change builds a
    new gloo group among the new members over the coordinator's store under ``eagerloco/outer-pg/ep<E>/``. Worker
    ids stay stable (they name data shards, seeds and checkpoints); a worker's rank is its position among the
    sorted member ids. One worker per process.

    A worker dies: each survivor's communicator parks (:meth:`TorchDistCommunicator.pause`) and the survivor runs
    :meth:`recover`: it flags ``ep<E+1>/recovering``, announces itself alive, and once every member has announced
    or is known gone (exited, stale heartbeat) or at the timeout, the first to decide writes the member list with
    compare-and-set, which all adopt. An exchange that completed on any survivor counts in full (passed to those
    that missed it); every later one is rerun among the survivors from their saved payloads, so no partial result
    is applied, and eager's correction uses each exchange's own M so every outer gradient counts exactly once.

    A worker (re)joins: it writes ``join/req/<id>`` and waits; the leader (lowest id) sees it at a round boundary
    and schedules the change at a later boundary b (exchange delay plus two rounds ahead) in ``ep<E>/change``. At
    b the members resolve the exchanges in flight, build the new group, and the leader sends the joiner its whole
    state, so the joiner continues from b+1 as an exact copy except for its data position.

    An elastic run ends with the leader's outer parameters broadcast. A second failure during a change stops the
    run with PeerError (resume from the last checkpoint).
    """

    def __init__(
        self,
        client: dist.Store,
        worker: int,
        workers: int,
        timeout_s: float,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.client, self.group = client, group
        self.kv = prefixed("eagerloco/elastic/", client)
        self.hb = prefixed(HEARTBEAT_PREFIX, client)
        self.worker, self.workers, self.timeout_s = worker, workers, float(timeout_s)
        self.members = list(range(workers))
        self.epoch = 0
        #: The schedule changes follow (:meth:`attach`): inner steps between round boundaries, the exchange delay
        #: and the run's last step (0: unknown).
        self.round, self.delay, self.steps = 1, 0, 0
        self.step = 0
        self.comm: TorchDistCommunicator | None = None
        self.trainer: Any = None  # the eagerloco.train.Worker of this process
        self.recovery_s = 0.0  # wall time spent re-forming groups
        self.source = -1  # a worker admitted into the run under way: the member whose state it receives
        self._busy = False

    # ------------------------------------------------------------------ roles
    @property
    def leader(self) -> int:
        return min(self.members)

    def is_leader(self) -> bool:
        return self.worker == self.leader

    @property
    def pos(self) -> int:
        return self.members.index(self.worker)

    def attach(self, comm: TorchDistCommunicator, trainer: Any, outer: OuterConfig, steps: int = 0) -> None:
        """Wire the communicator (its failures call recover()), the trainer (state handover) and the schedule changes
        follow: round boundaries (``outer``), the run's last step (0: unknown)."""
        self.comm, self.trainer = comm, trainer
        self.round = 1 if outer.per_step else outer.inner_steps
        self.delay, self.steps = outer.apply_delay, steps
        comm.recover_hook = self.recover

    # ------------------------------------------------------------------ groups
    def teardown(self) -> None:
        """Shut the current group down now: its sockets close, so members still blocked in one of its
        collectives fail at once instead of at the timeout."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            group.shutdown()  # gloo's leaves the sockets open: freeing the group is what closes them
        except Exception:  # already broken: nothing more to release
            pass
        held = weakref.ref(group)
        del group
        if held() is not None:  # kept by reference cycles (a failed collective's): a full collection frees it
            gc.collect()  # 0.3-0.6 s with torch loaded, so only then

    def form(self, epoch: int, members: list[int]) -> dist.ProcessGroup:
        """Tear down the current group and build epoch's: a gloo group of its own over the coordinator's store
        (not WORLD's: jobs have none in common), for the exchanges and a change's few control collectives."""
        self.teardown()
        store = dist.PrefixStore(f"{OUTER_PG_PREFIX}ep{epoch}/", self.client)  # type: ignore[attr-defined]
        self.group = gloo_group(store, members.index(self.worker), len(members), self.timeout_s)
        self.epoch, self.members = epoch, list(members)
        self.kv.set("members", ",".join(map(str, members)))
        return self.group

    def event(self, record: dict[str, Any]) -> None:
        """Append an event to the run's log in the store (written by one member only)."""
        record = {"epoch": self.epoch, "step": self.step, "time": time.time(), **record}
        n = self.kv.add("events/count", 1)
        self.kv.set(f"events/{n}", json.dumps(record))

    def events(self) -> list[dict[str, Any]]:
        n = self.kv.add("events/count", 0)
        return [json.loads(self.kv.get(f"events/{i}")) for i in range(1, n + 1)]

    # ------------------------------------------------------------------ per step
    def on_step(self, step: int) -> None:
        """After each inner step: re-form the group if an exchange failed; at a round boundary, follow a change another
        member started and admit joiners (no store round trip on other steps: each would cost a latency)."""
        self.step = step
        comm = self.comm
        assert comm is not None
        comm.step_hint = step + 1  # the step now under way: what it launches belongs to it
        comm.heartbeat.announce()  # heartbeat now: a lost worker's last step is known to the step
        boundary = step % self.round == 0
        if comm.broken or (boundary and self.changing()):
            self.recover()
        if boundary:
            self.boundary(step)

    def guarded(self, fn: Callable[[], T]) -> T:
        """Run a collective of the caller's thread; if a member is gone, re-form the group and retry."""
        for _ in range(self.workers + 1):
            epoch = self.epoch
            try:
                return fn()
            except RuntimeError as e:
                if isinstance(e, PeerError):
                    raise
                cause = describe_exception(e)  # text only: the traceback would keep the broken group alive
            if self.epoch == epoch:
                self.recover(cause=cause)
        raise PeerError(f"worker {self.worker}: a collective kept failing across membership changes; "
                        "resume from the last checkpoint")

    def collect(self, prefix: str) -> dict[int, Any]:
        """Wait until every member has published ``prefix/<id>`` (JSON) in the store; returns them. Through the store
        rather than a collective, so a death never leaves some members inside a collective others completed."""
        comm = self.comm
        assert comm is not None

        def waiting() -> list[int]:
            missing = [w for w in self.members if not self.kv.check([f"{prefix}/{w}"]) and not self._gone(w)]
            if missing and (comm.broken or self.changing()):
                self.recover()
                return [w for w in self.members if not self.kv.check([f"{prefix}/{w}"]) and not self._gone(w)]
            return missing

        left = poll(waiting, 2 * self.timeout_s, lambda w: f"worker {self.worker}: waiting for workers {list(w)} to "
                    f"publish {prefix}", interval_s=_POLL_S)
        if left:
            raise PeerError(f"workers {list(left)} did not publish {prefix} within {2 * self.timeout_s:g} s; "
                            "check their logs, then resume from the last checkpoint")
        # Read again: a member publishes and then closes its heartbeat, so one found missing above may
        # have published in between (and is gone now because it finished, not because it died).
        return {w: json.loads(self.kv.get(f"{prefix}/{w}")) for w in self.members if self.kv.check([f"{prefix}/{w}"])}

    # ------------------------------------------------------------------ a worker is gone
    def recover(self, cause: str = "") -> None:
        """Re-form the group among the survivors and resolve the exchanges in flight (see module doc)."""
        comm = self.comm
        assert comm is not None
        if self._busy:
            raise PeerError(f"worker {self.worker}: another failure during a membership change "
                            f"({cause or comm.failure or 'collective failed'}); resume from the last checkpoint")
        self._busy = True
        t0 = time.perf_counter()
        try:
            comm.pause(self.timeout_s + 10.0)
            ops = comm.exchanges.take_ops()
            cause = cause or comm.failure or "a peer's collective failed"
            self.teardown()  # peers still inside a collective of the old group fail now, not at the timeout
            t_pause = time.perf_counter()
            e = self.epoch + 1
            old = list(self.members)
            self.kv.set(f"ep{e}/recovering", str(self.worker))
            self.kv.set(f"ep{e}/alive/{self.worker}", str(comm.exchanges.done_upto))
            members = self._decide(e, old)
            t_decide = time.perf_counter()
            if self.worker not in members:
                raise PeerError(
                    f"worker {self.worker} was left out of the group re-formed after a failure (it did not "
                    f"answer within {self.timeout_s:g} s); it can come back with --rejoin"
                )
            lost = [w for w in old if w not in members]
            outer = self.form(e, members)
            last = self._settle(ops)
            comm.resume(outer, members, ops, e)
            t_end = time.perf_counter()
            phases = {"pause_s": round(t_pause - t0, 3), "decide_s": round(t_decide - t_pause, 3),
                      "regroup_s": round(t_end - t_decide, 3)}
            if self.is_leader():
                seen = {w: self._last_seen_step(w) for w in lost}
                self.event({"event": "left", "workers": lost, "members": members,
                            "last_included_step": last, "last_seen_step": seen, "rerun_exchanges": len(ops),
                            "cause": cause, **phases})
            dropped = ("; what their error feedback had not sent yet is lost with them"
                       if lost and self.trainer is not None and self.trainer.sync.feedback is not None else "")
            print(f"eagerloco: worker {self.worker}: lost {', '.join(map(str, lost)) or 'no worker'}; "
                  f"continuing with workers {members} (epoch {e}, step {self.step}; {phases}){dropped}", flush=True)
        finally:
            self._busy = False
            self.recovery_s += time.perf_counter() - t0

    def _decide(self, e: int, old: list[int]) -> list[int]:
        key = f"ep{e}/members"

        def unaccounted() -> list[int]:  # neither announced alive nor known gone
            if self.kv.check([key]):
                return []
            return [w for w in old if not self.kv.check([f"ep{e}/alive/{w}"]) and not self._gone(w)]

        poll(unaccounted, self.timeout_s, lambda w: f"worker {self.worker}: waiting for workers {list(w)} to answer "
             "after a failure (alive, or gone)", interval_s=_POLL_S)
        if not self.kv.check([key]):  # the first to decide proposes whoever announced; everyone adopts one list
            alive = ",".join(str(w) for w in sorted(old) if self.kv.check([f"ep{e}/alive/{w}"]))
            return _ids(self.kv.compare_set(key, "", alive).decode())
        return _ids(self.kv.get(key).decode())

    def changing(self) -> bool:
        """Whether a member started a change away from this epoch (this worker follows it: :meth:`recover`)."""
        return self.kv.check([f"ep{self.epoch + 1}/recovering"])

    def departed(self, w: int, silent_s: float) -> bool:
        """Whether member w left the run: its process ended or closed, a new process of it asks to join, or its
        heartbeat is older than ``silent_s`` (the membership's timeout: a quorum's exchanges go on meanwhile)."""
        return self.kv.check([f"join/req/{w}"]) or self._gone(w, silent_s)

    def _gone(self, w: int, stale_s: float = _STALE_S) -> bool:
        """Strong evidence only: the launcher saw it exit, or its heartbeat is stale or says closed."""
        try:
            if self.hb.check([f"exited/{w}"]):
                return True
            beat = read_beat(self.hb, f"hb/{w}")
        except Exception:
            return False
        return beat is not None and (beat.state in ("closed", "failed") or beat.age() > stale_s)

    def _last_seen_step(self, w: int) -> int | None:
        """Inner steps worker w had completed at its last heartbeat."""
        try:
            beat = read_beat(self.hb, f"hb/{w}")
        except Exception:
            return None
        return beat.step - 1 if beat is not None else None

    def _settle(self, ops: list[Any]) -> int:
        """Give every survivor the result of the exchanges some survivor completed; drop them from
        ops (the rest run again). Returns the launch step of the last exchange completed."""
        comm = self.comm
        assert comm is not None
        # Every member's (last exchange completed, its launch step), in member order (the new group).
        mine = torch.tensor([comm.exchanges.done_upto, comm.exchanges.done_upto_step()], dtype=torch.int64)
        every = [(int(a), int(b)) for a, b in self.gather(mine).tolist()]
        dones = [d for d, _ in every]
        for seq in range(min(dones) + 1, max(dones) + 1):
            holders = [i for i, d in enumerate(dones) if d >= seq]
            op = next((j for j in ops if j.seq == seq), None)
            if self.pos in holders:
                numel, mean, _ = comm.recent_result(seq)
            else:
                if op is None:
                    raise PeerError(f"worker {self.worker} never launched exchange #{seq} that its peers completed")
                numel, mean = op.numel, None
            buf = None
            if numel != BARRIER:
                buf = mean.clone() if mean is not None else torch.empty(numel, dtype=torch.float32)
                dist.broadcast(buf, group=self.group, group_src=holders[0])  # from the first holder, in place
            if self.pos not in holders:
                assert op is not None
                op.handle.contributors = comm.members  # its mean holds the group it ran in, not re-formed yet
                comm.exchanges.land_from_peer(op, buf)
                ops.remove(op)
        return max(s for d, s in every if d == max(dones))

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every member's ``mine`` (one row each, all of one size), in member order, over the current group."""
        rows = mine.new_zeros(len(self.members), mine.numel())
        _gather(rows.view(-1), mine, group=self.group)
        return rows

    # ------------------------------------------------------------------ a worker comes back
    def boundary(self, step: int) -> None:
        """At a round boundary: schedule the admission of joiners (the leader), admit them at the step scheduled."""
        if self.trainer is None:  # nothing to hand over: it admits nobody
            return
        key = f"ep{self.epoch}/change"
        if self.is_leader() and not self.kv.check([key]):
            asked = {int(self.kv.get(f"join/who/{i}")) for i in range(1, self.kv.add("join/n", 0) + 1)}
            absent = sorted(w for w in asked | set(range(self.workers)) if w not in self.members)
            joiners = [w for w in absent if self.kv.check([f"join/req/{w}"])]
            if joiners:
                h = self.round  # at the boundary after the exchange delay and two rounds
                b = -(-(step + self.delay + 2 * h) // h) * h
                if not self.steps or b < self.steps:  # a change at the last step would only cost a handover
                    self.kv.compare_set(key, "", f"{b} {','.join(map(str, joiners))}")
        if not self.kv.check([key]):
            return
        b_text, joiners_text = self.kv.get(key).decode().split()
        b = int(b_text)
        if step == b:
            self._admit(step, _ids(joiners_text))
        elif step > b:
            raise PeerError(f"worker {self.worker} passed step {b} where workers {joiners_text} were to join "
                            "(a bug in the schedule margin); resume from the last checkpoint")

    def _admit(self, step: int, joiners: list[int]) -> None:
        comm, trainer = self.comm, self.trainer
        assert comm is not None and trainer is not None
        e0 = self.epoch
        t0 = time.perf_counter()
        trainer.sync.state_dict()  # resolves every exchange in flight in the old group
        if self.epoch != e0:  # a member died meanwhile: the new leader schedules the join again
            return
        t_flush = time.perf_counter()
        self._busy = True
        try:
            comm.pause(self.timeout_s + 10.0)
            if comm.exchanges.take_ops():
                raise PeerError("exchanges still queued at a membership change (a bug); "
                                "resume from the last checkpoint")
            src = self.leader
            members = sorted(self.members + joiners)
            if self.worker == src:
                for j in joiners:
                    self.hb.delete_key(f"exited/{j}")
                    self.kv.set(f"join/admit/{j}", f"{e0 + 1} {step} {','.join(map(str, members))} {src}")
            outer = self.form(e0 + 1, members)
            self.handover(src, joiners)
            comm.resume(outer, members, [], self.epoch)
            digests = self.gather_digests(outer_digest(trainer.sync.outer_parameters()))
            if self.worker == src:
                self.event({"event": "joined", "workers": joiners, "members": members, "source": src,
                            "outer_sha256": {str(w): d for w, d in zip(members, digests, strict=True)},
                            "flush_s": round(t_flush - t0, 3), "regroup_s": round(time.perf_counter() - t_flush, 3)})
            print(f"eagerloco: worker {self.worker}: workers {joiners} joined at step {step}; "
                  f"members {members} (epoch {self.epoch})", flush=True)
        except RuntimeError as e:
            raise self.change_failed(e, f"worker {self.worker}: a failure while admitting workers {joiners} at step "
                                   f"{step}") from None
        finally:
            self._busy = False
            self.recovery_s += time.perf_counter() - t0

    @staticmethod
    def change_failed(e: RuntimeError, what: str) -> RuntimeError:
        """A backend failure during a membership change as one line naming the change (``what``) and the way on, not
        the backend's C++ frames; our own PeerError is passed on as it is. Returns the error to raise."""
        if isinstance(e, PeerError):
            return e
        return PeerError(f"{what} ({describe_exception(e)}); resume from the last checkpoint")

    def handover(self, src: int, receivers: list[int]) -> None:
        """src sends its complete training state to each receiver (point to point, default group)."""
        trainer, comm, group = self.trainer, self.comm, self.group
        assert trainer is not None and comm is not None and group is not None
        # The group is not a subgroup of WORLD, so torch.distributed's point-to-point calls refuse it: its own.
        if self.worker == src:
            buf = io.BytesIO()
            torch.save({
                "model": trainer.model.state_dict(), "opt": trainer.opt.state_dict(),
                "sched": trainer.sched.state_dict(), "sync": trainer.sync.state_dict(),
                "last_loss": trainer.last_loss, "launched": comm.exchanges.launched,
            }, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            for r in receivers:
                for t in (torch.tensor([data.numel()], dtype=torch.int64), data):
                    group.send([t], self.members.index(r), 0).wait()
        elif self.worker in receivers:
            n = torch.zeros(1, dtype=torch.int64)
            group.recv([n], self.members.index(src), 0).wait()
            data = torch.empty(int(n.item()), dtype=torch.uint8)
            group.recv([data], self.members.index(src), 0).wait()
            state = torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)
            trainer.model.load_state_dict(state["model"])
            trainer.opt.load_state_dict(state["opt"])
            trainer.sched.load_state_dict(state["sched"])
            trainer.sync.load_state_dict(state["sync"])
            # Its own rounding noise, not a copy of the source's (that would correlate their errors).
            trainer.sync.generator.manual_seed(trainer.cfg.seed * 1_000_003 + self.worker + 7919 * self.epoch)
            # Its own error feedback, empty: the source's unsent rest is the source's to send.
            if trainer.sync.feedback is not None:
                trainer.sync.feedback.clear()
            # Its own speed too (adaptive steps), measured afresh: the source's steps were not its own.
            if trainer.sync.adaptive is not None:
                trainer.sync.adaptive.forget_speed()
            # Its own quorum windows too: none missed yet, its tick times its own (docs/algorithms.md, 12.6).
            if trainer.sync.own_windows is not None:
                trainer.sync.own_windows.forget()
            trainer.last_loss = state["last_loss"]
            comm.exchanges.adopt_sequence(int(state["launched"]))
        self.barrier()

    def barrier(self) -> None:
        """Wait for every member, in the current group."""
        assert self.group is not None
        self.group.barrier().wait()

    def gather_digests(self, mine: str) -> list[str]:
        """Every member's outer-parameter digest (SHA-256, hex), in member order."""
        rows = self.gather(torch.frombuffer(bytearray.fromhex(mine), dtype=torch.uint8))
        return [bytes(r).hex() for r in rows.tolist()]

    def joined(self) -> None:
        """The joiner's half of :meth:`_admit` (same collectives, same order): receive the state of the member
        :meth:`join` named, on a link restarted at this epoch as the members' was."""
        trainer, comm, src = self.trainer, self.comm, self.source
        assert trainer is not None and comm is not None
        comm.reset_link(self.epoch)
        t0 = time.perf_counter()
        try:
            self.handover(src, [self.worker])
            digests = self.gather_digests(outer_digest(trainer.sync.outer_parameters()))
        except RuntimeError as e:
            raise self.change_failed(e, f"worker {self.worker}: a failure while joining at step {self.step} with state "
                                   f"from worker {src}") from None
        if digests[self.pos] != digests[self.members.index(src)]:
            raise PeerError(f"worker {self.worker}: the outer state received from worker {src} does not match the "
                            f"digest worker {src} holds; start this worker again to rejoin", [src])
        print(f"eagerloco: worker {self.worker}: joined at step {self.step} with state from worker {src} "
              f"({time.perf_counter() - t0:.2f} s, outer sha256 {digests[self.pos][:12]} checked); "
              f"members {self.members} (epoch {self.epoch})", flush=True)

    @classmethod
    def join(cls, client: dist.Store, worker: int, workers: int, timeout_s: float) -> Membership | None:
        """A returning worker: ask to join, wait to be admitted (at most 4 timeouts, 10 minutes or more), build the
        group. Returns the membership at the step it joins, with the member it takes its state from (:meth:`joined`),
        or None when the run ended first."""
        # The members wait for this worker from its admission to the handover, while it builds its trainer: the
        # compiler stack that torch.optim's first optimizer imports (seconds on a cold start) is imported before it
        # asks, as the rank server preloads it (cli.preload_train).
        import torch._dynamo  # noqa: F401

        m = cls(client, worker, workers, timeout_s)
        wait_s = max(4 * timeout_s, 600.0)
        if poll(lambda: [] if m._gone(worker) or not m.hb.check([f"hb/{worker}"]) else [worker], 3 * _STALE_S,
                lambda _: f"worker {worker}: waiting for the heartbeat of an earlier worker {worker} to stop",
                interval_s=_POLL_S):
            raise PeerError(f"worker {worker} is in the run already (its heartbeat is fresh): give this job another "
                            "worker id, or stop the other one first")
        key = f"join/admit/{worker}"
        last_alive = [time.monotonic()]

        def waiting() -> list[int]:
            if m.kv.check([key]) or m.kv.check(["done"]):
                return []
            if not m.kv.check([f"join/req/{worker}"]):  # ask (again, after a coordinator restart)
                m.kv.set(f"join/who/{m.kv.add('join/n', 1)}", str(worker))
                m.kv.set(f"join/req/{worker}", str(time.time()))
            now = time.monotonic()
            members = _ids(m.kv.get("members").decode()) if m.kv.check(["members"]) else range(workers)
            if any(not m._gone(w) and m.hb.check([f"hb/{w}"]) for w in members if w != worker):
                last_alive[0] = now
            if now - last_alive[0] > 3 * _STALE_S:
                m.kv.delete_key(f"join/req/{worker}")
                raise PeerError(f"worker {worker} cannot rejoin the run: no other worker is alive (no fresh "
                                f"heartbeat for {now - last_alive[0]:.0f} s). {_REJOIN_FIX}")
            return [worker]

        if poll(waiting, wait_s, lambda _: f"worker {worker}: waiting to be admitted at the members' next round "
                "boundary", interval_s=_POLL_S) or not m.kv.check([key]):
            m.kv.delete_key(f"join/req/{worker}")
            if m.kv.check(["done"]):
                return None
            raise PeerError(f"worker {worker} cannot rejoin the run: it was not admitted within {wait_s:g} s. "
                            f"{_REJOIN_FIX}")
        e, step, members, src = m.kv.get(key).decode().split()
        m.kv.delete_key(key)
        m.kv.delete_key(f"join/req/{worker}")
        m.form(int(e), _ids(members))
        m.step, m.source = int(step), int(src)
        return m

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Agree on one final model (the leader's outer parameters: the leader, the lowest id, is the group's first
        rank) and tell late joiners it is over."""
        trainer = self.trainer
        assert trainer is not None
        self.guarded(lambda: broadcast_parameters(trainer.sync.outer_parameters(), None, self.group))
        if self.is_leader():
            self.kv.set("done", "1")
