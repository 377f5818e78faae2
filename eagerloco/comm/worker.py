"""Workers of several ranks: every rank sees the worker's outer exchanges, the first rank moves them."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from eagerloco.codecs import Codec
from eagerloco.comm.base import Communicator, Handle, WorkerStats, encode, flatten, hand_over, unflatten
from eagerloco.comm.distributed import TorchDistCommunicator, TorchDistHandle
from eagerloco.comm.errors import PeerError, describe_exception
from eagerloco.comm.groups import DistContext
from eagerloco.comm.reduce_scatter import Shards, uses_reduce_scatter
from eagerloco.config import LinkConfig


class WorkerCommunicator(Communicator):
    """Every rank of a worker sees the worker's outer exchanges; only the first rank uses the link.

    The first rank exchanges with the other workers and broadcasts the mean over the inner group when waited
    on. Every rank must wait on handles in the same order (never branch on done()); link bytes count on the first.
    """

    def __init__(self, ctx: DistContext, outer: TorchDistCommunicator | None) -> None:
        if ctx.is_outer_rank != (outer is not None):
            raise ValueError("the worker's first rank needs its outer communicator; the other ranks none")
        self.ctx, self.outer = ctx, outer
        self.rank, self.num_workers = ctx.worker, ctx.workers
        self.stats = outer.stats if outer is not None else WorkerStats()
        self._leader = ctx.inner_ranks[0]

    def allreduce_mean(
        self, tensors: list[torch.Tensor], codec: Codec, generator: torch.Generator | None = None,
        *, keep_own: bool = True, agreed: bool = False, transport: str = "allgather",
    ) -> _WorkerHandle:
        like = [torch.empty(t.shape, device="meta") for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        if self.outer is not None:
            h = self.outer.allreduce_mean(tensors, codec, generator, keep_own=keep_own, agreed=agreed,
                                          transport=transport)
            return _WorkerHandle(self, h, h.own, h.payload_bytes, like, device)
        flat = flatten(tensors)
        # Packed as the first rank packs it, with the same generator state: the same `own`.
        if uses_reduce_scatter(codec, transport, self.num_workers):
            packed, own_flat = Shards(codec, flat.numel(), self.num_workers).pack(flat, generator)
        else:
            packed, own_flat = encode(codec, flat, generator)
        return _WorkerHandle(self, None, unflatten(own_flat, like), packed.numel(), like, device)

    def agree(self, schedule: bytes, describe: str = "") -> bool:
        """The first rank agrees with the other workers; the others have no exchange to check."""
        return self.outer.agree(schedule, describe) if self.outer is not None else False

    def barrier(self) -> None:
        if self.outer is not None:
            self.outer.barrier()
        if self.ctx.ranks_per_worker > 1:  # the inner group (separate jobs: the job's WORLD, None)
            dist.barrier(group=self.ctx.inner_group)

    def close(self, cancel: bool = False) -> None:
        """Close the first rank's outer communicator (cancel: drop what is still queued; see
        :meth:`TorchDistCommunicator.close`); the other ranks hold nothing to release."""
        if self.outer is not None:
            self.outer.close(cancel=cancel)


class _WorkerHandle(Handle):
    def __init__(self, comm: WorkerCommunicator, outer: TorchDistHandle | None, own: list[torch.Tensor],
                 payload_bytes: int, like: list[torch.Tensor], device: torch.device) -> None:
        self._comm, self._outer, self._like, self._device = comm, outer, like, device
        self.own, self.payload_bytes = own, payload_bytes
        self._waited = False

    def done(self) -> bool:
        """Exact on the first rank; the other ranks only know once they waited."""
        return self._waited or (self._outer is not None and self._outer.done())

    def wait(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """First rank: wait, then broadcast the mean with one flag value (1: the exchange failed, so the other ranks
        raise PeerError); the others: receive it."""
        if self._waited:
            raise RuntimeError("this exchange was already waited on; wait on each handle exactly once")
        self._waited = True
        ctx = self._comm.ctx
        numel = sum(t.numel() for t in self._like)
        bcast_device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        buf = torch.zeros(numel + 1, dtype=torch.float32, device=bcast_device)
        error: BaseException | None = None
        t0 = time.perf_counter()
        if self._outer is not None:
            try:
                mean = self._outer.wait()
                buf[:numel] = flatten(mean).to(bcast_device)
            except BaseException as e:  # tell the other ranks, then raise here
                error = e
                buf[numel] = 1.0
        try:
            dist.broadcast(buf, src=self._comm._leader, group=ctx.inner_group)
        except Exception as e:
            if error is None:
                raise PeerError(
                    f"worker {ctx.worker}'s first rank (global rank {self._comm._leader}) stopped while "
                    f"sharing the outer result ({describe_exception(e)}). Check its log, then restart all workers "
                    "and resume from the last checkpoint.", [ctx.worker]
                ) from e
        if self._outer is None:
            self._comm.stats.blocked_s += time.perf_counter() - t0
        if error is not None:
            raise error
        if buf[numel].item() != 0.0:
            raise PeerError(
                f"the outer exchange failed on worker {ctx.worker}'s first rank (global rank "
                f"{self._comm._leader}); its log names the cause. Restart all workers and resume from "
                "the last checkpoint.", []
            )
        if out is not None:
            return hand_over(unflatten(buf[:numel], self._like), out)
        return [t.to(self._device) for t in unflatten(buf[:numel], self._like)]


def communicator_for(ctx: DistContext, link: LinkConfig | None = None, **kwargs: Any) -> Communicator:
    """The communicator every rank uses: the outer one (R = 1, or every rank exchanging its shard, each on 1/R of
    the link's bandwidth), or a worker-wide one (R > 1, the first rank exchanging for all). ``kwargs`` go to
    :class:`TorchDistCommunicator`, over the context's timeout, worker names and store."""
    kwargs = {"timeout_s": ctx.timeout_s, "names": ctx.worker_names(), "store": ctx.store, **kwargs}
    if ctx.sharded_outer:
        share = link
        if link is not None and ctx.ranks_per_worker > 1:
            share = replace(link, bandwidth_gbps=link.bandwidth_gbps / ctx.ranks_per_worker)
        return TorchDistCommunicator(ctx.outer_group, share, channel=ctx.rank_in_worker, **kwargs)
    outer = TorchDistCommunicator(ctx.outer_group, link, **kwargs) if ctx.is_outer_rank else None
    if ctx.ranks_per_worker == 1:
        assert outer is not None
        return outer
    return WorkerCommunicator(ctx, outer)
