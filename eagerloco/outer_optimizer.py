"""The outer optimizer the settings choose: what steps the outer copies on the averaged outer gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagerloco.config import OuterConfig

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def make_outer_optimizer(config: OuterConfig) -> OuterOptimizerFactory:
    """The configured outer optimizer (default: SGD, lr 0.7, momentum 0.9, Nesterov; ``average``: SGD
    without momentum, whatever --outer-momentum says)."""

    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # foreach: one kernel per op over the fragment's tensors (PyTorch picks it by itself only on
        # CUDA; on CPU the per-tensor loop costs ~40% more per outer step), same results. Its Nesterov
        # SGD writes into the gradients; that is safe because OuterSync only ever hands the optimizer
        # fresh tensors (every Handle.wait() returns a copy the caller owns).
        if config.outer_optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov,
                foreach=True,
            )
        if config.outer_optimizer == "average":  # plain averaging: outer <- outer - lr * D (SparseLoCo)
            return torch.optim.SGD(params, lr=config.outer_lr, foreach=True)
        if config.outer_optimizer == "adam":
            return torch.optim.Adam(params, lr=config.outer_lr, foreach=True)
        return torch.optim.AdamW(params, lr=config.outer_lr, foreach=True)

    return factory
