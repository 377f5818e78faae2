"""Shared toy models and an in-process driver for closed-form tests of the outer algorithm; the
tiers' hooks (tests/tiers.py)."""

from __future__ import annotations

import copy
import os
import signal
import zlib
from collections.abc import Callable

import pytest
import torch
from standin import session_folders

# The tiers' hooks: a test that starts a process must be marked `processes`; the longest files first under xdist.
from tiers import (  # noqa: F401 - pytest hooks, found by name in this module
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)
from torch import nn
from toy import Toy

from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import LinkConfig, OuterConfig
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all
from testing.faults import environment as fault_environment

# A suite started in the background of a shell without job control (`make test &` in a script)
# inherits SIGINT ignored, and so would every process the tests start: the tests that stop runs
# with Ctrl-C would then see it ignored. A handler of our own is reset to the default on exec, so
# the processes the tests start get SIGINT as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

torch.set_num_threads(1)
# The processes the tests start use one thread each too: on 2 shared cores two OpenMP threads per
# process spin against each other (a 24-step tiny run: 18 s with 2, 5 s with 1), and runs compared
# bit for bit with this process's add in the same order. The launcher gives its ranks one thread each
# already (as torchrun does); the rest inherit this.
os.environ["OMP_NUM_THREADS"] = "1"

# Every process the tests start can have faults injected (EAGERLOCO_FAULT_KILL, EAGERLOCO_FAULT_EVAL_DELAY):
# the testing package's sitecustomize installs them at interpreter start when the variables ask for them.
os.environ.update(fault_environment({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}))

# No test reads the home folder or the network: the session has a data cache of its own (a stand-in for the
# Brown Corpus) and a matplotlib folder, made once by the process that starts the suite (under xdist, the
# workers inherit them).
if "PYTEST_XDIST_WORKER" not in os.environ:
    session_folders()


GradFn = Callable[[int, int, str, torch.Tensor], torch.Tensor]


def constant_grads(per_worker: list[float]) -> GradFn:
    """Worker m's gradient is per_worker[m] * (1, 2, 3, ...) for every parameter at every step."""

    def fn(m: int, step: int, name: str, p: torch.Tensor) -> torch.Tensor:
        return per_worker[m] * torch.arange(1, p.numel() + 1, dtype=torch.float32).view(p.shape)

    return fn


def seeded_grads(seed: int = 0) -> GradFn:
    """A fixed pseudo-random gradient per (worker, step, parameter): independent of the parameters."""

    def fn(m: int, step: int, name: str, p: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{m}/{step}/{name}".encode()))
        return torch.randn(p.shape, generator=g)

    return fn


def run_inprocess(
    cfg: OuterConfig,
    workers: int,
    steps: int,
    grads: GradFn,
    inner_lr: float = 0.1,
    model: nn.Module | None = None,
    link: LinkConfig | None = None,
    step_time: float | None = None,
) -> tuple[list[nn.Module], list[OuterSync], InProcessGroup, nn.Module]:
    """Train `workers` replicas with inner SGD on the given gradients; returns (models, syncs, group, init)."""
    torch.manual_seed(0)
    init = model if model is not None else Toy()
    models = [copy.deepcopy(init) for _ in range(workers)]
    group = InProcessGroup(workers, link, count_overhead=step_time is None)
    opts = [torch.optim.SGD(m.parameters(), lr=inner_lr) for m in models]
    syncs = [OuterSync(m, o, group.communicator(i), cfg) for i, (m, o) in enumerate(zip(models, opts, strict=True))]
    for step in range(1, steps + 1):
        for i, m in enumerate(models):
            for name, p in m.named_parameters():
                p.grad = grads(i, step, name, p.detach())
            if step_time is not None:
                group.communicator(i).add_compute(step_time)
        before_inner_step_all(syncs)
        for o in opts:
            o.step()
        after_inner_step_all(syncs)
    return models, syncs, group, init


def plain_sgd_outer(lr: float = 1.0) -> dict[str, object]:
    return {"outer_lr": lr, "outer_momentum": 0.0, "outer_nesterov": False}


@pytest.fixture
def toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


class StalledGroup:
    """Workers on seeded gradients, each inner step step_s simulated seconds, stall: worker -> extra seconds in
    each of the steps ``at`` (a preemption, a filesystem hiccup); models and gradients on ``device``."""

    def __init__(self, cfg: OuterConfig, workers: int = 3, stall: dict[int, float] | None = None,
                 at: tuple[int, ...] = (3,), step_s: float = 1.0, device: str = "cpu") -> None:
        torch.manual_seed(0)
        init = Toy().to(device)
        self.models = [copy.deepcopy(init) for _ in range(workers)]
        self.group = InProcessGroup(workers, count_overhead=False)
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in self.models]
        self.syncs = [OuterSync(m, o, self.group.communicator(i), cfg)
                      for i, (m, o) in enumerate(zip(self.models, self.opts, strict=True))]
        self.stall, self.at, self.step_s, self.step, self.device = stall or {}, at, step_s, 0, device

    def run(self, steps: int) -> StalledGroup:
        grads = seeded_grads()
        for step in range(self.step + 1, self.step + steps + 1):
            for i, m in enumerate(self.models):
                for _ in range(self.syncs[i].inner_steps_due()):
                    for name, p in m.named_parameters():
                        p.grad = grads(i, step, name, p.detach()).to(self.device)
                    self.opts[i].step()
                    stall = self.stall.get(i, 0.0) if step in self.at else 0.0
                    self.group.communicator(i).add_compute(self.step_s + stall)
            before_inner_step_all(self.syncs)
            after_inner_step_all(self.syncs)
        self.step += steps
        return self

    def finish(self) -> tuple[list[nn.Module], list[OuterSync], InProcessGroup]:
        for s in self.syncs:
            s.drain(apply=True)
        return self.models, self.syncs, self.group
