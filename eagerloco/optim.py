"""The inner optimizer of Muon runs (MuLoCo): Muon for the blocks' weight matrices, AdamW for the rest,
stepped as one ``torch.optim.Optimizer`` (:class:`CombinedOptimizer`), so that one LR scheduler, one
checkpoint and the hook API's step hooks cover both."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from eagerloco.config import ConfigError
from eagerloco.config.train import MUON_LR, MUON_MOMENTUM
from eagerloco.device import inner_optimizer
from eagerloco.fragments import find_blocks


class _States(MutableMapping[torch.Tensor, Any]):
    """Every parameter's optimizer state, each kept by the optimizer that owns the parameter."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._owner = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}

    def _of(self, p: torch.Tensor) -> torch.optim.Optimizer:
        opt = self._owner.get(id(p))
        if opt is None:
            raise KeyError(p)
        return opt

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._of(p).state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._of(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._of(p).state[p]

    def __contains__(self, p: object) -> bool:
        opt = self._owner.get(id(p))
        return opt is not None and p in opt.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for opt in self._optimizers for p in opt.state)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped, zeroed and checkpointed as one.

    ``param_groups`` holds every optimizer's group dicts in order (an LR scheduler sets each one's lr, a
    gradient scaler sees every parameter); ``state`` reads each parameter's from its owner; step hooks on
    the combination run once around all of them. ValueError for no optimizers, a non-optimizer, or a
    parameter held by two."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"CombinedOptimizer combines torch optimizers, got {type(opt).__name__}")
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter is held by two of the combined optimizers; give each parameter to one")
        super().__init__(params, {})
        #: The combined optimizers, in the order their step() runs.
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]
        self.state = _States(self.optimizers)  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        return {"defaults": self.defaults, "optimizers": self.optimizers}

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy (deepcopy, pickle): the views rebuilt
        super().__setstate__(state)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.state = _States(self.optimizers)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizers"):  # after __init__ (whose base class adds the groups it replaces)
            raise TypeError("add the group to one of the combined optimizers (CombinedOptimizer.optimizers), "
                            "before combining them")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of each optimizer, in order; the closure (if any) is evaluated once, before them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizers": [each optimizer's state_dict(), in order]}``."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (ValueError for another optimizer's, or another combination's)."""
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            got = f"{len(parts)} optimizers" if isinstance(parts, list) else "a single optimizer's state"
            raise ValueError(f"this CombinedOptimizer holds {len(self.optimizers)} optimizers, the state dict {got}: "
                             "load the state of the same combination")
        for opt, part in zip(self.optimizers, parts, strict=True):
            opt.load_state_dict(part)
        # A torch optimizer's load makes new group dicts: share those (in the same list, which a
        # scheduler may hold), or the schedule would set lrs that no optimizer reads.
        self.param_groups[:] = [g for opt in self.optimizers for g in opt.param_groups]


def muon_parameters(
    model: nn.Module, blocks: Sequence[nn.Module] | None = None
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(matrices, rest): the 2-D weights inside ``blocks`` (default :func:`eagerloco.fragments.find_blocks`) for
    Muon, every other parameter for AdamW; each in model order, a tied parameter once."""
    inside = {id(p) for b in (find_blocks(model) if blocks is None else blocks) for p in b.parameters()}
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():  # deduplicates tied parameters
        (matrices if id(p) in inside and p.ndim == 2 else rest).append(p)
    return matrices, rest


def muon_with_adamw(
    model: nn.Module,
    *,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    muon_lr: float = MUON_LR,
    muon_momentum: float = MUON_MOMENTUM,
    blocks: Sequence[nn.Module] | None = None,
) -> CombinedOptimizer:
    """The inner optimizer of ``--inner-optimizer muon``: a :class:`CombinedOptimizer` of AdamW (``lr``,
    ``weight_decay``, ``betas``; ``param_groups[0]``) and ``torch.optim.Muon`` for the blocks' 2-D weights
    (``muon_lr``, ``muon_momentum``, decoupled decay ``muon_lr * weight_decay`` a step). ConfigError when the
    model has no such weights."""
    matrices, rest = muon_parameters(model, blocks)
    if not matrices:
        raise ConfigError("--inner-optimizer muon steps the transformer blocks' 2-D weights, and this model has none "
                          "(no blocks found); use --inner-optimizer adamw")
    device = matrices[0].device
    adamw = inner_optimizer(rest, device, lr=lr, weight_decay=weight_decay, betas=betas) if rest else None
    muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum)
    return CombinedOptimizer(*([adamw] if adamw is not None else []), muon)
