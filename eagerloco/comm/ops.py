"""The outer communication thread's operations, and the header workers compare before a payload moves.

Unless the workers agreed on their schedule (``checked=False``), an operation starts with a 40-byte header
all-gather (launch time, sequence number, size, payload bytes, codec), alone: gloo aborts or corrupts when ranks
all-gather buffers of different sizes. The header is not counted as link bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eagerloco.codecs import CODEC_NAMES, Codec
from eagerloco.comm.base import OpHandle
from eagerloco.comm.errors import ScheduleMismatchError
from eagerloco.comm.reduce_scatter import Shards

#: ``Op.numel`` of a barrier (also what a header says for one).
BARRIER = -1
#: ``Op.numel`` of a schedule agreement (its payload: the schedule's digest).
AGREE = -2


@dataclass
class Op:
    """One operation on the communication thread's queue, in launch order."""

    seq: int
    numel: int  # BARRIER for a barrier, AGREE for an agreement
    launch_wall: float
    handle: OpHandle  # landed by the queue, or by a survivor's result (elastic)
    codec: Codec | None = None
    payload: torch.Tensor | None = None
    wire: int = 0
    step: int = 0  # training step at launch (what a lost worker's progress is measured from)
    inplace: bool = False  # the FP32 sum may overwrite the payload (nothing reads it afterwards)
    #: Agree on the header first. False for the exchanges of a schedule every worker agreed on
    #: (:meth:`TorchDistCommunicator.agree`): their sizes are known to match, so the payload moves at once.
    checked: bool = True
    note: str = ""  # AGREE: this worker's schedule in words, for the error
    #: A CUDA event the payload is ready after (encode or copy to pinned memory); None on a CPU.
    ready: object = None
    #: The reduce-scatter's layout when the exchange goes through one (the payload is then its shards).
    shards: Shards | None = None
    #: An exchange its transport runs itself (a quorum's at the coordinator): the thread calls it for the flat mean,
    #: with no header and no wait for every peer.
    run: Callable[[], torch.Tensor] | None = None


def header(op: Op) -> torch.Tensor:
    """The operation's header as bytes: launch wall time, sequence number, numel, payload bytes, codec id."""
    codec = op.codec
    nbytes = 0 if op.payload is None else op.payload.numel()
    codec_id = CODEC_NAMES.index(codec.name) if codec is not None and codec.name in CODEC_NAMES else -1
    return torch.tensor([op.launch_wall, op.seq, op.numel, nbytes, codec_id], dtype=torch.float64).view(torch.uint8)


def check_headers(rows: torch.Tensor, pos: int, members: Sequence[int], name: Callable[[int], str]) -> None:
    """Raise ScheduleMismatchError unless every worker's header (rows, float64, in group order) matches
    row pos past the launch time; name(w) is how the error calls worker w."""
    mine = rows[pos, 1:]
    if bool((rows[:, 1:] == mine).all()):
        return

    def describe(r: torch.Tensor) -> str:
        seq, numel, nbytes, cid = (int(v) for v in r[1:])
        if numel == BARRIER:
            return f"exchange #{seq}: barrier"
        if numel == AGREE:
            return f"exchange #{seq}: schedule agreement"
        codec = CODEC_NAMES[cid] if 0 <= cid < len(CODEC_NAMES) else "?"
        return f"exchange #{seq}: {numel} values as {codec} ({nbytes} bytes)"

    lines = "; ".join(f"{name(w)} {describe(rows[i])}" for i, w in enumerate(members))
    raise ScheduleMismatchError(
        f"workers launched different exchanges at the same point: {lines}. Every worker must launch "
        "the same exchanges (same sizes, codec and order); check the fragment schedule and settings"
    )


def check_schedules(rows: torch.Tensor, pos: int, members: Sequence[int], name: Callable[[int], str],
                    note: str) -> None:
    """Raise ScheduleMismatchError unless every worker's schedule digest (rows, in group order) equals
    row pos; note: this worker's schedule in words."""
    mine = rows[pos]
    differ = [w for i, w in enumerate(members) if not torch.equal(rows[i], mine)]
    if differ:
        names = ", ".join(name(w) for w in differ)
        raise ScheduleMismatchError(
            f"{names} run(s) a different exchange schedule from {name(members[pos])}'s "
            f"({note or 'see its settings'}). Every worker must run the same method, fragments, "
            "codec and model and start from the same step: start them all with the same settings "
            "(and --resume from the same checkpoint)"
        )
