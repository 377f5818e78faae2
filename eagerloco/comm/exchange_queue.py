"""One worker's outer operations in launch order, and the thread that runs them one at a time.

A thread rather than ``async_op=True``: the emulated link's delay must run in the background too, and one FIFO
thread gives the one-transfer-at-a-time link for free (gloo and sleeps release the GIL). Between operations the
thread can park for a membership change and go on with the operations handed back.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from eagerloco.comm.base import OpHandle
from eagerloco.comm.ops import Op

#: How many completed results stay kept, for survivors of a membership change that did not see them complete.
RECENT = 8

_PAUSE = object()  # queue marker: park the thread

#: (numel, flat mean or None, training step at launch) of a completed operation.
Result = tuple[int, torch.Tensor | None, int]


class ExchangeQueue:
    """The FIFO of one worker's outer operations and its thread (started by :meth:`start`).

    ``run(op)`` runs and lands or fails one operation, or returns what failed when the thread must park with it kept
    for a rerun; ``keep_means`` keeps the recent results' means for survivors that missed them; ``on_start`` runs
    first on the thread."""

    def __init__(self, run: Callable[[Op], str | None], *, keep_means: bool = False,
                 on_start: Callable[[], None] = lambda: None, name: str = "eagerloco-outer") -> None:
        self._run_op, self._keep_means, self._on_start = run, keep_means, on_start
        self._ops: queue.Queue[Op | object | None] = queue.Queue()
        self._pending: dict[int, OpHandle] = {}  # not finished yet
        self._pending_lock = threading.Lock()
        self._parked = threading.Event()
        self._resume_ev = threading.Event()
        self._parked_op: Op | None = None
        #: (operation, what failed) when the thread parked on a failed op, else None: text, no traceback.
        self.broken: tuple[int, str] | None = None
        self._recent: dict[int, Result] = {}
        #: Operations numbered so far (the caller's thread numbers them at launch).
        self.launched = 0
        #: The last operation the thread entered, as its ``run`` says (published with the heartbeat).
        self.entered = 0
        #: The last operation completed here (they complete in launch order).
        self.done_upto = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------

    def next_seq(self) -> int:
        """Number the next operation (1, 2, ...)."""
        self.launched += 1
        return self.launched

    def track(self, handle: OpHandle) -> None:
        """Keep the handle of a launched operation until it lands (see :meth:`fail_pending`)."""
        with self._pending_lock:
            self._pending[handle.seq] = handle

    def put(self, op: Op) -> None:
        """Queue an operation behind the ones launched before it."""
        self._ops.put(op)

    def fail_pending(self, err: BaseException) -> None:
        """Land every operation not finished yet with err."""
        with self._pending_lock:
            handles = list(self._pending.values())
        for h in handles:
            h.finish(error=err)

    @property
    def alive(self) -> bool:
        """Whether the thread is running (it ends at :meth:`stop`)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """End the thread once the ops queued before have run (a parked thread leaves as well);
        waits at most timeout_s. Returns whether it ended."""
        self._ops.put(None)
        self._resume_ev.set()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        """Run the queued ops in launch order until None (stop) comes."""
        self._on_start()
        while True:
            op = self._ops.get()
            if op is None:
                return
            if op is _PAUSE:
                self._park(None)
                continue
            assert isinstance(op, Op)
            failed = self._run_op(op)
            if failed is not None:
                self.broken = (op.seq, failed)
                self._park(op)  # the caller re-forms the group and hands the op back
                continue
            with self._pending_lock:
                self._pending.pop(op.seq, None)

    def land(self, op: Op, mean: torch.Tensor | None, done: object = None) -> None:
        """The op completed here with this mean (None: no result; done: see OpHandle.finish)."""
        self.done_upto = op.seq
        self._recent[op.seq] = (op.numel, mean if self._keep_means else None, op.step)
        self._recent.pop(op.seq - RECENT, None)
        op.handle.finish(mean=mean, done=done)

    def _park(self, op: Op | None) -> None:
        """Stop between ops until :meth:`resume`."""
        self._parked_op = op
        self._parked.set()
        self._resume_ev.wait()
        self._resume_ev.clear()

    # -- parking, for a membership change ------------------------------------------------------------

    @property
    def parked(self) -> bool:
        return self._parked.is_set()

    def pause(self, timeout_s: float) -> bool:
        """Park the thread between ops (an operation under way finishes first, or fails and the thread
        parks with it); returns whether it parked within timeout_s."""
        if not self._parked.is_set():
            self._ops.put(_PAUSE)
        return self._parked.wait(timeout_s)

    def take_ops(self) -> list[Op]:
        """The ops not completed here, in launch order (the thread must be parked)."""
        assert self._parked.is_set()
        ops = [] if self._parked_op is None else [self._parked_op]
        self._parked_op = None
        ops += [op for op in self._drain() if isinstance(op, Op)]
        return sorted(ops, key=lambda j: j.seq)

    def _drain(self) -> list[Op | object | None]:
        """Take everything queued now, in order."""
        taken = []
        while not self._ops.empty():
            taken.append(self._ops.get_nowait())
        return taken

    def resume(self, ops: list[Op]) -> None:
        """Run the given ops first, in order, then those launched while parked; unpark."""
        assert self._parked.is_set(), "pause() first"
        later = self._drain()  # launches made while parked queue up behind the reruns
        for op in ops:
            self._ops.put(op)
        for op in later:
            if op is not _PAUSE:
                self._ops.put(op)
        self.broken = None
        self._parked.clear()
        self._resume_ev.set()

    def recent(self, seq: int) -> Result | None:
        """(numel, flat mean, launch step) of a recently completed operation; None once forgotten."""
        return self._recent.get(seq)

    def done_upto_step(self) -> int:
        """The training step at which the last operation completed here was launched (0 if unknown)."""
        seq = self.done_upto
        return self._recent[seq][2] if seq in self._recent else 0

    def land_from_peer(self, op: Op, mean: torch.Tensor | None) -> None:
        """Finish an operation with the result another survivor saw complete (elastic recovery)."""
        self.done_upto = max(self.done_upto, op.seq)
        self._recent[op.seq] = (op.numel, mean, op.step)
        op.handle.finish(mean=mean)
        with self._pending_lock:
            self._pending.pop(op.seq, None)

    def adopt_sequence(self, launched: int) -> None:
        """Continue another worker's numbering (a worker that joins, before any operation)."""
        assert not self._pending, "adopt_sequence() before any exchange"
        self.launched = self.entered = self.done_upto = launched
