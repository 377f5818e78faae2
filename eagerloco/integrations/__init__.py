"""The hook API inside training frameworks: Hugging Face's Trainer (``eagerloco[hf]``), PyTorch Lightning
(``eagerloco[lightning]``) and torchft's ``DiLoCo`` call (docs/guides/frameworks.md, docs/guides/torchft.md).

Each callback attaches :class:`~eagerloco.hooks.OuterLoop` to the framework's optimizer at train start,
keeps its state in the framework's checkpoints and logs its link accounting. It takes what
:func:`eagerloco.outer_loop` takes and, without ``peers=``, :func:`~eagerloco.comm.connect.connect`'s keywords.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from eagerloco.comm.base import Communicator
from eagerloco.comm.connect import Connection, connect
from eagerloco.comm.errors import api_error
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.hooks import OuterLoop

#: The keywords of a callback that go to the loop; the others are connect()'s.
LOOP_OPTIONS = ("blocks", "outer_optimizer", "apply_in_flight", "grad_scaler", "scheduler")


def check_options(config: OuterConfig | None, options: Mapping[str, Any]) -> None:
    """A callback's settings, checked when it is made, so a bad one fails where it is written (ConfigError)."""
    known = [*LOOP_OPTIONS, *inspect.signature(connect).parameters]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}: a callback takes an OuterConfig (the algorithm's "
                          f"settings), peers=, and {', '.join(known)}")
    try:
        (config or OuterConfig()).validate()
    except ConfigError as e:
        raise api_error(e) from None


def start_loop(model: nn.Module, optimizer: Any, config: OuterConfig | None, peers: Connection | Communicator | None,
               options: Mapping[str, Any], grad_scaler: Any, scheduler: Any = None) -> OuterLoop:
    """The callback's OuterLoop at train start: on ``peers``, else connected with the callback's keywords;
    the framework's GradScaler and learning-rate scheduler unless the callback was given its own. A worker that
    arrives at an elastic run under way is admitted here, with a live worker's state (``loop.joined_at``)."""
    loop = {"grad_scaler": grad_scaler, "scheduler": scheduler,  # unless the callback was given its own
            **{k: v for k, v in options.items() if k in LOOP_OPTIONS}}
    if peers is None:
        peers = connect(**{k: v for k, v in options.items() if k not in LOOP_OPTIONS})
    return OuterLoop(model, optimizer, config, peers=peers, **loop)  # it releases the connection on an error


__all__ = ["LOOP_OPTIONS", "check_options", "start_loop"]
