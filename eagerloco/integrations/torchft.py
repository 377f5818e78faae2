"""torchft's ``DiLoCo`` call, argument for argument, over eagerloco: a torchft script ports by its imports.

torchft (``torchft.local_sgd.DiLoCo``) takes, in this order::

    DiLoCo(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every,
           backup_device=None, pin_memory=True, use_bucketization=False, bucket_cap_mb=None,
           should_quantize=False, fragment_sync_delay=0, fragment_update_alpha=0.0)

and so does :class:`DiLoCo` here. Porting a script::

    # from torchft import Manager
    # from torchft.local_sgd import DiLoCo
    from eagerloco.integrations.torchft import DiLoCo, Manager

    manager = Manager(outer_addr="10.0.0.1:29600", worker_id=0, workers=2)  # was torchft's Manager(pg=..., ...)
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=100):
        for x, y in batches:                         # the loop stays as it was
            loss_fn(model(x), y).backward()
            inner_opt.step()
            inner_opt.zero_grad()

What maps to what: one fragment is DiLoCo, several (or ``fragment_sync_delay`` > 0) Streaming DiLoCo
with the fragments synced evenly over the ``sync_every`` steps; ``fragment_sync_delay`` is tau
(``overlap_steps``), ``fragment_update_alpha`` the merge weight alpha; ``should_quantize`` sends fp8
(e4m3) instead of fp32. The outer optimizer (one, or one per fragment) is re-pointed at eagerloco's
FP32 outer copies of its fragments and steps them with its own settings (the one passed is the one
that steps, so ``outer_optimizer.state_dict()`` in a torchft-style checkpoint holds the
outer state, and loading it after creating DiLoCo resumes bit for bit at a sync step).
``backup_device``, ``pin_memory``, ``use_bucketization`` and ``bucket_cap_mb`` are accepted for the
call's sake and change nothing: the outer copies live in FP32 beside the parameters, and each
fragment moves as one flat buffer. The :class:`Manager` here only says where the other workers are
(torchft's quorum, lighthouse and live recovery have no counterpart: pass ``elastic=True`` for
survivors that go on without a dead worker). Only the fragments' parameters are synchronized, as in
torchft: worker 0's at the first forward pass, where the workers also compare the outer optimizers
they were given (class and settings) and the outer state each one loaded (a resume from different
checkpoints stops them all with one line).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from eagerloco.comm.connect import Connection, connect
from eagerloco.comm.errors import api_error
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.hooks import OuterLoop


class Manager:
    """Where the workers are, in place of torchft's Manager (whose process groups and quorum eagerloco
    does not use). Without arguments: EAGERLOCO_OUTER_ADDR / EAGERLOCO_WORKER_ID / EAGERLOCO_WORKERS,
    else the torchrun WORLD, else this process alone (see :func:`eagerloco.outer_loop`).

    Args:
        outer_addr, worker_id, workers: the outer rendezvous (each worker its own job).
        **options: anything else :func:`eagerloco.comm.connect.connect` takes (timeout_s, link, elastic, seed,
            init_sync, ...).
    """

    def __init__(self, outer_addr: str | None = None, worker_id: int | None = None, workers: int | None = None,
                 **options: Any) -> None:
        self.options = {"outer_addr": outer_addr, "worker_id": worker_id, "workers": workers, **options}
        self.loop: OuterLoop | None = None  # the DiLoCo that uses this manager

    def connect(self) -> Connection:
        """Join the other workers (:func:`~eagerloco.comm.connect.connect`), as DiLoCo does at its start."""
        return connect(**self.options)

    def _loop(self) -> OuterLoop:
        if self.loop is None:
            raise RuntimeError("this Manager has no DiLoCo yet: create DiLoCo(manager, ...) first")
        return self.loop

    def current_step(self) -> int:
        """Outer synchronizations this worker has launched (torchft's manager counts one commit per sync,
        of the whole model or of one fragment)."""
        return int(self._loop().comm.stats.num_syncs)

    def num_participants(self) -> int:
        """Workers in the run now (fewer after a worker left an elastic run)."""
        return int(self._loop().num_workers)


def outer_factory(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], fragments: int) -> Any:
    """A factory that gives each fragment in turn the optimizer passed (or its own of a list), re-pointed at
    that fragment's FP32 outer copies: the optimizer the user holds is the one that steps, so its
    ``state_dict()`` carries the outer state, as in torchft. One optimizer for several fragments gets
    one param group per fragment (a step moves only the fragment whose outer gradient is set).

    Raises:
        ConfigError: not torch optimizers, a list of another length than the fragments, param groups
            with settings of their own, or an optimizer that already holds state (load it afterwards).
    """
    given = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not given or not all(isinstance(o, torch.optim.Optimizer) for o in given):
        raise ConfigError("outer_optimizer must be a torch.optim.Optimizer (or a list of one per fragment), "
                          f"got {type(optimizers).__name__}")
    if len(given) not in (1, fragments):
        raise ConfigError(f"outer_optimizer is a list of {len(given)} optimizers for {fragments} model fragments: "
                          "pass one, or one per fragment")
    for opt in given:
        for i, group in enumerate(opt.param_groups):
            own = {k: v for k, v in group.items() if k != "params" and k in opt.defaults and v != opt.defaults[k]}
            if own:
                raise ConfigError(f"outer_optimizer {type(opt).__name__}'s param group {i} has settings of its own "
                                  f"({', '.join(sorted(own))}); the outer optimizer steps eagerloco's outer copies "
                                  "with its defaults only: put the settings in its constructor")
        if opt.state:
            raise ConfigError(f"outer_optimizer {type(opt).__name__} already holds state: create DiLoCo first, then "
                              "load the outer optimizer's state_dict (its parameters become the outer copies)")
    built = [0]

    def factory(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = given[built[0] % len(given)]
        first = built[0] < len(given)
        built[0] += 1
        if first:  # its own parameters give way to the outer copies of its (first) fragment
            opt.param_groups[:] = []
        opt.add_param_group({"params": tensors})
        return opt

    return factory


class DiLoCo(OuterLoop):
    """torchft's ``DiLoCo(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every, ...)``
    on eagerloco's outer loop (see the module); a context manager, as torchft's."""

    def __init__(
        self,
        manager: Manager | None,
        model_fragments: Sequence[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if manager is not None and not isinstance(manager, Manager):
            raise TypeError(f"manager must be eagerloco.integrations.torchft.Manager (or None), got "
                            f"{type(manager).__module__}.{type(manager).__name__}: replace torchft's "
                            "Manager(pg=..., ...) by Manager(outer_addr='host:port', worker_id=i, workers=M)")
        if isinstance(model_fragments, nn.Module):
            model_fragments = [model_fragments]
        fragments = list(model_fragments)
        if not fragments or not all(isinstance(f, nn.Module) for f in fragments):
            raise ConfigError("model_fragments must be a non-empty list of nn.Modules (torchft's fragments)")
        streaming = len(fragments) > 1 or fragment_sync_delay > 0
        config = OuterConfig(method="streaming" if streaming else "diloco", inner_steps=sync_every,
                             fragments=len(fragments), fragment_pattern="sequential", overlap_steps=fragment_sync_delay,
                             alpha=fragment_update_alpha, codec="fp8" if should_quantize else "fp32")
        factory = outer_factory(outer_optimizer, len(fragments))
        try:  # before connecting: a bad setting meets nobody
            config.validate()
        except ConfigError as e:
            raise api_error(e) from None
        super().__init__(nn.ModuleList(fragments), inner_optimizer, config, blocks=fragments,
                         peers=(manager or Manager()).connect(), outer_optimizer=factory)
        if manager is not None:
            manager.loop = self


__all__ = ["DiLoCo", "Manager", "outer_factory"]
