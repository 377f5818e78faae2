"""The hook API's vocabulary: the optimizer it hooks, and its errors as the API says them (the arguments'
names; one line where a script ends)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from eagerloco.comm.errors import MISMATCH_EXIT_CODE, PEER_EXIT_CODE, PeerError, ScheduleMismatchError
from eagerloco.config import ConfigError
from eagerloco.errors import DIVERGED_EXIT_CODE, DivergedError
from eagerloco.extras import MissingExtraError

#: The errors a script ends on with one line, and the status: the `eagerloco` command's for the same error.
EXIT_STATUS = ((PeerError, PEER_EXIT_CODE), (ScheduleMismatchError, MISMATCH_EXIT_CODE),
               (DivergedError, DIVERGED_EXIT_CODE), (ConfigError, 2), (MissingExtraError, 2))


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrapper (accelerate's, Lightning's): the one whose
    step() really runs, and so the one to hook."""
    seen = 0
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


@contextmanager
def exit_on_errors() -> Iterator[None]:
    """Around a training script's main: eagerloco's errors end it with one line (``eagerloco: error: ...``)
    instead of a traceback, and the ``eagerloco`` command's status: 3 for a dead or frozen peer (PeerError),
    2 for an invalid setting or a missing extra, 4 for workers that launched different exchanges, 5 for a
    diverged run. Other errors pass through."""
    try:
        yield
    except tuple(cls for cls, _ in EXIT_STATUS) as e:
        print(f"eagerloco: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(next(code for cls, code in EXIT_STATUS if isinstance(e, cls))) from None
