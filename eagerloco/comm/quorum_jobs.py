"""Quorum exchanges across jobs at the coordinator (docs/algorithms.md, 12.10). The rule and the held windows
are comm/quorum.py's; only the transport is here."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.comm.base import Contribution, Handle, QuorumResult, ReadyHandle, Window, flatten, unflatten
from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.comm.errors import PeerError
from eagerloco.comm.groups import gloo_group
from eagerloco.comm.quorum import GraceWindow, LateWindow
from eagerloco.comm.rendezvous import poll, prefixed
from eagerloco.config.outer import GRACE_WINDOW

#: Where the exchanges' arrivals, decisions and means live in the coordinator's store, and their groups' keys.
QUORUM_PREFIX, QUORUM_PG_PREFIX = "eagerloco/quorum/", "eagerloco/quorum-pg/"
#: How often a waiting worker looks at the arrivals (a few small keys per look).
_POLL_S = 0.02


class QuorumJobs:
    """One worker's quorum exchanges over the coordinator. L_e: the M workers, or under --elastic the members
    ``membership`` (comm/elastic.py's, which imports this module) holds: a worker silent longer than its timeout
    leaves it, a bypassed one stays (12.6)."""

    def __init__(self, comm: Any, client: dist.Store, workers: int, timeout_s: float,
                 membership: Any = None) -> None:
        self.comm, self.client, self.workers, self.timeout_s = comm, client, workers, timeout_s
        self.membership = membership
        self.store = prefixed(QUORUM_PREFIX, client)
        #: By membership epoch and member set: all present forms nothing new; a restarted worker, a new group.
        self.groups: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}
        self.held: dict[int, list[LateWindow]] = {}  # this worker's windows that missed, by fragment
        #: The auto grace window's spreads and T (12.2), as the last decision read carries them on.
        self.grace, self.round_compute = GraceWindow(), 0.0
        self.computed: dict[int, float] = {}  # this worker's compute seconds at its last launch, by fragment

    def live(self) -> list[int]:
        """L_e: the workers this exchange waits for."""
        return list(self.membership.members) if self.membership is not None else list(range(self.workers))

    def exchange(self, tensors: list[torch.Tensor], window: Window, keep_own: bool) -> Handle:
        """The exchange of ``window``, run now on the calling thread (under --elastic, whose membership changes are
        this thread's to make): its mean and what it merged."""
        comm, t0 = self.comm, time.perf_counter()
        flat = flatten(tensors).float().cpu()  # gloo
        mean, result, wire = self.run(flat, window, comm.stats.compute_s)
        comm.stats.exchanged(wire, flat.numel() * 4)
        comm.stats.blocked_s += time.perf_counter() - t0
        own = unflatten(flat, tensors) if keep_own else []
        device = tensors[0].device if tensors else mean.device  # whose windows the mean holds: in result, as in-process
        return ReadyHandle(comm, unflatten(mean.to(device), tensors), own, flat.numel() * 4, None, None, result)

    def run(self, flat: torch.Tensor, window: Window, compute_s: float
            ) -> tuple[torch.Tensor, QuorumResult | None, int]:
        """The exchange of ``window`` (this worker's FP32 payload ``flat``, sent unencoded; ``compute_s``: its
        compute seconds at launch): the flat mean, what it merged, the bytes it moved each way. Exchanges of a
        fragment run in launch order, since a worker's next arrival carries the windows its last one left it."""
        me, comm = self.comm.rank, self.comm
        weight = window.total / comm.num_workers  # N / M: the payload (M n / N) X times this is n X
        held = self.held.pop(window.fragment, [])
        key = f"{window.fragment}/{window.step}"
        last = self.computed.get(window.fragment)
        self.computed[window.fragment] = compute_s
        arrival = {"t": time.time(), "steps": window.steps, "held": [[c.contribution.step, c.contribution.steps]
                                                                     for c in held],
                   "tick_s": compute_s / max(1, window.step), "span": None if last is None else compute_s - last}
        self.store.set(f"{key}/arrived/{me}", json.dumps(arrival))
        decision = self._decide(key, window)
        start = time.time()
        self.grace.load_state_dict({"spreads": decision["spreads"]})
        self.round_compute = decision["round_compute"]
        members, live, left = decision["members"], decision["live"], decision["left"]
        if me not in live:
            raise PeerError(f"worker {me} left the run at the exchange of fragment {window.fragment} at step "
                            f"{window.step}: it was silent longer than --dist-timeout {self.timeout_s:g} s, and the "
                            "windows it holds leave with it; start it again with the same command to rejoin", [me])
        readers = len(live) - len(members)  # the left-out workers, who read the mean from the coordinator
        dropped: list[Contribution] = []
        if me in members:
            for attempt in range(1, len(members) + 1):
                plain = decision["plain"]
                if plain:
                    send = flat.clone()
                else:
                    send = flat * weight
                    for late in held:
                        if late.values.numel():  # a catch-up pass's window holds none (its payload is zero)
                            send.add_(late.values, alpha=late.weight)
                try:
                    dist.all_reduce(send, group=self._group(decision["epoch"], tuple(members), f"{key}/{attempt}"))
                    break
                except RuntimeError:
                    if self.membership is None or len(members) == 1:
                        raise
                # Under --elastic a member died inside the exchange: decided again among the members left (12.6),
                # on the quorum rule, and the dead one is bypassed until the membership's timeout removes it.
                self.close(lambda e, failed=tuple(members): e[1] == failed)
                self.store.set(f"{key}/{attempt}/arrived/{me}", json.dumps(arrival))
                decision = self._decide(f"{key}/{attempt}", window, among=members)
                members, left = decision["members"], left + decision["left"]
            else:
                raise PeerError(f"worker {me}: the exchange of fragment {window.fragment} at step {window.step} "
                                "failed with every member set left; resume from the last checkpoint", [])
            merged = [Contribution(*c) for c in decision["merged"]]
            mean = send.div_(len(members) if plain else max(1, sum(c.steps for c in merged)))
            wire = 2 * (len(members) - 1) * send.numel() * 4 // len(members)  # a ring all-reduce's bytes each way
            if readers and members[0] == me:  # the left-out workers read it here
                self.store.set(f"{key}/mean", mean.numpy().tobytes())
                wire += mean.numel() * 4
        else:
            self.store.wait([f"{key}/mean"])
            mean = torch.frombuffer(bytearray(self.store.get(f"{key}/mean")), dtype=torch.float32)
            merged, plain = [Contribution(*c) for c in decision["merged"]], decision["plain"]
            if self.store.add(f"{key}/read", 1) == readers:
                self.store.delete_key(f"{key}/mean")
            wire = mean.numel() * 4
            for late in held:
                late.age += 1
            payload = flat.clone() if window.steps or flat.any() else flat.new_zeros(0)  # a catch-up pass's: zero
            held.append(LateWindow(Contribution(me, window.step, window.steps), time.time(), weight, payload))
            for late in held:  # past --max-late-rounds (at 0, this one at once): dropped, each with its line
                if late.age >= window.rule.max_late:
                    dropped.append(late.contribution)
                    late.report_drop(window)
            keep = [w for w in held if w.age < window.rule.max_late]
            if keep:
                self.held[window.fragment] = keep
        EmulatedLink.sleep_until(comm.link.schedule(start, wire))  # the emulated link's time for what it moved
        result = None
        if not (plain and me in members):
            # The close on this worker's clock (perf_counter), so that a late one knows how far behind it is.
            closes_at = decision["closes_at"] - time.time() + time.perf_counter()
            result = QuorumResult(window.step, merged, dropped, closes_at, decision["tick_s"] or None)
        if left and self.membership is not None and any(w in self.membership.members for w in left):
            print(f"eagerloco: quorum: worker {me}: worker(s) {', '.join(map(str, left))} left the run at the exchange "
                  f"of fragment {window.fragment} at step {window.step} (silent longer than --dist-timeout "
                  f"{self.timeout_s:g} s, or started again): the windows they held leave with them, never applied",
                  file=sys.stderr, flush=True)
            self.membership.recover(cause=f"worker(s) {left} left the quorum's exchanges")
        return mean, result, wire

    def state_dict(self) -> dict[str, Any]:
        """The windows this worker holds and the auto grace's measurements, for its checkpoint (12.3, 12.10)."""
        return {"held": {str(f): [[w.contribution.worker, w.contribution.step, w.contribution.steps, w.arrival,
                                   w.weight, w.age, w.values] for w in held] for f, held in self.held.items()},
                "spreads": list(self.grace.spreads), "round_compute": self.round_compute}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of this worker: a joiner handed a peer's state holds none of its
        windows, 12.6)."""
        held = {int(f): [LateWindow(Contribution(int(m), int(s), int(n)), float(t), float(w), v.float(), int(a))
                         for m, s, n, t, w, a, v in windows if m == self.comm.rank]
                for f, windows in state["held"].items()}
        self.held = {f: windows for f, windows in held.items() if windows}
        self.grace.load_state_dict({"spreads": state["spreads"]})
        self.round_compute = float(state["round_compute"])

    def _decide(self, key: str, window: Window, among: list[int] | None = None) -> dict[str, Any]:
        """The exchange's decision: read if taken, else taken here once every worker has arrived, or Q have and
        the grace window has passed since the Q-th (the first worker to see it wins the compare_set). ``among``:
        the members of a decision whose all-reduce failed, deciding again."""
        rule, membership = window.rule, self.membership
        decided: list[dict[str, Any]] = []
        arrived: list[int] = []

        def undecided() -> list[int]:  # the workers not yet arrived, while nobody has decided
            if self.store.check([f"{key}/decided"]):
                decided.append(json.loads(self.store.get(f"{key}/decided")))
                return []
            if membership is not None and membership.changing():  # another member saw one leave: follow it
                membership.recover()
            every = self.live() if among is None else [m for m in among if m in self.live()]
            arrivals = {m: json.loads(self.store.get(f"{key}/arrived/{m}")) for m in every
                        if self.store.check([f"{key}/arrived/{m}"])}
            arrived[:] = list(arrivals)
            # Out of L_e from this exchange on: a member the membership's timeout declares gone (12.6).
            left = [] if membership is None else \
                [m for m in every if m not in arrivals and membership.departed(m, self.timeout_s)]
            live = [m for m in every if m not in left]
            times = sorted(a["t"] for a in arrivals.values())
            q = min(rule.quorum, len(live))
            if len(times) < q:
                return [m for m in live if m not in arrivals]
            # 12.2: T the least compute between two launches of those arrived, for the longest window.
            most = max(a["steps"] for a in arrivals.values())
            round_compute = min((a["span"] * most / a["steps"] for a in arrivals.values() if a["span"] and a["steps"]),
                                default=self.round_compute)
            spread = GraceWindow.spread(times, q)
            grace = self.grace.grace(rule, round_compute, spread)
            closes = times[-1] if len(times) == len(live) else None if grace is None else times[q - 1] + grace
            if closes is not None and closes <= time.time():
                members = sorted(arrivals)
                plain = len(members) == len(self.live()) and not any(a["held"] for a in arrivals.values()) \
                    and sum(a["steps"] for a in arrivals.values()) == window.total
                merged = sorted([[m, window.step, a["steps"]] for m, a in arrivals.items()]
                                + [[m, step, n] for m, a in arrivals.items() for step, n in a["held"]],
                                key=lambda c: (c[1], c[0]))
                decision = {"members": members, "live": live, "left": left, "plain": plain, "merged": merged,
                            "epoch": 0 if membership is None else membership.epoch, "closes_at": closes,
                            "grace": grace, "spreads": [*self.grace.spreads, spread][-GRACE_WINDOW:] if among is None
                            else list(self.grace.spreads),  # a decision taken again measures nothing new
                            "round_compute": round_compute,
                            "decided_at": time.time(), "tick_s": min(a["tick_s"] for a in arrivals.values()),
                            "arrivals_at": {str(m): a["t"] for m, a in arrivals.items()}}
                self.store.compare_set(f"{key}/decided", "", json.dumps(decision))
                return undecided()  # whoever won, everyone reads the same decision
            return [m for m in live if m not in arrivals]

        def waiting(missing: Sequence[int]) -> str:
            return (f"worker {self.comm.rank}: the exchange of fragment {window.fragment} at step {window.step} "
                    f"waits for worker(s) {', '.join(map(str, missing))} (quorum {rule.quorum})")

        # Under --elastic a silent member leaves after the timeout, and the others decide without it then.
        patience = (self.timeout_s if membership is None else 2 * self.timeout_s) + (rule.grace or 0.0)
        if poll(undecided, patience, waiting, interval_s=_POLL_S):
            raise PeerError(f"worker {self.comm.rank}: the exchange of fragment {window.fragment} at step "
                            f"{window.step} had {len(arrived)} of the {rule.quorum} workers its quorum needs after "
                            f"{self.timeout_s:g} s (--dist-timeout); the others are gone: restart them", [])
        return decided[0]

    def _group(self, epoch: int, members: tuple[int, ...], exchange: str) -> dist.ProcessGroup:
        """The gloo group of exactly these workers in this membership epoch, formed over the coordinator (under the
        ``exchange`` that first needs it) the first time they meet; the groups of earlier epochs are shut down (a
        worker of them may have restarted since)."""
        group = self.groups.get((epoch, members))
        if group is None:
            self.close(lambda key: key[0] < epoch)
            store = dist.PrefixStore(f"{QUORUM_PG_PREFIX}{exchange}/{'-'.join(map(str, members))}/", self.client)
            group = self.groups[(epoch, members)] = gloo_group(store, members.index(self.comm.rank), len(members),
                                                               self.timeout_s)
        return group

    def close(self, which: Callable[[tuple[int, tuple[int, ...]]], bool] = lambda _: True) -> None:
        """Shut down the member sets' groups (those whose (epoch, members) ``which`` picks)."""
        for key in [k for k in self.groups if which(k)]:
            try:
                self.groups.pop(key).shutdown()
            except RuntimeError:  # a member is gone: nothing more to release
                pass
