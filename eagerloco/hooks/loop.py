"""The outer algorithm as step hooks on the user's inner optimizer (:class:`OuterLoop`, :func:`outer_loop`)."""

from __future__ import annotations

import atexit
import sys
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace, TracebackType
from typing import Any

import torch
from torch import nn

from eagerloco import events
from eagerloco.comm.base import Communicator
from eagerloco.comm.connect import Connection, connect
from eagerloco.comm.elastic import Membership
from eagerloco.comm.errors import api_error, api_errors, api_message
from eagerloco.comm.groups import DistContext
from eagerloco.comm.rendezvous import shapes_digest
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.hooks.settings import innermost_optimizer
from eagerloco.hooks.start import FIXES, SETTINGS_FIX, outer_optimizer_settings, start_weights
from eagerloco.metrics import OuterMetrics, outer_metrics
from eagerloco.outer import OuterSync
from eagerloco.outer_optimizer import OuterOptimizerFactory
from eagerloco.schedule import short_run_note

#: What ``state_dict()`` writes; a load of another layout is refused.
STATE_VERSION = 1


class OuterLoop:
    """The outer algorithm attached to an inner optimizer by step hooks; see :func:`outer_loop`.

    ``with`` calls :meth:`start` and :meth:`finish` (or ``close(cancel=True)`` on an exception);
    framework callbacks call them at the framework's train start and end.
    """

    @api_errors
    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Any,
        config: OuterConfig | None = None,
        *,
        peers: Connection | Communicator | None = None,
        blocks: Sequence[nn.Module] | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        apply_in_flight: bool = False,
        grad_scaler: Any = None,
        scheduler: Any = None,
    ) -> None:
        self.finished = False
        self._hooks: list[Any] = []
        self._first_forward: list[Any] = []
        if isinstance(peers, Connection):  # the loop's from here: released at its end, or on an error
            self.connection = peers
        self.model = model
        self.apply_in_flight = apply_in_flight
        self.grad_scaler = grad_scaler
        self._scaler_update: Any = None  # the scaler's own update(), while this loop counts its skipped steps
        self._stepped = False
        self._tick_steps = 0  # this worker's steps in the current tick so far (adaptive steps)
        try:  # the settings before connecting: a bad one meets nobody
            self.config = (config or OuterConfig()).validate()
            self.inner_optimizer = innermost_optimizer(inner_optimizer)
            if grad_scaler is not None and self.config.per_step:
                raise ConfigError("a GradScaler (grad_scaler=, or an fp16 Trainer's) with method dp: the gradient "
                                  "mean runs inside the optimizer's step, which the scaler skips on one worker alone; "
                                  "average the gradients with DDP, train in bf16, or use a method with outer rounds")
            if peers is None:
                peers = connect()
            self.connection = peers if isinstance(peers, Connection) else Connection.given(peers)
            if self.connection.ctx is not None:  # this loop joined the other workers: agree with them first
                # A worker arriving at an elastic run under way checks these against the run's, then waits here to
                # be admitted at the members' next round boundary.
                self.connection.enter({**asdict(self.config), "seed": self.connection.seed,
                                       "workers": self.connection.ctx.workers,
                                       "model parameters": shapes_digest(model.named_parameters())},
                                      "settings", SETTINGS_FIX, FIXES)
                # The weights are made equal (or compared) at the first forward pass: a resumed run
                # loads its own state between here and there, and then keeps it. Every module is
                # watched: torchft's fragments are parts of a model whose own forward the loop calls.
                self._first_forward = [m.register_forward_pre_hook(self._start_weights) for m in model.modules()]
            self.comm = self.connection.comm
            self.sync = OuterSync(model, self.inner_optimizer, self.comm, self.config, blocks=blocks,
                                  outer_optimizer=outer_optimizer, seed=self.connection.seed)
            self.connection.attach(self.config, Handover(model, self.inner_optimizer, self.sync, _Schedule(scheduler),
                                                         SimpleNamespace(seed=self.connection.seed)))
            self.connection.take_state()  # admitted into a run under way: a live member's state, its digest checked
            #: The tick at which this worker joined an elastic run under way (its loop continues from there), else None.
            self.joined_at = self.sync.step if self.connection.joining else None
            if self.connection.ctx is not None:  # the one that steps: a factory's (torchft's) replaces the settings'
                self.connection.enter(outer_optimizer_settings(self.sync), "outer optimizer", SETTINGS_FIX, FIXES)
        except BaseException:
            self._release(cancel=True)
            raise
        if self.connection.ctx is not None:  # its own group: released at exit if the script never finishes it
            atexit.register(_release_at_exit, weakref.ref(self))
        self._mark: float | None = None

    def _start_weights(self, module: nn.Module, args: Any) -> None:
        """At the first forward pass (of any of the model's modules): the workers agree on where they start,
        and a run at step 0 starts from worker 0's weights (or checks that they are equal)."""
        self._forget_first_forward()
        self._guard(lambda: start_weights(self.connection, self.model, self.sync))

    @property
    def ctx(self) -> DistContext | None:
        """Where this process sits among the workers (None: alone, or a communicator given by the caller)."""
        return self.connection.ctx

    @property
    def membership(self) -> Membership | None:
        """The elastic membership across jobs (``connect(elastic=True)``), else None."""
        return self.connection.membership

    @property
    def worker(self) -> int:
        """This worker's id (0..M-1)."""
        return self.comm.rank

    @property
    def num_workers(self) -> int:
        return self.comm.num_workers

    @property
    def is_reporting_rank(self) -> bool:
        """Whether this process writes the worker's files and logs (rank 0 of its worker)."""
        return self.connection.is_reporting_rank

    # ------------------------------------------------------------------ the hooks
    def start(self) -> OuterLoop:
        """Attach the hooks to the inner optimizer (idempotent)."""
        if not self._hooks:
            opt = self.inner_optimizer
            self._hooks = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]
            self._mark = time.perf_counter()
            if self.grad_scaler is not None:
                self._count_skipped_steps()
        return self

    def _count_skipped_steps(self) -> None:
        """A GradScaler skips a step (an inf in the gradients) on one worker alone, whose schedule would fall
        behind the others'; the scaler's update() counts a skipped step as a step, so every schedule stays the same."""
        scaler, original = self.grad_scaler, self.grad_scaler.update

        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if not self._stepped and self._hooks:  # skipped: the step counts, with nothing applied
                self._post(self.inner_optimizer, (), {})
            self._stepped = False
            return result

        self._scaler_update = original
        scaler.update = update

    def _count_compute(self) -> None:
        now = time.perf_counter()
        if self._mark is not None:  # real seconds (on a simulated clock they advance it too)
            self.comm.add_compute(now - self._mark)
        self._mark = now

    def _guard(self, fn: Any) -> None:
        """Run a piece of the outer algorithm; if it fails (a dead peer, a mismatch), drop the connection
        first, so that a framework that does not call back on errors leaves no exchange thread or gloo
        group behind, then raise the error (one that names flags, as the API names them)."""
        try:
            fn()
        except BaseException as e:
            self.close(cancel=True)
            said = api_error(e)
            if said is e:
                raise
            raise said.with_traceback(e.__traceback__) from e.__cause__

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._count_compute()  # the user's forward and backward
        if self._tick_steps == 0:  # the run's (or a resumed run's) first ticks may hold none of this worker's steps
            self._guard(self._skip_empty_ticks)
        # args: step()'s own, the optimizer first.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if self.sync.is_dp and closure is not None:
            # The closure computes the gradients inside step() (Lightning, LBFGS): average after it.
            def averaged() -> Any:
                loss = closure()
                self._guard(self.sync.before_inner_step)
                return loss

            kwargs = dict(kwargs)
            if "closure" in kwargs:
                kwargs["closure"] = averaged
            else:
                args = (args[0], averaged, *args[2:])
            self._mark = time.perf_counter()
            return args, kwargs
        self._guard(self.sync.before_inner_step)
        self._mark = time.perf_counter()
        return None

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._stepped = True
        self._count_compute()  # the inner step itself
        self._guard(self._after_step)
        self._mark = time.perf_counter()

    def _after_step(self) -> None:
        sync = self.sync
        if sync.adaptive is not None:  # adaptive steps: a tick ends after this worker's steps of it
            self._tick_steps += 1
            if self._tick_steps < sync.inner_steps_due():
                return
            self._tick_steps = 0
        self._tick()
        self._skip_empty_ticks()

    def _tick(self) -> None:
        self.sync.after_inner_step()
        if hasattr(self.comm, "step_hint"):
            self.comm.step_hint = self.sync.step  # published with the heartbeat
        if self.membership is not None:  # a worker gone: the survivors re-form the group and go on
            self.membership.on_step(self.sync.step)
        events.inner_step_done(self.worker, self.sync.step)

    def _skip_empty_ticks(self) -> None:
        """Adaptive steps: the ticks of the round in which this worker takes no step pass at once (their
        exchanges launched and applied), so that the user's next step is one of this worker's."""
        while self.sync.adaptive is not None and self.sync.inner_steps_due() == 0:
            self._tick()

    @property
    def ticks(self) -> int:
        """Ticks completed: inner steps, or under adaptive steps the fastest worker's inner steps (this worker
        runs its own share of them). Every worker must run the same number of ticks: a loop under adaptive steps
        ends on ``ticks``, not on its own count of steps."""
        return self.sync.step

    # ------------------------------------------------------------------ the end
    def finish(self, consensus: bool | None = None) -> None:
        """Detach the hooks, wait for what is in flight (counted as ``drain_s``, not blocked time), meet the other
        workers, release the connection.

        Args:
            consensus: under eager, end with one model on every worker, the mean of their outer parameters (one
                more exchange), as DiLoCo's runs do; without it each keeps its own, slightly different one. On by
                default (None) where this loop joined the workers itself; with a Communicator as ``peers=`` the
                caller says. The other methods end with one model anyway.
        """
        if self.finished:
            return
        self._remove_hooks()
        stats = self.comm.stats
        before = stats.blocked_s
        short = None if self.sync.is_dp else short_run_note(self.sync.step, self.sync.config.inner_steps)
        if short is not None and self.sync.step > 0:
            warnings.warn(f"eagerloco.outer_loop: {api_message(short)}", stacklevel=3)
        try:
            self.sync.drain(apply=self.apply_in_flight)
            if self.connection.owns_comm if consensus is None else consensus:
                self.sync.consensus()
            stats.drain_s += stats.blocked_s - before
            stats.blocked_s = before
            if self.connection.owns_comm:
                self.comm.barrier()
            if self.membership is not None:  # one final model (the leader's); a worker still asking to join is told
                self.membership.finish()
        except BaseException:
            self._release(cancel=True)
            raise
        self._release(cancel=False)

    def close(self, cancel: bool = True) -> None:
        """Detach the hooks and drop the connection without draining (after an error)."""
        self._remove_hooks()
        self._release(cancel=cancel)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._scaler_update is not None:  # the scaler's own update() again
            del self.grad_scaler.update
            self._scaler_update = None

    def _forget_first_forward(self) -> None:
        for h in self._first_forward:
            h.remove()
        self._first_forward = []

    def _release(self, cancel: bool) -> None:
        if self.finished:
            return
        self.finished = True
        self._forget_first_forward()
        if hasattr(self, "connection"):
            self.connection.release(cancel)

    def __enter__(self) -> OuterLoop:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.finish()
        else:
            self.close(cancel=True)

    # ------------------------------------------------------------------ state and numbers
    def state_dict(self) -> dict[str, Any]:
        """Outer copies, outer-optimizer state, exchanges in flight (resolved: on a real link this
        waits for them) and the link accounting, for the user's own checkpoint. The model and inner
        optimizer are the user's to save."""
        return {"version": STATE_VERSION, "worker": self.worker, "workers": self.num_workers,
                "sync": self.sync.state_dict(), "stats": self.comm.stats.as_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the model and inner optimizer restored); ValueError for another layout."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"not an eagerloco outer state of version {STATE_VERSION}: {state.get('version')!r}")
        self.sync.load_state_dict(state["sync"])
        for key, value in state["stats"].items():
            if hasattr(self.comm.stats, key):
                setattr(self.comm.stats, key, value)

    def metrics(self) -> OuterMetrics:
        """This worker's link and time accounting so far, by the names metrics.jsonl uses
        (:class:`eagerloco.metrics.OuterMetrics` documents each with its unit)."""
        return outer_metrics(self.comm.stats)

    def outer_parameters(self) -> list[torch.Tensor]:
        """The outer (global) parameters in model order: what evaluation should use."""
        return self.sync.outer_parameters()

    def outer_weights(self) -> Any:
        """Context manager: the outer parameters loaded into the model for the block (evaluation)."""
        return self.sync.outer_weights()


class _Schedule:
    """The loop's learning-rate scheduler as the handover moves it. The members hand theirs over inside an inner step
    (the optimizer's hook), before the loop steps it: the joiner steps the one it receives once, and so is where
    they are after theirs."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is None:
            return
        self.scheduler.load_state_dict(state)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": the members stepped theirs
            warnings.simplefilter("ignore")
            self.scheduler.step()


@dataclass
class Handover:
    """What an elastic run's members hand a worker that joins it (:meth:`eagerloco.comm.elastic.Membership.handover`),
    by the names the trainer's worker gives them: the user's model, inner optimizer and schedule, the loop's outer
    state, and ``cfg.seed`` (the joiner's own rounding noise)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sync: OuterSync
    sched: _Schedule
    cfg: SimpleNamespace
    last_loss: float = float("nan")


def _release_at_exit(ref: weakref.ref[OuterLoop]) -> None:
    """At interpreter exit: a loop never finished (no ``with``, no finish()) still holds its gloo group, whose
    threads, torn down after Python is gone with an exchange in flight, abort the process ("terminate called
    without an active exception", status 134, output lost). Release it first, and say so."""
    loop = ref()
    if loop is None or loop.finished:
        return
    print("eagerloco: warning: the outer loop was never finished (use `with outer_loop(...)` or call finish()); "
          "its connection is closed at exit and the exchanges in flight are dropped", file=sys.stderr, flush=True)
    loop.close(cancel=True)


def outer_loop(
    model: nn.Module,
    inner_optimizer: Any,
    config: OuterConfig | None = None,
    *,
    peers: Connection | Communicator | None = None,
    blocks: Sequence[nn.Module] | None = None,
    outer_optimizer: OuterOptimizerFactory | None = None,
    apply_in_flight: bool = False,
    grad_scaler: Any = None,
    scheduler: Any = None,
) -> OuterLoop:
    """Run the outer algorithm around an unchanged training loop: ``with outer_loop(...) as outer:``.

    Args:
        model: the module whose parameters the inner optimizer updates (unwrapped: not the DDP wrapper).
            Frozen parameters (``requires_grad=False``) are never exchanged and keep their values.
        inner_optimizer: a torch optimizer (or a framework's wrapper of one); its step() gets the hooks.
        config: the outer algorithm's settings (:class:`~eagerloco.config.OuterConfig`) [OuterConfig()].
            Under ``adaptive_steps`` every worker must run the same ticks: end the loop on ``outer.ticks``
            reaching a multiple of H, not on a count of steps.
        peers: the other workers: :func:`eagerloco.comm.connect.connect`'s connection, released at the
            loop's end [``connect()``], or a Communicator of the caller's (nothing agreed nor released).
            Connected, the workers compare settings, model shapes and outer optimizer, then at the first
            forward pass the step and the outer state; any difference stops them all with one line. A run
            at step 0 starts from worker 0's weights.
        blocks: the modules to split into the config's fragments (default: found: ``blocks``,
            ``transformer.h``, Hugging Face's ``model.layers``, ...).
        outer_optimizer: a factory taking the list of FP32 outer tensors, in place of the config's.
        apply_in_flight: at the end, apply what is still in flight instead of only waiting for it.
        grad_scaler: the ``torch.amp.GradScaler`` the loop steps through, if any: a step it skips still
            counts, so every worker's schedule stays the same. Not with method dp.
        scheduler: the learning-rate scheduler the loop steps after each inner step, if any: a worker that joins an
            elastic run under way takes its position (with the model, the inner optimizer and the outer state) from a
            live worker.

    Raises:
        ConfigError: an invalid setting or launch.
        PeerError: another worker died or never joined; the message names it.
    """
    return OuterLoop(model, inner_optimizer, config, peers=peers, blocks=blocks, outer_optimizer=outer_optimizer,
                     apply_in_flight=apply_in_flight, grad_scaler=grad_scaler, scheduler=scheduler)
