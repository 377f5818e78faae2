"""Every worker starts from worker 0's parameters (``init_sync``, as torchft's Manager does at step 0).

Worker 0's first rank sends each parameter to every worker's first rank over the outer group, and
each first rank to the other ranks of its worker. Nothing else is in flight yet: this runs before
the outer algorithm copies the parameters, and before any exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagerloco.comm.groups import DistContext


@torch.no_grad()
def broadcast_parameters(params: list[torch.Tensor], ctx: DistContext, outer_group: dist.ProcessGroup | None) -> None:
    """Overwrite ``params`` with worker 0's, on every rank of every worker.

    Args:
        params: this rank's parameters, in the same order on every rank (the model's).
        ctx: where this rank sits (its worker, its inner group).
        outer_group: the group of the workers' first ranks (None on the other ranks).
    """
    if outer_group is not None:
        for p in params:  # gloo carries host tensors: one copy each way
            host = p.detach().to("cpu").contiguous()
            dist.broadcast(host, group=outer_group, group_src=0)
            p.copy_(host)
    if ctx.ranks_per_worker > 1 and not ctx.sharded_outer:  # then inside the worker, from its first rank
        for p in params:
            dist.broadcast(p.data, src=ctx.inner_ranks[0], group=ctx.inner_group)


__all__ = ["broadcast_parameters"]
