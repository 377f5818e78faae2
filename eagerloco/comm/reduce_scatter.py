"""Exchanges summed on the way by a reduce-scatter: about two payloads per worker whatever M.

Each worker quantizes its flat vector once as M shards of whole scale blocks
(:func:`~eagerloco.codec_sizes.shard_numel`); worker j sums shard j of every worker in FP32 in worker order,
divides by M and requantizes to nearest, and the shards are all-gathered: 2(M-1)/M payloads per worker. The
mean differs from the all-gathered one by that second rounding; ``handle.own`` stays the first quantization,
so error feedback does not absorb the second. A shared-support payload shards its kept values alone. The same
functions serve the in-process and the torch.distributed runtimes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagerloco.codec_sizes import shard_align, shard_numel
from eagerloco.codecs import Codec, SharedSupportCodec, TopKCodec, dense_codec
from eagerloco.comm.base import mean_of_payloads

#: The ``transport`` that routes a quantized dense exchange through a reduce-scatter.
REDUCE_SCATTER = "reduce-scatter"


def uses_reduce_scatter(codec: Codec, transport: str, workers: int) -> bool:
    """Whether an exchange in this codec goes through the reduce-scatter: a quantized dense codec, or a shared
    support, among several workers (FP32 is a plain all-reduce; sparse payloads are all-gathered)."""
    if isinstance(codec, SharedSupportCodec):
        return workers > 1
    return transport == REDUCE_SCATTER and workers > 1 and not codec.summable and not isinstance(codec, TopKCodec)


class Shards:
    """The layout of one reduce-scatter exchange: numel values in M shards of ``length`` values, each packed to
    ``nbytes`` bytes; a worker's payload is its M packed shards, one row each."""

    def __init__(self, codec: Codec, numel: int, workers: int) -> None:
        #: The shared-support codec whose kept values are reduced, or None (every value is).
        self.sparse = codec if isinstance(codec, SharedSupportCodec) else None
        if self.sparse is not None:
            codec = self.sparse.values
        self.codec, self.workers = codec, workers
        self.numel = numel if self.sparse is None else self.sparse.support(numel).numel()
        self.full = numel
        self.length = shard_numel(self.numel, workers, shard_align(codec.name, codec.block_size))
        self.nbytes = codec.packed_nbytes(self.length)
        #: The second rounding is to nearest: stochastic noise would differ between runtimes.
        self.requantizer = dense_codec(codec.name, codec.block_size) if codec.stochastic else codec

    @property
    def wire_bytes(self) -> int:
        """Bytes one worker sends (and receives): M-1 quantized shards, then M-1 requantized ones
        (:func:`~eagerloco.codec_sizes.reduce_scatter_wire_bytes`)."""
        return 2 * (self.workers - 1) * self.nbytes

    def pack(self, flat: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, own): the M packed shards of a flat FP32 vector, one after the other (M * nbytes
        bytes, row j for worker j), and its values as the shards' owners decode them."""
        if self.sparse is not None:
            flat = flat[self.sparse.support(self.full).to(flat.device)]
        padded = flat.new_zeros(self.workers * self.length)
        padded[: self.numel] = flat
        rows = torch.stack([self.codec.pack(s, generator) for s in padded.view(self.workers, self.length)])
        return rows.view(-1), self.unpack_rows(self.codec, rows)

    def reduce(self, received: list[torch.Tensor]) -> torch.Tensor:
        """A shard's requantized mean from every worker's packed copy of it (in worker order): dequantized,
        summed in FP32 in worker order, divided by M, packed once more."""
        return self.requantizer.pack(mean_of_payloads(self.codec, received, self.length))

    def unpack_rows(self, codec: Codec, rows: torch.Tensor) -> torch.Tensor:
        """The flat vector that (M, nbytes) packed shards hold (a shared support's spread to its positions)."""
        values = torch.cat([codec.unpack(r, self.length) for r in rows.unbind(0)])[: self.numel]
        return values if self.sparse is None else self.sparse.spread(values, self.full)

    def mean(self, rows: torch.Tensor) -> torch.Tensor:
        """The exchange's flat FP32 mean from the all-gathered requantized shards (M, nbytes)."""
        return self.unpack_rows(self.requantizer, rows)

    def mean_of_payloads(self, payloads: list[torch.Tensor]) -> torch.Tensor:
        """The mean every worker ends with, from all M workers' payloads at once (the in-process runtime)."""
        rows = [p.view(self.workers, self.nbytes) for p in payloads]
        reduced = torch.stack([self.reduce([r[j] for r in rows]) for j in range(self.workers)])
        return self.mean(reduced)

    def exchange(self, payload: torch.Tensor, scatter: Callable[[torch.Tensor], torch.Tensor],
                 gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One worker's side over real collectives (``scatter`` row j to position j, ``gather`` one row to all);
        returns the flat FP32 mean."""
        received = scatter(payload.view(self.workers, self.nbytes))
        return self.mean(gather(self.reduce(list(received.unbind(0)))))
