"""torchft's ``DiLoCo`` call, argument for argument, over eagerloco: a torchft script ports by its imports
(docs/guides/torchft.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from eagerloco.comm.connect import Connection, connect
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.hooks import OuterLoop
from eagerloco.integrations import check_options


class Manager:
    """Where the workers are, in place of torchft's Manager (whose process groups and quorum eagerloco does not
    use): ``outer_addr``, ``worker_id``, ``workers`` and anything else :func:`eagerloco.comm.connect.connect`
    takes; without arguments the environment, else the torchrun WORLD, else this process alone.
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
    """A factory that gives each fragment the optimizer passed (or its own of a list), re-pointed at that
    fragment's FP32 outer copies, so the user's optimizer steps and its ``state_dict()`` carries the outer state.
    One optimizer for several fragments gets one param group per fragment. ConfigError for anything else.
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
    """torchft's ``DiLoCo(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every, ...)`` on
    eagerloco's outer loop; a context manager, as torchft's.

    One fragment is DiLoCo, several (or ``fragment_sync_delay`` > 0) Streaming DiLoCo synced evenly over
    ``sync_every`` steps; ``fragment_sync_delay`` is tau, ``fragment_update_alpha`` alpha; ``should_quantize``
    sends fp8. ``backup_device``, ``pin_memory``, ``use_bucketization`` and ``bucket_cap_mb`` change nothing.
    """

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
        check_options(config, {})  # before connecting: a bad setting meets nobody
        super().__init__(nn.ModuleList(fragments), inner_optimizer, config, blocks=fragments,
                         peers=(manager or Manager()).connect(), outer_optimizer=factory)
        if manager is not None:
            manager.loop = self
