"""The other workers of a hook-API run: joined (an outer rendezvous, a torchrun WORLD, or none), agreed
with before the first step, started from the same weights, and let go at the end."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagerloco.comm.agreement import PREFIX as AGREE_PREFIX
from eagerloco.comm.agreement import check_agreement, parameter_digest, publish_and_gather
from eagerloco.comm.base import Communicator
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.groups import DistContext, OuterRendezvous, init_process_groups, join_outer_group, leave_outer_group
from eagerloco.comm.init_sync import broadcast_parameters
from eagerloco.comm.worker import WorkerCommunicator, communicator_for
from eagerloco.config import ConfigError, Environment, LinkConfig, OuterConfig
from eagerloco.outer import OuterSync

#: The n-th outer loop of this process meets the others under its own keys (every worker makes the same ones).
_MEETINGS = itertools.count()
#: What to do about a difference, by what differs or its first words (else: the settings' advice).
_FIXES = (
    ("initial parameters", "The workers start from different weights: seed every worker the same way, or leave "
                           "init_sync=True (worker 0's weights are then sent to all)"),
    ("step", "The workers resume from different states: load the same checkpoint on every worker (the outer "
             "optimizer's state with it), or start them all afresh"),
    ("outer state", "The workers resume from different states: load the same checkpoint on every worker (the outer "
                    "optimizer's state with it), or start them all afresh"),
    ("outer optimizer", "Pass the same outer optimizer (class and settings) to every worker"),
)
_SETTINGS_FIX = "Pass the same settings to outer_loop on every worker"
#: Settings of an outer optimizer's param group that change no number (foreach: one kernel for many tensors).
_SAME_NUMBERS = frozenset({"params", "foreach"})


def rendezvous(outer_addr: str | None, worker_id: int | None, workers: int | None,
               env: Environment) -> OuterRendezvous | None:
    """The outer rendezvous of separate jobs from the arguments, else from the environment (None: none)."""
    if outer_addr:
        return OuterRendezvous.parse(outer_addr, worker_id, workers)
    if env.outer_addr:
        return OuterRendezvous.parse(env.outer_addr, env.worker_id, env.workers)
    return None


@dataclass
class Workers:
    """How this process reaches the other workers, and what it must give back at the end.

    Attributes:
        comm: this worker's communicator.
        ctx: where this process sits among the workers (None: a communicator given by the caller, or alone).
        membership: the elastic membership across jobs (elastic=True), else None.
        timeout_s: how long a meeting waits for the others.
    """

    comm: Communicator
    ctx: DistContext | None = None
    membership: Any = None
    timeout_s: float = 300.0
    owns_comm: bool = True
    owns_world: bool = False  # this process initialized torch.distributed's WORLD
    joined: bool = False  # the outer group was formed across jobs (join_outer_group)
    meeting: str = field(default_factory=lambda: f"{AGREE_PREFIX}hooks/{next(_MEETINGS)}/")

    @classmethod
    def given(cls, comm: Communicator) -> Workers:
        """The caller joined the workers itself (``comm=``): nothing to agree on, nothing to release."""
        return cls(comm, owns_comm=False)

    @classmethod
    def connect(cls, outer_addr: str | None, worker_id: int | None, workers: int | None,
                ranks_per_worker: int | None, link: LinkConfig | None, timeout_s: float, seed: int) -> Workers:
        """Join the other workers: an outer rendezvous (arguments or environment), else the torchrun WORLD
        of M workers x R ranks, else this worker alone.

        Raises:
            ConfigError: ``workers`` > 1 without a way to reach the others, or an invalid rendezvous.
            PeerError: the rendezvous did not complete within the timeout.
        """
        from eagerloco.comm.inprocess import InProcessGroup

        env = Environment.read()
        rdzv = rendezvous(outer_addr, worker_id, workers, env)
        if rdzv is not None:
            ctx = join_outer_group(rdzv, timeout_s)
            return cls(communicator_for(ctx, link, seed=seed, timeout_s=timeout_s), ctx, timeout_s=timeout_s,
                       joined=True)
        world = env.world_size or 1
        if world > 1 and env.rank is not None:  # one WORLD of M workers x R ranks
            r = ranks_per_worker or env.ranks_per_worker or 1
            owns_world = not dist.is_initialized()
            ctx = init_process_groups(workers or world // r, r, timeout_s=timeout_s)
            return cls(communicator_for(ctx, link, seed=seed, timeout_s=timeout_s), ctx, timeout_s=timeout_s,
                       owns_world=owns_world)
        if workers not in (None, 1):
            raise ConfigError(f"workers={workers} needs the other workers: pass outer_addr='host:port' and "
                              "worker_id (each worker its own job), or start the workers with torchrun")
        return cls(InProcessGroup(1, link, seed=seed).communicator(0), timeout_s=timeout_s)

    @classmethod
    def connect_elastic(cls, outer_addr: str | None, worker_id: int | None, workers: int | None,
                        link: LinkConfig | None, timeout_s: float, seed: int, config: OuterConfig) -> Workers:
        """Join the other jobs with an elastic membership: survivors of a dead worker go on without it.

        Raises:
            ConfigError: no outer rendezvous, or a job of several processes.
            PeerError: the rendezvous did not complete within the timeout.
        """
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
        ctx = join_outer_group(rdzv, timeout_s)
        comm = TorchDistCommunicator.from_context(ctx, link, seed=seed, timeout_s=timeout_s, elastic=True)
        membership = JobsMembership(ctx.outer_store, rdzv.worker, rdzv.workers, timeout_s, group=ctx.outer_group,
                                    inner_steps=config.inner_steps, is_dp=config.per_step)
        ctx.outer_group = None  # the membership owns the group (and its successors) from here
        membership.attach(comm, None)
        return cls(comm, ctx, membership, timeout_s=timeout_s, joined=True)

    @property
    def is_reporting_rank(self) -> bool:
        """Whether this process writes the worker's files and logs (rank 0 of its worker)."""
        return self.ctx is None or self.ctx.rank_in_worker == 0

    def meet(self, mine: dict[str, Any], what: str) -> None:
        """Compare ``mine`` with every other worker's, through the run's store.

        Raises:
            ConfigError: naming each difference and each worker's value.
            PeerError: a worker did not arrive within the timeout.
        """
        ctx = self.ctx
        if ctx is None:
            return
        store = dist.PrefixStore("eagerloco/", ctx.outer_store) if ctx.outer_store is not None else ctx.store
        if not ctx.is_outer_rank or store is None:
            return
        everyone = publish_and_gather(store, ctx.worker, list(range(ctx.workers)), mine, self.timeout_s,
                                      lambda w: f"worker {w}", prefix=f"{self.meeting}{what}/")
        keys = sorted({k for values in everyone.values() for k in values})
        differ = [k for k in keys if len({json.dumps(v.get(k), sort_keys=True) for v in everyone.values()}) > 1]
        fixes = [next((fix for what, fix in _FIXES if k == what or k.startswith(f"{what} ")), _SETTINGS_FIX)
                 for k in differ]
        check_agreement(everyone, lambda w: f"worker {w}", " ".join(dict.fromkeys(fixes)))

    def start_weights(self, model: nn.Module, sync: OuterSync, init_sync: bool) -> None:
        """Before the first step: agree on where the workers start (:func:`start_state`); then, in a run
        that starts at step 0, take worker 0's parameters (init_sync) and start the outer copies from them."""
        ctx = self.ctx
        if ctx is None:  # alone
            return
        self.meet(start_state(model, sync, init_sync), "start")
        if sync.step != 0 or not init_sync:  # resumed (each worker continues from its own, equal, state), or checked
            return
        params = list(model.parameters())
        outer = self.comm.outer if isinstance(self.comm, WorkerCommunicator) else self.comm
        group = outer.group if ctx.is_outer_rank and isinstance(outer, TorchDistCommunicator) else None
        broadcast_parameters(params, ctx, group)
        sync.restart_from_model()

    def release(self, cancel: bool) -> None:
        """Close the communicator (cancel: drop what is queued), the membership and the groups this took."""
        if self.owns_comm:
            self.comm.close(cancel=cancel)
        if self.membership is not None:
            self.membership.teardown()
        if self.joined and self.ctx is not None:
            leave_outer_group(self.ctx)
        if self.owns_world:
            from eagerloco.comm.groups import shutdown

            shutdown()


def outer_optimizer_settings(sync: OuterSync) -> dict[str, Any]:
    """The outer optimizer as the workers compare it: the optimizer that really steps each fragment (the
    settings' or one the caller passed), its class and the settings of the param group holding that fragment,
    under ``outer optimizer`` (``outer optimizer (fragment p)`` where the fragments' differ)."""
    each = []
    for opt, frag in zip(sync.outer_opts, sync.outer, strict=True):
        group = next((g for g in opt.param_groups if frag and any(t is frag[0] for t in g["params"])), opt.defaults)
        each.append({"": type(opt).__name__,
                     **{f" {k}": _plain(v) for k, v in sorted(group.items()) if k not in _SAME_NUMBERS}})
    if not each:  # dp: no outer optimizer
        return {}
    if all(e == each[0] for e in each):
        return {f"outer optimizer{k}": v for k, v in each[0].items()}
    return {f"outer optimizer (fragment {p}){k}": v for p, e in enumerate(each) for k, v in e.items()}


def outer_state_digest(sync: OuterSync, copies: bool) -> str:
    """A digest of the outer state that must be the same on every worker: the outer optimizers' state (momentum,
    Adam's moments and step) and, with ``copies``, the outer copies."""
    tensors: list[torch.Tensor] = [t for frag in sync.outer for t in frag] if copies else []
    for opt in {id(o): o for o in sync.outer_opts}.values():  # one optimizer may step several fragments
        for index, state in sorted(opt.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                tensors.append(torch.tensor(list(f"{index}/{key}".encode()), dtype=torch.uint8))
                if isinstance(value, torch.Tensor):
                    tensors.append(value.reshape(-1))
                elif value is not None:
                    tensors.append(torch.tensor([float(value)], dtype=torch.float64))
    return parameter_digest(tensors)


def start_state(model: nn.Module, sync: OuterSync, init_sync: bool) -> dict[str, Any]:
    """Where this worker starts, compared at the first forward pass (a resumed run has loaded its state by then):
    the step, a digest of the outer state (a torchft-style resume restarts at step 0 with the outer optimizer's
    state it loaded; init_sync then sends worker 0's weights, not its state), the outer optimizer's settings
    (a load may change them), and without init_sync the parameters a run at step 0 starts from. Eager's
    workers each keep their own outer copies and state: past step 0 only its step is compared."""
    mine: dict[str, Any] = {"step": sync.step, **outer_optimizer_settings(sync)}
    if sync.step == 0 and not init_sync:
        mine["initial parameters"] = parameter_digest(model.parameters())
    if sync.step == 0 or not sync.own_state:
        mine["outer state"] = outer_state_digest(sync, copies=sync.step != 0)  # at step 0 the copies are the model's
    return mine


def _plain(value: Any) -> Any:
    """A setting as JSON can carry it (a tensor's number, a tuple's list, anything else its text)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


__all__ = ["Workers", "outer_optimizer_settings", "outer_state_digest", "rendezvous", "start_state"]
