"""The tests' toy model, in a module of its own so that the jobs the tests start import it without pytest."""

from __future__ import annotations

import torch
from torch import nn


class Toy(nn.Module):
    """Blocks of one linear layer each, plus embedding-like and head parameters outside them."""

    def __init__(self, num_blocks: int = 4, width: int = 3) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(width))
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks))
        self.head = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.embed
        for b in self.blocks:
            h = torch.tanh(b(h))
        return (h * self.head).sum(-1)
