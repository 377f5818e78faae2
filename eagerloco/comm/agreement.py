"""Workers agree before the first step: every setting that must match, compared through the run's store.

Each worker (each rank, where a worker has several) publishes what it will run as one JSON value under
``agree/<id>`` in the store the run already has (the launcher's, or worker 0's outer store); it then
waits for the others', with a line every 10 s saying whom it waits for, and gives up after the
timeout naming them. A difference stops every worker with the same one-line error naming each
setting that differs and each worker's value: no worker trains a model of its own while exiting 0.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.comm.errors import PeerError
from eagerloco.config import ConfigError

PREFIX = "agree/"
#: Seconds between the lines saying whom a worker still waits for.
REPORT_EVERY_S = 10.0
_POLL_S = 0.1


def parameter_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the values of ``tensors``: equal digests, bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def shapes_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The parameter names and shapes of a model, in a few words: count, size and a digest."""
    items = [(n, list(p.shape), str(p.dtype)) for n, p in named]
    digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12]
    return f"{len(items)} tensors, {sum(torch.Size(s).numel() for _, s, _ in items):,} values ({digest})"


def publish_and_gather(store: dist.Store, me: int, ids: list[int], mine: Mapping[str, Any], timeout_s: float,
                       name: Callable[[int], str], where: str = "", prefix: str = PREFIX,
                       report_every_s: float = REPORT_EVERY_S) -> dict[int, dict[str, Any]]:
    """Publish ``mine`` as participant ``me`` and return every participant's, by id.

    Args:
        store: the run's store (every participant reaches the same one).
        me: this participant's id; ids: every participant's (``me`` among them).
        mine: what this participant runs (JSON-serializable).
        timeout_s: how long to wait for the others.
        name: how messages call a participant.
        where: the store's address, for the progress lines.
        prefix: the keys' prefix (one per meeting, where a store serves several).
        report_every_s: seconds between the lines saying whom it waits for.

    Raises:
        PeerError: a participant did not publish within the timeout (it is named).
        KeyboardInterrupt: Ctrl-C ends the wait at once (the store is polled, never waited on blindly).
    """
    store.set(f"{prefix}{me}", json.dumps(mine, sort_keys=True, default=str))
    start = last = time.monotonic()
    missing = [i for i in ids if i != me]
    while missing:
        missing = [i for i in missing if not store.check([f"{prefix}{i}"])]
        if not missing:
            break
        now = time.monotonic()
        if now - start >= timeout_s:
            raise PeerError(f"{name(me)}: {', '.join(name(i) for i in missing)} did not arrive within "
                            f"{timeout_s:g} s{' at ' + where if where else ''}; start every worker with the same "
                            "rendezvous (and check that each one started)", missing)
        if now - last >= report_every_s:
            last = now
            print(f"eagerloco: {name(me)}: waiting for {', '.join(name(i) for i in missing)}"
                  f"{' at ' + where if where else ''} ({now - start:.0f} s of {timeout_s:g})", file=sys.stderr,
                  flush=True)
        time.sleep(_POLL_S)
    return {i: json.loads(store.get(f"{prefix}{i}").decode()) for i in ids}


def differences(everyone: Mapping[int, Mapping[str, Any]], name: Callable[[int], str]) -> list[str]:
    """Each setting whose value differs between participants, with every participant's value."""
    keys = sorted({k for settings in everyone.values() for k in settings})
    out = []
    for key in keys:
        values = {i: settings.get(key) for i, settings in everyone.items()}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            out.append(f"{key} (" + ", ".join(f"{name(i)}: {_show(v)}" for i, v in values.items()) + ")")
    return out


def check_agreement(everyone: Mapping[int, Mapping[str, Any]], name: Callable[[int], str], fix: str) -> None:
    """Raise ConfigError, one line, naming each setting that differs and each participant's value."""
    diff = differences(everyone, name)
    if diff:
        raise ConfigError(f"the workers disagree on settings that must match: {'; '.join(diff)}. {fix}")


def _show(v: Any) -> str:
    return "absent" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


__all__ = ["PREFIX", "REPORT_EVERY_S", "check_agreement", "differences", "parameter_digest", "publish_and_gather",
           "shapes_digest"]
