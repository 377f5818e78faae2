"""What :class:`~eagerloco.outer.OuterSync` keeps between launching an exchange and applying it, and how its
state is checked, saved and restored (a checkpoint continues with the very same numbers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagerloco.comm.base import Communicator, Handle, QuorumResult, ReadyHandle

#: What a state_dict holds, and each exchange in flight in it (check_state names what a state lacks).
STATE_KEYS = ("method", "step", "outer", "outer_opts", "in_flight", "generator", "error_feedback", "adaptive")
#: The parts of a state that a setting turns on (None in a state saved with it off): what it is, and its flag.
SETTING_PARTS = {"error_feedback": ("error feedback", "--error-feedback"),
                 "adaptive": ("--adaptive-steps", "--adaptive-steps")}
IN_FLIGHT_KEYS = ("fragment", "launch_step", "apply_step", "mean", "own", "payload_bytes", "ready_at", "workers",
                  "others", "window", "contributors")


@dataclass
class InFlight:
    """One exchange launched and not yet applied."""

    fragment: int
    handle: Handle
    launch_step: int
    apply_step: int
    fresh: list[torch.Tensor] | None  # eager: this worker's own full-precision outer gradient
    #: M of the round this exchange belongs to (workers present at launch). Eager applied its own
    #: share with weight 1/workers and corrects with the same weight, so every outer gradient
    #: counts exactly once even when membership changes while the exchange is in flight.
    workers: float = 1
    #: The others' weight in the exchange's mean, 1 - w_m: (M-1)/M, or by tokens under adaptive steps.
    others: float | None = None
    #: Adaptive steps: every worker's steps in its window, to renormalise the mean over who sent (AdaptiveSteps.settle).
    window: list[int] | None = None


def save_in_flight(items: list[InFlight], comm: Communicator) -> list[dict[str, Any]]:
    """The exchanges in flight with their results, for a checkpoint; each handle is replaced by a ready one, so
    the run that continues and the run that resumes apply the very same numbers."""
    saved = []
    for item in items:
        h = item.handle
        mean, ready_at = h.checkpoint_result()
        item.handle = ReadyHandle(comm, mean, h.own, h.payload_bytes, ready_at, h.contributors, h.quorum)
        saved.append({
            "fragment": item.fragment, "launch_step": item.launch_step, "apply_step": item.apply_step,
            "mean": mean, "own": h.own, "payload_bytes": h.payload_bytes, "ready_at": ready_at,
            "workers": item.workers, "others": item.others, "window": item.window, "contributors": h.contributors,
            **({} if h.quorum is None else {"quorum": h.quorum.state()}),
        })
    return saved


def load_in_flight(saved: list[dict[str, Any]], comm: Communicator) -> list[InFlight]:
    """The exchanges in flight of :func:`save_in_flight`, with ready handles."""
    return [
        InFlight(x["fragment"], ReadyHandle(comm, x["mean"], x["own"], x["payload_bytes"], x["ready_at"],
                                            x["contributors"], QuorumResult.from_state(x.get("quorum"))),
                 x["launch_step"], x["apply_step"], None, x["workers"], x["others"], x["window"])
        for x in saved
    ]


def check_state(state: dict[str, Any], method: str, outer: list[list[torch.Tensor]], parts: dict[str, Any]) -> None:
    """Refuse (ValueError) a saved outer state that lacks a part, is for another method, whose fragments do not
    match this model and fragment setting, or that a setting of :data:`SETTING_PARTS` was off for where this run
    has it on (``parts``: this run's, None where off), or the other way round."""
    missing = {k for k in STATE_KEYS if k not in state} | {k for x in state.get("in_flight", ()) for k in
                                                           IN_FLIGHT_KEYS if k not in x}
    if missing:
        raise ValueError(f"the outer state lacks {', '.join(sorted(missing))}: saved by an earlier development "
                         "version of eagerloco, which this one does not read; start the run afresh")
    if state["method"] != method:
        raise ValueError(f"state is for method {state.get('method')!r}, this run uses {method!r}")
    if [[t.shape for t in frag] for frag in state["outer"]] != [[t.shape for t in frag] for frag in outer]:
        raise ValueError("state's fragments do not match this model and --fragments setting")
    for key, (what, flag) in SETTING_PARTS.items():
        if (state[key] is None) != (parts[key] is None):
            was, now = ("off" if x is None else "on" for x in (state[key], parts[key]))
            raise ValueError(f"state was saved with {what} {was} and this run has it {now}: resume with the same "
                             f"{flag} setting")
