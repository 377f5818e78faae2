"""The party that forms a quorum exchange's mean (docs/algorithms.md, 12.1-12.4): when it closes, the late
windows it holds, and the token-weighted mean of what it merged. The in-process communicator uses it (and the
tests' scripted one)."""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagerloco.comm.base import Contribution, QuorumResult, QuorumRule, Window
from eagerloco.config.outer import GRACE_WINDOW, auto_grace


class GraceWindow:
    """When exchanges close: min(last arrival, Q-th arrival + g), g fixed or auto (docs/algorithms.md, 12.2)."""

    def __init__(self) -> None:
        self.spreads: deque[float] = deque(maxlen=GRACE_WINDOW)

    def closes_at(self, arrivals: Sequence[float], rule: QuorumRule, round_compute: float) -> float:
        """The close of an exchange whose contributions arrive at these times (one per live worker)."""
        order = sorted(arrivals)
        q = min(rule.quorum, len(order))
        spread = self.spread(order, q)
        grace = self.grace(rule, round_compute, spread)
        self.spreads.append(spread)
        return order[-1] if grace is None else min(order[-1], order[q - 1] + grace)

    @staticmethod
    def spread(order: Sequence[float], q: int) -> float:
        """s_e: how far the q-th of these arrivals (sorted, at least q) trailed the median of the first q."""
        return order[q - 1] - order[math.ceil(q / 2) - 1]

    def grace(self, rule: QuorumRule, round_compute: float, spread: float) -> float | None:
        """g of an exchange of this ``spread``: the fixed one, or auto's over the spreads before it and this one;
        None while auto still measures (the first exchanges wait for every worker)."""
        if rule.grace is not None:
            return rule.grace
        if len(self.spreads) < GRACE_WINDOW:
            return None
        recent = [*self.spreads, spread][-GRACE_WINDOW:]
        return auto_grace(recent, round_compute)

    def state_dict(self) -> dict[str, Any]:
        return {"spreads": list(self.spreads)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.spreads = deque((float(s) for s in state["spreads"]), maxlen=GRACE_WINDOW)


@dataclass
class LateWindow:
    """A window that missed its exchange, held for its fragment's next ones."""

    contribution: Contribution
    arrival: float  # when its payload reached the party
    weight: float  # N / M of its exchange: its payload (M n / N) X times this is n X
    values: torch.Tensor  # its payload as decoded, flat FP32
    age: int = 0  # exchanges of its fragment closed since its own

    def report_drop(self, window: Window) -> None:
        """The log line of its drop at the exchange of ``window`` (12.4)."""
        c = self.contribution
        norm = float(self.values.norm()) * self.weight / max(c.steps, 1)
        print(f"eagerloco: quorum: dropped worker {c.worker}'s window of fragment {window.fragment} launched at "
              f"step {c.step} ({c.steps} steps, outer gradient norm {norm:.4g}): it missed {self.age} exchange(s) "
              f"of its fragment, more than --max-late-rounds {window.rule.max_late}", file=sys.stderr, flush=True)


class LateWindows:
    """The late windows a party holds, by fragment, and the merge of each quorum exchange."""

    def __init__(self) -> None:
        self.held: dict[int, list[LateWindow]] = {}

    def close(self, window: Window, closes_at: float, values: Sequence[torch.Tensor], arrivals: Sequence[float],
              steps: Sequence[int], tick_s: float | None = None) -> tuple[torch.Tensor | None, QuorumResult | None]:
        """Close the exchange of ``window`` given every live worker's decoded payload, arrival and steps.

        Returns the token-weighted mean of every window it merges and what it merged and dropped; (None, None) when
        it merged exactly every worker's window on time with its scheduled steps (the plain mean, bit for bit), and a
        None mean with a result when only a drop is new.
        """
        workers, rule = len(values), window.rule
        weight = window.total / workers
        merged = [LateWindow(Contribution(m, window.step, steps[m]), arrivals[m], weight, values[m])
                  for m in range(workers) if arrivals[m] <= closes_at]
        on_time = len(merged)
        dropped: list[LateWindow] = []
        keep: list[LateWindow] = []
        for late in self.held.pop(window.fragment, []):
            late.age += 1
            (merged if late.arrival <= closes_at else dropped if late.age >= rule.max_late else keep).append(late)
        for m in range(workers):
            if arrivals[m] > closes_at:  # missed: held (its payload's memory may serve another exchange: a copy;
                # none of a catch-up pass's, no steps: its payload M n / N X is zero)
                kept = values[m].clone() if steps[m] or values[m].any() else values[m].new_zeros(0)
                late = LateWindow(Contribution(m, window.step, steps[m]), arrivals[m], weight, kept)
                (keep if rule.max_late > 0 else dropped).append(late)
        if keep:
            self.held[window.fragment] = keep
        for late in dropped:
            late.report_drop(window)
        # Every worker's window on time with the steps the schedule gave it, and nothing late: the plain mean.
        plain = on_time == workers and len(merged) == workers and sum(steps) == window.total
        if plain and not dropped:
            return None, None
        merged.sort(key=lambda w: (w.contribution.step, w.contribution.worker))
        result = QuorumResult(window.step, [w.contribution for w in merged], [w.contribution for w in dropped],
                              closes_at, tick_s)
        if plain:
            return None, result
        total = torch.zeros_like(values[0])
        for w in merged:  # sum_c n_c X_c, then over sum_c n_c: the token-weighted mean (12.3)
            if w.values.numel():
                total.add_(w.values, alpha=w.weight)
        return total.div_(max(1, sum(w.contribution.steps for w in merged))), result  # no steps: zeros

    def state_dict(self) -> dict[str, Any]:
        """The late windows held, for a checkpoint."""
        return {str(f): [{"worker": w.contribution.worker, "step": w.contribution.step, "steps": w.contribution.steps,
                          "arrival": w.arrival, "weight": w.weight, "age": w.age, "values": w.values.tolist()}
                         for w in held] for f, held in self.held.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.held = {int(f): [LateWindow(Contribution(int(w["worker"]), int(w["step"]), int(w["steps"])),
                                         float(w["arrival"]), float(w["weight"]),
                                         torch.tensor(w["values"], dtype=torch.float32), int(w["age"]))
                              for w in held] for f, held in state.items()}
