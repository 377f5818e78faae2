"""Fully sharded data parallelism inside a worker (``--fsdp``), on PyTorch's FSDP2 (``fully_shard``).

Each of a worker's R ranks holds 1/R of every parameter, gradient and optimizer state. The outer algorithm is
elementwise, so each rank runs it on its own shard (:func:`local_shard`, which aliases the parameter) and
exchanges that shard with the same rank of every other worker; each rank checkpoints its own shards.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _is_dtensor(t: object) -> bool:
    # Importing torch.distributed.tensor costs ~0.6 s per process, and every run imports this module;
    # a DTensor can only exist once that module is loaded, so nothing else needs to import it.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def shard_model(model: nn.Module, blocks: Sequence[nn.Module], group: Any, device: torch.device) -> nn.Module:
    """Shard model over the ranks of group: each block its own FSDP unit (gathered one at a time),
    the rest (embeddings, final norm, a tied head) in the root's unit. In place; returns model."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor as a plain tensor sharing its storage; any other tensor as is."""
    if _is_dtensor(t):
        return cast("DTensor", t.detach()).to_local()  # torch types detach() as returning a Tensor
    return t


def like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value (this rank's shard) as a tensor of param's kind: a DTensor laid out like param, or itself."""
    if _is_dtensor(param):
        from torch.distributed.tensor import DTensor

        assert isinstance(param, DTensor)
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def local_state(obj: Any) -> Any:
    """A state dict with every DTensor replaced by a copy of this rank's shard (what a checkpoint
    file holds); anything without DTensors comes back as it is."""
    if _is_dtensor(obj):
        return local_shard(obj).clone()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(local_state(v) for v in obj)
    return obj


@torch.no_grad()
def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a state dict; for a sharded model, one of local shards (as :func:`local_state` made it)."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, target in own.items():
        dst = local_shard(target)
        if dst.shape != state[name].shape:
            raise ValueError(
                f"checkpoint shard of {name} has shape {tuple(state[name].shape)}, this rank's is {tuple(dst.shape)}: "
                "it was written with another number of ranks per worker"
            )
        dst.copy_(state[name])


def shard_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After ``opt.load_state_dict`` of local shards: make the per-parameter state DTensors again,
    laid out like their parameters (the optimizer's update mixes them with the parameters)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not _is_dtensor(p) or p not in opt.state:
                continue
            shard = local_shard(p).shape
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.shape == shard:
                    opt.state[p][k] = like_param(p, v)
