"""The inner optimizer of Muon runs (MuLoCo): Muon for the blocks' weight matrices, AdamW for the rest,
stepped as one optimizer (:class:`CombinedOptimizer`).

Muon orthogonalizes each matrix's momentum (a few Newton-Schulz iterations), which only means something
for the 2-D weights of the hidden layers: the transformer blocks' projections. Embeddings, the head, the
norms and biases keep AdamW. The pair is one ``torch.optim.Optimizer`` to everything that holds an
optimizer: an LR scheduler scales both (each group from its own peak), checkpoints hold both, the hook
API's step hooks run once per step of both.
"""

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

    ``param_groups`` is every optimizer's groups, in order, as the same dicts: an LR scheduler over
    the combination sets each optimizer's lr (``LambdaLR`` scales each group from its own peak), and
    gradient scalers see every parameter. ``state`` reads each parameter's state from its owner.
    ``step()`` runs the optimizers in order; step hooks registered on the combination (the hook API's,
    :func:`eagerloco.outer_loop`) run once around all of them.

    Args:
        *optimizers: torch optimizers, each over its own parameters (a parameter in two is refused).

    Raises:
        ValueError: no optimizers, one that is not a torch optimizer, or a parameter held by two of them.
    """

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
        """Load what :meth:`state_dict` returned, each optimizer its own part.

        Raises:
            ValueError: a state dict of another optimizer, or of a combination of another length.
        """
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
    """Split a model's parameters between Muon and AdamW.

    Args:
        model: the model.
        blocks: its transformer blocks; default :func:`eagerloco.fragments.find_blocks` (``model.blocks``,
            else the largest ModuleList).

    Returns:
        (matrices, rest): the 2-D weights inside the blocks, for Muon; every other parameter
        (embeddings, a head, norms, biases, anything outside the blocks), for AdamW; each in model
        order, a tied parameter once.
    """
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
    """The inner optimizer of ``--inner-optimizer muon``: AdamW, then Muon, as one optimizer.

    Args:
        model: the model whose parameters it steps.
        lr, weight_decay, betas: AdamW's, for everything but the blocks' matrices (fused on CUDA).
        muon_lr, muon_momentum: ``torch.optim.Muon``'s for the blocks' 2-D weights (Nesterov, 5
            Newton-Schulz steps, the update scaled by sqrt(max(1, rows / cols)); its decoupled weight
            decay is ``weight_decay`` too, applied as ``muon_lr * weight_decay`` per step).
        blocks: the transformer blocks (default: found as :func:`muon_parameters` does).

    Returns:
        A :class:`CombinedOptimizer` of (AdamW, Muon): ``param_groups[0]`` is AdamW's (Muon alone for a
        model whose every parameter is a block's matrix).

    Raises:
        ConfigError: the model has no 2-D weights inside transformer blocks.
    """
    matrices, rest = muon_parameters(model, blocks)
    if not matrices:
        raise ConfigError("--inner-optimizer muon steps the transformer blocks' 2-D weights, and this model has none "
                          "(no blocks found); use --inner-optimizer adamw")
    device = matrices[0].device
    adamw = inner_optimizer(rest, device, lr=lr, weight_decay=weight_decay, betas=betas) if rest else None
    muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum)
    return CombinedOptimizer(*([adamw] if adamw is not None else []), muon)


__all__ = ["CombinedOptimizer", "muon_parameters", "muon_with_adamw"]
