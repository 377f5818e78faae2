"""Every worker starts from worker 0's parameters (``init_sync``, as torchft's Manager does at step 0), before
the outer algorithm copies them and before any exchange."""

from __future__ import annotations

import torch
import torch.distributed as dist

from eagerloco.comm.groups import DistContext


@torch.no_grad()
def broadcast_parameters(params: list[torch.Tensor], ctx: DistContext | None,
                         outer_group: dist.ProcessGroup | None) -> None:
    """Overwrite ``params`` with those of the first rank of ``outer_group`` (worker 0) on every rank of every worker
    (``ctx`` None: one rank each)."""
    if outer_group is not None:
        for p in params:  # gloo carries host tensors: one copy each way
            host = p.detach().to("cpu").contiguous()
            dist.broadcast(host, group=outer_group, group_src=0)
            p.copy_(host)
    if ctx is not None and ctx.ranks_per_worker > 1 and not ctx.sharded_outer:  # then from the worker's first rank
        for p in params:
            dist.broadcast(p.data, src=ctx.inner_ranks[0], group=ctx.inner_group)
