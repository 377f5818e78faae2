"""Who a worker exchanges with: the current outer group, its members, their names, the link to them; it changes
only at an elastic membership change (:mod:`eagerloco.comm.elastic`), while the exchange thread is parked."""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from eagerloco.comm.emulated_link import EmulatedLink
from eagerloco.config import LinkConfig


class Peers:
    """This worker's view of the outer group: its members' worker ids and this worker's position, how errors
    name each worker, and the emulated link with its jitter seed (the same on every worker)."""

    def __init__(self, group: dist.ProcessGroup | None, members: list[int], pos: int,
                 names: Mapping[int, str] | None = None, link: LinkConfig | None = None, seed: int = 0) -> None:
        self.group = group
        self.members = list(members)
        #: This worker's rank in the current group.
        self.pos = pos
        #: This worker's id: stable across membership changes (it names seeds, shards and files).
        self.rank = self.members[pos]
        self.names = dict(names or {})
        self._link_cfg, self._seed = link, seed
        self.link = EmulatedLink(link, seed)

    @property
    def size(self) -> int:
        return len(self.members)

    def name(self, w: int) -> str:
        """How messages call worker w."""
        return self.names.get(w, f"worker {w}")

    def regroup(self, group: dist.ProcessGroup | None, members: list[int]) -> None:
        """A new group of these members (this worker among them)."""
        self.group = group
        self.members = list(members)
        self.pos = self.members.index(self.rank)

    def reset_link(self, epoch: int) -> None:
        """A fresh emulated link for a membership epoch (same seed and epoch on every member)."""
        self.link = EmulatedLink(self._link_cfg, self._seed + 7919 * epoch)
