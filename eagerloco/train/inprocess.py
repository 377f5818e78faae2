"""The in-process runtime: M workers in one process over a simulated link (``eagerloco train``)."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.data import worker_streams
from eagerloco.device import resolve_device
from eagerloco.train.runtime import Found, Runtime
from eagerloco.train.worker import Worker


class InProcessRuntime(Runtime):
    """Every worker in this process, taking turns on one device; the link and the clock are simulated,
    so blocked time and compute utilization are reported as they would be on that link."""

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        cfg = self.cfg
        device = resolve_device(cfg.device)
        base = base.to(device)  # every worker on the one device, taking turns as on the CPU
        streams = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)
        self.group = InProcessGroup(cfg.workers, cfg.link, seed=cfg.seed, count_overhead=cfg.sim_step_time is None)
        return {m: Worker(base if m == 0 else copy.deepcopy(base), self.group.communicator(m), streams[m], cfg)
                for m in range(cfg.workers)}

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        loaded = super().load(files, found)
        if found is not None:
            self.group.load_state_dict(found[1]["group"])  # the simulated link's state
        return loaded

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"group": self.group.state_dict()}
