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

from pathlib import Path
from typing import Any

import torch

from eagerloco.atomic import atomic_file


def save_atomic(state: Any, path: str | Path) -> None:
    """torch.save, atomically: a crash never leaves half a file."""
    with atomic_file(Path(path)) as f:
        torch.save(state, f)


__all__ = ["save_atomic"]
