"""Where the workers of a hook-API run start: what they compare before the first step (settings, outer
optimizer, step and outer state), and worker 0's weights sent to all (init_sync)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eagerloco.comm.connect import Connection
from eagerloco.comm.distributed import TorchDistCommunicator
from eagerloco.comm.init_sync import broadcast_parameters
from eagerloco.comm.rendezvous import parameter_digest
from eagerloco.comm.worker import WorkerCommunicator
from eagerloco.outer import OuterSync

_RESUME_FIX = ("The workers resume from different states: load the same checkpoint on every worker (the outer "
               "optimizer's state with it), or start them all afresh")
#: What to do about a difference, by what differs or its first words (else: :data:`SETTINGS_FIX`).
FIXES = (
    ("initial parameters", "The workers start from different weights: seed every worker the same way, or leave "
                           "init_sync=True (worker 0's weights are then sent to all)"),
    ("step", _RESUME_FIX), ("outer state", _RESUME_FIX),
    ("outer optimizer", "Pass the same outer optimizer (class and settings) to every worker"),
)
SETTINGS_FIX = "Pass the same settings to outer_loop on every worker"
#: Settings of an outer optimizer's param group that change no number (foreach: one kernel for many tensors).
_SAME_NUMBERS = frozenset({"params", "foreach"})


def start_weights(peers: Connection, model: nn.Module, sync: OuterSync) -> None:
    """Before the first step: agree on where the workers start (:func:`start_state`); then, in a run that
    starts at step 0, take worker 0's parameters (init_sync) and start the outer copies from them."""
    if peers.ctx is None:  # alone, or a communicator given by the caller
        return
    peers.agree(start_state(model, sync, peers.init_sync), "start", SETTINGS_FIX, FIXES)
    if sync.step != 0 or not peers.init_sync:  # resumed (each continues from its own, equal, state), or checked
        return
    ctx = peers.ctx
    outer = peers.comm.outer if isinstance(peers.comm, WorkerCommunicator) else peers.comm
    group = outer.group if ctx.is_outer_rank and isinstance(outer, TorchDistCommunicator) else None
    broadcast_parameters(list(model.parameters()), ctx, group)
    sync.restart_from_model()

def outer_optimizer_settings(sync: OuterSync) -> dict[str, Any]:
    """The outer optimizer as the workers compare it: the class and param-group settings of the optimizer that
    really steps each fragment, under ``outer optimizer`` (``outer optimizer (fragment p)`` where they differ)."""
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
    """Where this worker starts, compared at the first forward pass: the step, a digest of the outer state, the
    outer optimizer's settings, and without init_sync the parameters at step 0. Eager's workers each keep their
    own outer state, so past step 0 only their step is compared.
    """
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
