"""A slow link emulated on a fast one: a transfer starts once every worker launched it and the link is free, and
takes ``latency + wire_bytes * 8 / bandwidth`` plus jitter in ``[0, jitter]``: in wall-clock time on processes, on
the simulated clock in-process."""

from __future__ import annotations

import math
import random
import threading
import time

from eagerloco.config import LinkConfig


class EmulatedLink:
    """The shared link's schedule: with the same seed and launch times every worker (on processes; in-process the
    group holds one) computes the same finish times, as if they shared one wire."""

    def __init__(self, config: LinkConfig | None = None, seed: int = 0) -> None:
        self.config = (config or LinkConfig()).validate()
        self.rng = random.Random(seed)
        self.free_at = 0.0  # the time the previous transfer left the link

    @property
    def trivial(self) -> bool:
        """No emulation: unlimited bandwidth, no latency, no jitter (every transfer finishes at once)."""
        c = self.config
        return math.isinf(c.bandwidth_gbps) and c.latency_ms == 0 and c.jitter_ms == 0

    def schedule(self, start: float, wire_bytes: int) -> float:
        """Reserve the link for a transfer whose last worker launched at `start`; return its finish time."""
        jitter_ms = self.config.jitter_ms
        jitter = self.rng.uniform(0.0, jitter_ms / 1e3) if jitter_ms and wire_bytes else 0.0
        finish = max(start, self.free_at) + self.config.transfer_seconds(wire_bytes) + jitter
        self.free_at = finish
        return finish

    @staticmethod
    def sleep_until(finish: float, interrupt: threading.Event | None = None) -> bool:
        """Sleep until wall time `finish`; False if `interrupt` was set first (shutdown)."""
        remaining = finish - time.time()
        return remaining <= 0 or not (interrupt or threading.Event()).wait(remaining)
