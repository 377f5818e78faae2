"""Bring your own loop: the outer algorithm as step hooks on the user's inner optimizer.

    with eagerloco.outer_loop(model, inner_optimizer, method="eager", inner_steps=50) as outer:
        for x, y in batches:                 # the loop stays as it was
            loss_fn(model(x), y).backward()
            inner_optimizer.step()           # + the outer algorithm, in the optimizer's hooks
            inner_optimizer.zero_grad()

A pre-step hook runs :meth:`OuterSync.before_inner_step` (the gradient mean of ``dp``; nothing for
the other methods) and a post-step hook :meth:`OuterSync.after_inner_step`, so the parameters are
bit for bit those of the explicit per-step calls. Where the workers are:

- ``outer_addr`` / ``worker_id`` / ``workers`` (or EAGERLOCO_OUTER_ADDR / EAGERLOCO_WORKER_ID /
  EAGERLOCO_WORKERS): every worker is its own job (its own torchrun WORLD, its own DDP or FSDP);
  the job's rank 0 joins an outer gloo group across the jobs through a TCPStore worker 0 hosts
  (:func:`eagerloco.comm.groups.join_outer_group`);
- else under torchrun (RANK and WORLD_SIZE, WORLD_SIZE > 1): one WORLD of M workers x R ranks,
  as ``eagerloco launch`` runs them;
- else one worker alone (M = 1): handy for debugging a script before launching it twice.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from eagerloco import events
from eagerloco.comm.agreement import PREFIX as AGREE_PREFIX
from eagerloco.comm.agreement import check_agreement, parameter_digest, publish_and_gather, shapes_digest
from eagerloco.comm.base import Communicator
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.errors import MISMATCH_EXIT_CODE, PEER_EXIT_CODE, PeerError, ScheduleMismatchError
from eagerloco.comm.groups import (
    DEFAULT_TIMEOUT_S,
    OuterRendezvous,
    init_process_groups,
    join_outer_group,
    leave_outer_group,
)
from eagerloco.comm.init_sync import broadcast_parameters
from eagerloco.comm.worker import WorkerCommunicator, communicator_for
from eagerloco.config import ConfigError, Environment, LinkConfig, OuterConfig
from eagerloco.extras import MissingExtraError
from eagerloco.outer import OuterOptimizerFactory, OuterSync

#: torchft's ``DiLoCo`` argument names and the OuterConfig field each means.
TORCHFT_NAMES = {"sync_every": "inner_steps", "fragment_sync_delay": "overlap_steps",
                 "fragment_update_alpha": "alpha"}
#: What ``state_dict()`` writes; a load of another layout is refused.
STATE_VERSION = 1
#: The n-th outer loop of this process meets the others under its own keys (every worker makes the same ones).
_MEETINGS = itertools.count()


def outer_config(config: OuterConfig | None = None, **settings: Any) -> OuterConfig:
    """An OuterConfig from one (copied) and/or settings by field name, torchft's names accepted.

    Without a method, P > 1 fragments mean ``streaming`` and one fragment ``diloco``.

    Raises:
        ConfigError: an unknown setting, a setting given under both names, or an invalid value.
    """
    names = {f.name for f in fields(OuterConfig)}
    given: dict[str, Any] = {}
    for key, value in settings.items():
        field = TORCHFT_NAMES.get(key, key)
        if field not in names:
            raise ConfigError(f"unknown outer setting {key!r}; OuterConfig takes {', '.join(sorted(names))} "
                              f"(and torchft's {', '.join(TORCHFT_NAMES)})")
        if field in given:
            raise ConfigError(f"{field} given twice (as {field} and as its torchft name); pass one")
        given[field] = value
    if config is None and "method" not in given:
        given["method"] = "streaming" if int(given.get("fragments", 1)) > 1 else "diloco"
    return replace(config or OuterConfig(), **given)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrapper (accelerate's, Lightning's): the one whose
    step() really runs, and so the one to hook."""
    seen = 0
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def rendezvous(outer_addr: str | None, worker_id: int | None, workers: int | None,
               env: Environment) -> OuterRendezvous | None:
    """The outer rendezvous of separate jobs from the arguments, else from the environment (None: none)."""
    if outer_addr:
        return OuterRendezvous.parse(outer_addr, worker_id, workers)
    if env.outer_addr:
        return OuterRendezvous.parse(env.outer_addr, env.worker_id, env.workers)
    return None


#: Flags named by settings' errors, and the argument of outer_loop each one is.
_API_NAMES = {"dist-timeout": "timeout_s", "no-outer-nesterov": "outer_nesterov=False"}


def api_message(text: str) -> str:
    """A settings error as the Python API says it: the argument (``inner_steps``) where the command
    line's message names its flag (``--inner-steps``)."""
    known = {f.name for f in fields(OuterConfig)} | {"outer_addr", "worker_id", "workers", "ranks_per_worker"}

    def name(m: re.Match[str]) -> str:
        flag = m.group(1)
        arg = _API_NAMES.get(flag, flag.replace("-", "_"))
        return arg if arg in known or flag in _API_NAMES else m.group(0)

    return re.sub(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)", name, text)


def _api_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Settings errors raised by ``fn`` name the arguments (:func:`api_message`), on their own: no chain."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except ConfigError as e:
            raise ConfigError(api_message(str(e))) from None

    return wrapped


class OuterLoop:
    """The outer algorithm attached to an inner optimizer by step hooks; see :func:`outer_loop`.

    ``with`` calls :meth:`start` and :meth:`finish` (or ``close(cancel=True)`` on an exception);
    framework callbacks call them at the framework's train start and end.
    """

    @_api_errors
    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Any,
        config: OuterConfig | None = None,
        *,
        fragments: int | Sequence[nn.Module] | None = None,
        blocks: Sequence[nn.Module] | None = None,
        comm: Communicator | None = None,
        outer_addr: str | None = None,
        worker_id: int | None = None,
        workers: int | None = None,
        ranks_per_worker: int | None = None,
        link: LinkConfig | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        seed: int = 0,
        outer_optimizer: str | OuterOptimizerFactory | None = None,
        apply_in_flight: bool = False,
        elastic: bool = False,
        init_sync: bool = True,
        **settings: Any,
    ) -> None:
        if fragments is not None and not isinstance(fragments, int):
            # A list of modules (torchft's model fragments): each is one fragment, in that order.
            if blocks is not None:
                raise ConfigError("pass the fragments as modules or blocks=, not both")
            blocks = list(fragments)
            if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
                raise ConfigError("fragments must be a number of fragments or a non-empty list of nn.Modules")
            settings.update(fragments=len(blocks), fragment_pattern="sequential")
        elif fragments is not None:
            settings["fragments"] = fragments
        factory: OuterOptimizerFactory | None = None
        if callable(outer_optimizer):
            factory = outer_optimizer
        elif outer_optimizer is not None:
            settings["outer_optimizer"] = outer_optimizer
        self.finished = False
        self._hooks: list[Any] = []
        self.config = outer_config(config, **settings).validate()  # before connecting: a bad setting meets nobody
        self.model = model
        self.inner_optimizer = innermost_optimizer(inner_optimizer)
        self.apply_in_flight = apply_in_flight
        self._owns_comm = comm is None
        self._owns_world = False
        self._joined = False  # the outer group was formed across jobs (join_outer_group)
        self.ctx = None
        #: Elastic membership across jobs (elastic=True): re-forms the outer group when a worker dies.
        self.membership: Any = None
        if elastic and comm is not None:
            raise ConfigError("elastic=True re-forms the outer group it connects itself: pass outer_addr, "
                              "worker_id and workers instead of comm=")
        if comm is None:
            comm = (self._connect_elastic(outer_addr, worker_id, workers, link, timeout_s, seed) if elastic
                    else self._connect(outer_addr, worker_id, workers, ranks_per_worker, link, timeout_s, seed))
        self.comm = comm
        self._meeting = f"{AGREE_PREFIX}hooks/{next(_MEETINGS)}/"
        self._init_sync, self._timeout_s = init_sync, timeout_s
        self._first_forward: Any = None
        try:
            if self.ctx is not None:  # this loop joined the other workers: agree with them first
                self._meet({**asdict(self.config), "seed": seed, "workers": self.ctx.workers,
                            "model parameters": shapes_digest(model.named_parameters())}, "settings")
                # The weights are made equal (or compared) at the first forward pass: a resumed run
                # loads its own state between here and there, and then keeps it.
                self._first_forward = model.register_forward_pre_hook(self._start_weights)
            self.sync = OuterSync(model, self.inner_optimizer, comm, self.config, blocks=blocks,
                                  outer_optimizer=factory, seed=seed)
        except BaseException:
            self._release(cancel=True)
            raise
        self._mark: float | None = None
        self._wall0 = 0.0

    def _meet(self, mine: dict[str, Any], what: str) -> None:
        """Compare ``mine`` with every other worker's, through the run's store (ConfigError naming each
        difference)."""
        ctx = self.ctx
        assert ctx is not None
        store = dist.PrefixStore("eagerloco/", ctx.outer_store) if ctx.outer_store is not None else ctx.store
        if not ctx.is_outer_rank or store is None:
            return
        everyone = publish_and_gather(store, ctx.worker, list(range(ctx.workers)), mine, self._timeout_s,
                                      lambda w: f"worker {w}", prefix=f"{self._meeting}{what}/")
        fix = ("Pass the same settings to outer_loop on every worker" if what == "settings" else
               "The workers start from different weights: seed every worker the same way, or leave init_sync=True "
               "(worker 0's weights are then sent to all)")
        check_agreement(everyone, lambda w: f"worker {w}", fix)

    def _start_weights(self, module: nn.Module, args: Any) -> None:
        """At the first forward pass of a run that starts afresh: take worker 0's parameters (init_sync),
        or check that every worker has the same."""
        self._first_forward.remove()
        self._first_forward = None
        if self.sync.step != 0:  # resumed: each worker continues from its own state
            return
        params = list(self.model.parameters())
        if not self._init_sync:
            self._guard(lambda: self._meet({"initial parameters": parameter_digest(params)}, "weights"))
            return
        ctx = self.ctx
        assert ctx is not None
        outer = self.comm.outer if isinstance(self.comm, WorkerCommunicator) else self.comm
        group = outer.group if ctx.is_outer_rank and isinstance(outer, TorchDistCommunicator) else None

        def sync() -> None:
            broadcast_parameters(params, ctx, group)
            self.sync.restart_from_model()

        self._guard(sync)

    # ------------------------------------------------------------------ where the workers are
    def _connect(self, outer_addr: str | None, worker_id: int | None, workers: int | None,
                 ranks_per_worker: int | None, link: LinkConfig | None, timeout_s: float,
                 seed: int) -> Communicator:
        from eagerloco.comm.inprocess import InProcessGroup

        env = Environment.read()
        rdzv = rendezvous(outer_addr, worker_id, workers, env)
        if rdzv is not None:
            self.ctx = join_outer_group(rdzv, timeout_s)
            self._joined = True
            return communicator_for(self.ctx, link, seed=seed, timeout_s=timeout_s)
        world = env.world_size or 1
        if world > 1 and env.rank is not None:  # one WORLD of M workers x R ranks
            r = ranks_per_worker or env.ranks_per_worker or 1
            m = workers or world // r
            self._owns_world = not dist.is_initialized()
            self.ctx = init_process_groups(m, r, timeout_s=timeout_s)
            return communicator_for(self.ctx, link, seed=seed, timeout_s=timeout_s)
        if workers not in (None, 1):
            raise ConfigError(f"workers={workers} needs the other workers: pass outer_addr='host:port' and "
                              "worker_id (each worker its own job), or start the workers with torchrun")
        return InProcessGroup(1, link, seed=seed).communicator(0)

    def _connect_elastic(self, outer_addr: str | None, worker_id: int | None, workers: int | None,
                         link: LinkConfig | None, timeout_s: float, seed: int) -> Communicator:
        from eagerloco.comm.elastic_jobs import JobsMembership

        env = Environment.read()
        rdzv = rendezvous(outer_addr, worker_id, workers, env)
        if rdzv is None:
            raise ConfigError("elastic=True needs each worker as its own job: pass outer_addr='host:port', worker_id "
                              "and workers (or EAGERLOCO_OUTER_ADDR, ...). In one torchrun WORLD use `eagerloco "
                              "launch --elastic -- <train args>`, whose trainer survives dead workers")
        world = env.world_size or 1
        if world > 1:
            raise ConfigError(f"elastic=True across jobs needs one process per job, but this job has WORLD_SIZE "
                              f"{world}: start each worker as one process, or drop elastic")
        self.ctx = join_outer_group(rdzv, timeout_s)
        self._joined = True
        comm = TorchDistCommunicator.from_context(self.ctx, link, seed=seed, timeout_s=timeout_s, elastic=True)
        cfg = self.config
        self.membership = JobsMembership(self.ctx.outer_store, rdzv.worker, rdzv.workers, timeout_s,
                                         group=self.ctx.outer_group, inner_steps=cfg.inner_steps,
                                         is_dp=cfg.per_step)
        self.ctx.outer_group = None  # the membership owns the group (and its successors) from here
        self.membership.attach(comm, None)
        return comm

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
        return self.ctx is None or self.ctx.rank_in_worker == 0

    # ------------------------------------------------------------------ the hooks
    def start(self) -> OuterLoop:
        """Attach the hooks to the inner optimizer (idempotent)."""
        if not self._hooks:
            opt = self.inner_optimizer
            self._hooks = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]
            self._wall0 = time.perf_counter()
            self._mark = self._wall0
        return self

    def _count_compute(self) -> None:
        now = time.perf_counter()
        if self._mark is not None:  # real seconds (on a simulated clock they advance it too)
            self.comm.add_compute(now - self._mark)
        self._mark = now

    def _guard(self, fn: Any) -> None:
        """Run a piece of the outer algorithm; if it fails (a dead peer, a mismatch), drop the connection
        first, so that a framework that does not call back on errors leaves no exchange thread or gloo
        group behind, then raise the error unchanged."""
        try:
            fn()
        except BaseException:
            self.close(cancel=True)
            raise

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._count_compute()  # the user's forward and backward
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
        self._count_compute()  # the inner step itself
        self._guard(self._after_step)
        self._mark = time.perf_counter()

    def _after_step(self) -> None:
        self.sync.after_inner_step()
        if hasattr(self.comm, "step_hint"):
            self.comm.step_hint = self.sync.step  # published with the heartbeat
        if self.membership is not None:  # a worker gone: the survivors re-form the group and go on
            self.membership.on_step(self.sync.step)
        events.inner_step_done(self.worker, self.sync.step)

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Detach the hooks, wait for what is in flight (drain), meet the other workers, release
        the connection. The drain's wait counts as ``drain_s``, not as blocked training time."""
        if self.finished:
            return
        self._remove_hooks()
        stats = self.comm.stats
        before = stats.blocked_s
        try:
            self.sync.drain(apply=self.apply_in_flight)
            stats.drain_s += stats.blocked_s - before
            stats.blocked_s = before
            if self._owns_comm:
                self.comm.barrier()
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

    def _release(self, cancel: bool) -> None:
        if self.finished:
            return
        self.finished = True
        if getattr(self, "_first_forward", None) is not None:
            self._first_forward.remove()
            self._first_forward = None
        if self._owns_comm and hasattr(self, "comm"):
            self.comm.close(cancel=cancel)
        if self.membership is not None:
            self.membership.teardown()
        if self._joined and self.ctx is not None:
            leave_outer_group(self.ctx)
        if self._owns_world:
            from eagerloco.comm.groups import shutdown

            shutdown()

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
        """Continue from :meth:`state_dict` (after the model and inner optimizer were restored).

        Raises:
            ValueError: another layout, or a state for another method or model.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"not an eagerloco outer state of version {STATE_VERSION}: {state.get('version')!r}")
        self.sync.load_state_dict(state["sync"])
        for key, value in state["stats"].items():
            if hasattr(self.comm.stats, key):
                setattr(self.comm.stats, key, value)

    def metrics(self) -> dict[str, float]:
        """This worker's link and time accounting so far: bytes sent and received, exchanges,
        seconds blocked on the link and in outer machinery, and compute utilization (compute over
        compute + blocked + overhead)."""
        st = self.comm.stats
        busy = st.compute_s + st.blocked_s + st.overhead_s
        return {"outer_bytes_sent": float(st.bytes_sent), "outer_bytes_received": float(st.bytes_received),
                "outer_syncs": float(st.num_syncs), "outer_blocked_s": st.blocked_s,
                "outer_overhead_s": st.overhead_s,
                "compute_utilization": st.compute_s / busy if busy > 0 else 1.0}

    def outer_parameters(self) -> list[torch.Tensor]:
        """The outer (global) parameters in model order: what evaluation should use."""
        return self.sync.outer_parameters()

    def outer_weights(self) -> Any:
        """Context manager: the outer parameters loaded into the model for the block (evaluation)."""
        return self.sync.outer_weights()


@contextmanager
def exit_on_errors() -> Iterator[None]:
    """Around a training script's main: eagerloco's errors end it with one line instead of a traceback.

    A dead or frozen peer (:class:`~eagerloco.comm.errors.PeerError`, naming the worker) prints
    ``eagerloco: error: ...`` on stderr and exits with status 3; an invalid setting (ConfigError) or an
    optional package not installed (MissingExtraError, naming the extra) does the same with status 2,
    and workers that launched different exchanges (:class:`~eagerloco.comm.errors.ScheduleMismatchError`)
    with status 4, as the ``eagerloco`` command does. Other errors pass through unchanged.
    """
    try:
        yield
    except (PeerError, ConfigError, MissingExtraError, ScheduleMismatchError) as e:
        code = (PEER_EXIT_CODE if isinstance(e, PeerError) else MISMATCH_EXIT_CODE
                if isinstance(e, ScheduleMismatchError) else 2)
        print(f"eagerloco: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None


#: The values of the settings that take a choice (OuterConfig checks them; the types show them to editors).
Method = Literal["dp", "diloco", "streaming", "delayed", "eager"]
FragmentPattern = Literal["sequential", "strided"]
EagerWeighting = Literal["nonlocal", "stale_average"]
OuterOptimizerName = Literal["sgd", "adam", "adamw"]
#: outer_loop's parameters that are OuterConfig fields or torchft's names for them.
_SETTINGS = frozenset({f.name for f in fields(OuterConfig)} - {"fragments", "outer_optimizer"}) | frozenset(
    TORCHFT_NAMES)


def outer_loop(
    model: nn.Module,
    inner_optimizer: Any,
    config: OuterConfig | None = None,
    *,
    method: Method | None = None,
    inner_steps: int | None = None,
    fragments: int | Sequence[nn.Module] | None = None,
    fragment_pattern: FragmentPattern | None = None,
    overlap_steps: int | None = None,
    alpha: float | None = None,
    eager_rounds: int | None = None,
    eager_weighting: EagerWeighting | None = None,
    codec: str | None = None,
    codec_block: int | None = None,
    stochastic_rounding: bool | None = None,
    outer_optimizer: OuterOptimizerName | OuterOptimizerFactory | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    outer_nesterov: bool | None = None,
    sync_every: int | None = None,
    fragment_sync_delay: int | None = None,
    fragment_update_alpha: float | None = None,
    blocks: Sequence[nn.Module] | None = None,
    comm: Communicator | None = None,
    outer_addr: str | None = None,
    worker_id: int | None = None,
    workers: int | None = None,
    ranks_per_worker: int | None = None,
    link: LinkConfig | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    seed: int = 0,
    apply_in_flight: bool = False,
    elastic: bool = False,
    init_sync: bool = True,
) -> OuterLoop:
    """Run the outer algorithm around an unchanged training loop: ``with outer_loop(...) as outer:``.

    Every argument after ``config`` is keyword-only. The outer settings (``method`` to
    ``outer_nesterov``) are :class:`~eagerloco.config.OuterConfig`'s fields; one left at None keeps
    the value of ``config``, else OuterConfig's default (shown in brackets).

    Args:
        model: the module whose parameters the inner optimizer updates (unwrapped: not the DDP wrapper).
            Parameters with ``requires_grad=False`` (frozen) are never exchanged and keep their values.
        inner_optimizer: a torch optimizer (or a framework's wrapper of one); its step() gets the hooks.
        config: an OuterConfig to start from (copied; the settings given here replace its fields).
        method: dp, diloco, streaming, delayed or eager [diloco; streaming when P > 1 fragments].
        inner_steps: H, inner steps per outer round [50].
        fragments: a number P (the model's blocks are found: ``blocks``, ``transformer.h``,
            Hugging Face's ``model.layers``, ...) or a list of modules, each one fragment [1].
        fragment_pattern: sequential or strided, how blocks map to fragments [strided].
        overlap_steps: tau, inner steps an exchange may take before it is applied [0].
        alpha: merge weight of the local parameters when an overlapped exchange lands [0.0].
        eager_rounds: k, outer rounds an exchange may take under delayed and eager [1].
        eager_weighting: nonlocal or stale_average, eager's proxy [nonlocal].
        codec: the outer gradient's format on the link (fp32, bf16, fp8, int8, e2m1, ...) [fp32].
        codec_block: values sharing one scale in the block formats [32].
        stochastic_rounding: round the quantized payload stochastically [False].
        outer_optimizer: "sgd", "adam", "adamw" [sgd], or a factory taking the list of FP32 outer tensors.
        outer_lr, outer_momentum, outer_nesterov: the outer optimizer's settings [0.7, 0.9, True].
        sync_every, fragment_sync_delay, fragment_update_alpha: torchft's names for ``inner_steps``,
            ``overlap_steps`` and ``alpha`` (give one name of each pair).
        blocks: the modules to split into P fragments (default: found automatically).
        comm: a Communicator to use instead of connecting (tests, custom transports).
        outer_addr, worker_id, workers: an outer rendezvous, each worker its own job (see the module).
        ranks_per_worker: R, under one torchrun WORLD of M * R ranks.
        link: an emulated slow link (bandwidth, latency) between the workers.
        timeout_s: seconds before a silent worker is declared dead.
        seed: seeds stochastic rounding (mixed with the worker id).
        apply_in_flight: at the end, apply what is still in flight (every outer gradient counted
            once) instead of only waiting for it.
        init_sync: the workers start from worker 0's parameters, sent to all before the first step (as
            torchft's Manager does). False: each worker keeps its own, which must be equal (checked:
            seed every worker the same way). Either way the workers compare their settings and model
            shapes first, and any difference stops them all with one line naming it. (With ``comm=``
            the caller has joined the workers itself and none of this happens.)
        elastic: with outer_addr (one process per job), a worker that dies does not stop the others:
            they re-form the outer group over worker 0's store and go on with the mean over the
            workers present (:mod:`eagerloco.comm.elastic_jobs`). Worker 0, which hosts the store,
            must stay; a worker that died does not come back into the running run.

    Raises:
        ConfigError: an invalid setting or launch, or a setting given under both its names.
        PeerError: another worker died or never joined; the message names it.
    """
    given = locals()  # the arguments, by name
    settings = {name: given[name] for name in sorted(_SETTINGS) if given[name] is not None}
    return OuterLoop(model, inner_optimizer, config, fragments=fragments, blocks=blocks, comm=comm,
                     outer_addr=outer_addr, worker_id=worker_id, workers=workers, ranks_per_worker=ranks_per_worker,
                     link=link, timeout_s=timeout_s, seed=seed, outer_optimizer=outer_optimizer,
                     apply_in_flight=apply_in_flight, elastic=elastic, init_sync=init_sync, **settings)


__all__ = ["EagerWeighting", "FragmentPattern", "Method", "OuterLoop", "OuterOptimizerName", "TORCHFT_NAMES",
           "exit_on_errors", "innermost_optimizer", "outer_config", "outer_loop"]
