"""The hook API (:mod:`eagerloco.hooks`) inside training frameworks: Hugging Face's Trainer
(:mod:`eagerloco.integrations.hf`, ``pip install 'eagerloco[hf]'``) and PyTorch Lightning
(:mod:`eagerloco.integrations.lightning`, ``pip install 'eagerloco[lightning]'``); and torchft's
``DiLoCo`` call for ported scripts (:mod:`eagerloco.integrations.torchft`, no extra needed).

Each is a callback that attaches :class:`~eagerloco.hooks.OuterLoop` to the framework's optimizer
at train start, keeps its state in the framework's checkpoints and reports its link accounting in
the framework's logs. A worker may itself be a data-parallel job (the framework's DDP over the
job's WORLD): the outer group is separate (``outer_addr``), so the two never meet.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(state: Any, path: str | Path) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


__all__ = ["save_atomic"]
