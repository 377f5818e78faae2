"""The hook API's vocabulary: its settings by name (torchft's names accepted), the optimizer it hooks,
and its errors as the API says them (the arguments' names; one line where a script ends)."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import Any, Literal

import torch

from eagerloco.comm.errors import MISMATCH_EXIT_CODE, PEER_EXIT_CODE, PeerError, ScheduleMismatchError
from eagerloco.config import ConfigError, OuterConfig
from eagerloco.errors import DIVERGED_EXIT_CODE, DivergedError
from eagerloco.extras import MissingExtraError

#: torchft's ``DiLoCo`` argument names and the OuterConfig field each means.
TORCHFT_NAMES = {"sync_every": "inner_steps", "fragment_sync_delay": "overlap_steps",
                 "fragment_update_alpha": "alpha"}
#: The values of the settings that take a choice (OuterConfig checks them; the types show them to editors).
Method = Literal["dp", "diloco", "streaming", "delayed", "eager"]
FragmentPattern = Literal["sequential", "strided"]
EagerWeighting = Literal["nonlocal", "stale_average"]
OuterOptimizerName = Literal["sgd", "average", "adam", "adamw"]
#: outer_loop's parameters that are OuterConfig fields or torchft's names for them.
SETTINGS = frozenset({f.name for f in fields(OuterConfig)} - {"fragments", "outer_optimizer"}) | frozenset(
    TORCHFT_NAMES)



def outer_config(config: OuterConfig | None = None, **settings: Any) -> OuterConfig:
    """An OuterConfig from one (copied) and/or settings by field name, torchft's names accepted.

    Without a method, P > 1 fragments mean ``streaming`` and one fragment ``diloco``.

    Raises:
        ConfigError: an unknown setting, a setting given under both names, or an invalid value.
    """
    names = {f.name for f in fields(OuterConfig)}
    given: dict[str, Any] = {}
    for key, value in settings.items():
        field = TORCHFT_NAMES.get(key, key)
        if field not in names:
            raise ConfigError(f"unknown outer setting {key!r}; OuterConfig takes {', '.join(sorted(names))} "
                              f"(and torchft's {', '.join(TORCHFT_NAMES)})")
        if field in given:
            raise ConfigError(f"{field} given twice (as {field} and as its torchft name); pass one")
        given[field] = list(value) if field == "worker_speeds" and isinstance(value, (tuple, list)) else value
    if config is None and "method" not in given:
        given["method"] = "streaming" if int(given.get("fragments", 1)) > 1 else "diloco"
    return replace(config or OuterConfig(), **given)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under a framework's wrapper (accelerate's, Lightning's): the one whose
    step() really runs, and so the one to hook."""
    seen = 0
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


#: Flags named by settings' errors, and the argument of outer_loop each one is.
# resume: the command line resumes with a flag; the API loads the checkpoint's outer state into the loop.
_API_NAMES = {"dist-timeout": "timeout_s", "no-outer-nesterov": "outer_nesterov=False", "resume": "load_state_dict()"}


def api_message(text: str) -> str:
    """A settings error as the Python API says it: the argument (``inner_steps``) where the command
    line's message names its flag (``--inner-steps``)."""
    known = {f.name for f in fields(OuterConfig)} | {"outer_addr", "worker_id", "workers", "ranks_per_worker"}

    def name(m: re.Match[str]) -> str:
        flag = m.group(1)
        arg = _API_NAMES.get(flag, flag.replace("-", "_"))
        return arg if arg in known or flag in _API_NAMES else m.group(0)

    return re.sub(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)", name, text)


def api_error(e: BaseException) -> BaseException:
    """``e`` as the Python API says it: a ConfigError, PeerError or ScheduleMismatchError naming the arguments
    where its message names flags (:func:`api_message`; a PeerError keeps the workers it blames), else ``e``."""
    if not isinstance(e, (ConfigError, PeerError, ScheduleMismatchError)) or api_message(str(e)) == str(e):
        return e
    text = api_message(str(e))
    if isinstance(e, PeerError):
        return PeerError(text, e.workers)
    return ConfigError(text) if isinstance(e, ConfigError) else ScheduleMismatchError(text)


def api_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """Settings and peer errors raised by ``fn`` name the arguments (:func:`api_error`), on their own: no chain."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except (ConfigError, PeerError, ScheduleMismatchError) as e:
            raise api_error(e) from None

    return wrapped


@contextmanager
def exit_on_errors() -> Iterator[None]:
    """Around a training script's main: eagerloco's errors end it with one line instead of a traceback.

    A dead or frozen peer (:class:`~eagerloco.comm.errors.PeerError`, naming the worker) prints
    ``eagerloco: error: ...`` on stderr and exits with status 3; an invalid setting (ConfigError) or an
    optional package not installed (MissingExtraError, naming the extra) does the same with status 2,
    and workers that launched different exchanges (:class:`~eagerloco.comm.errors.ScheduleMismatchError`)
    with status 4, and a run whose numbers stopped being finite (DivergedError) with status 5, as the ``eagerloco``
    command does. Other errors pass through unchanged.
    """
    try:
        yield
    except (PeerError, ConfigError, MissingExtraError, ScheduleMismatchError, DivergedError) as e:
        code = (PEER_EXIT_CODE if isinstance(e, PeerError) else MISMATCH_EXIT_CODE
                if isinstance(e, ScheduleMismatchError) else DIVERGED_EXIT_CODE if isinstance(e, DivergedError) else 2)
        print(f"eagerloco: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None


__all__ = ["EagerWeighting", "FragmentPattern", "Method", "OuterOptimizerName", "SETTINGS", "TORCHFT_NAMES",
           "api_error", "api_errors", "api_message", "exit_on_errors", "innermost_optimizer", "outer_config"]
