"""One worker of tests/test_hooks_meet.py, started as its own job.

Usage: python tests/hooks_meet_job.py SCENARIO OUTDIR WORKER PORT

Each worker seeds its model with its own id (the workers' weights differ) unless the scenario says
otherwise, and runs DiLoCo (H = 2) for 4 steps through ``eagerloco.outer_loop`` inside
``exit_on_errors``; it saves its outer parameters to OUTDIR/<scenario>_<worker>.pt.

- ``synced``: init_sync left on: both start from worker 0's weights and end with the same outer parameters;
- ``unsynced``: init_sync=False: the different weights stop both workers with one line;
- ``outer_lr``: worker 1 passes another outer lr: both stop with one line naming it;
- ``eager``: eager instead of DiLoCo; the end's consensus leaves both with one model (saved too, as
  OUTDIR/eager_model_<worker>.pt);
- ``torchft``: torchft's ``DiLoCo`` call, each worker seeded with its own id: both start from worker 0's
  weights (its fragments are parts of the model, whose own forward the loop calls) and end with the same
  outer parameters;
- ``torchft_lr``: the same, worker 1's outer optimizer with another lr: both stop with one line naming it;
- ``resume_<style>_<same|other>``: each worker first trains alone from the same seed (2 steps, or 4 on
  worker 1 under ``other``), keeps a checkpoint, then joins the other and resumes from it, the torchft
  way (``torchft``: model, inner and outer optimizer state dicts) or eagerloco's (``state``:
  ``OuterLoop.state_dict``). Different checkpoints stop both workers with one line naming each one's
  step and outer state; the same checkpoint trains on.
"""

from __future__ import annotations

import copy
import sys
import zlib
from pathlib import Path

import torch
from toy import Toy

import eagerloco
from eagerloco.comm.connect import connect
from eagerloco.config import OuterConfig
from eagerloco.integrations.torchft import DiLoCo, Manager


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, key: str) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    opt.zero_grad()
    ((model(torch.randn(3, 4, generator=g)) - 1.0) ** 2).mean().backward()
    opt.step()


def torchft(scenario: str, out: Path, worker: int, port: int) -> None:
    torch.manual_seed(worker)
    model = Toy(num_blocks=2, width=4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    lr = 0.4 if scenario == "torchft_lr" and worker == 1 else 0.7
    outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    manager = Manager(outer_addr=f"127.0.0.1:{port}", worker_id=worker, workers=2, timeout_s=30)
    fragments = [model.blocks[0], torch.nn.ModuleList([model.blocks[1]])]  # parts of the model, never called
    with eagerloco.exit_on_errors(), DiLoCo(manager, fragments, inner, outer, 2) as loop:
        for step in range(1, 5):
            _step(model, inner, f"{worker}/{step}")
    torch.save(loop.outer_parameters(), out / f"{scenario}_{worker}.pt")


def resume(style: str, other: bool, out: Path, worker: int, port: int) -> None:
    """A checkpoint of a run alone (seed 0, the same data on every worker), then the joined run from it."""
    first = 4 if other and worker == 1 else 2

    def run(join: bool, saved: dict | None) -> tuple[dict, list[torch.Tensor]]:
        torch.manual_seed(0 if saved is None else worker)  # the joined run's own weights are replaced
        model = Toy(num_blocks=2, width=4)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        where = {"outer_addr": f"127.0.0.1:{port}", "worker_id": worker, "workers": 2, "timeout_s": 30} if join else {}
        if saved is not None:
            model.load_state_dict(saved["model"])
            inner.load_state_dict(saved["inner"])
        if style == "torchft":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            loop = DiLoCo(Manager(**where), [model], inner, outer, 2)
        else:
            loop = eagerloco.outer_loop(model, inner, OuterConfig(method="diloco", inner_steps=2),
                                        peers=connect(**where))
        with loop:
            if saved is not None:
                (outer if style == "torchft" else loop).load_state_dict(saved["outer"])
            steps = range(first + 1, first + 3) if join else range(1, first + 1)
            for step in steps:
                _step(model, inner, f"{worker if join else 'alone'}/{step}")
        state = {"model": model.state_dict(), "inner": inner.state_dict(),
                 "outer": outer.state_dict() if style == "torchft" else loop.state_dict()}
        return copy.deepcopy(state), loop.outer_parameters()

    saved, _ = run(False, None)
    with eagerloco.exit_on_errors():
        _, params = run(True, saved)
    torch.save(params, out / f"resume_{worker}.pt")


def main() -> None:
    scenario, out, worker, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if scenario.startswith("torchft"):
        torchft(scenario, out, worker, port)
        return
    if scenario.startswith("resume_"):
        _, style, which = scenario.split("_")
        resume(style, which == "other", out, worker, port)
        return
    torch.manual_seed(worker)  # a script that does not seed alike: each worker its own weights
    model = Toy(num_blocks=2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer_lr = 0.4 if scenario == "outer_lr" and worker == 1 else 0.7
    config = OuterConfig(method="eager" if scenario == "eager" else "diloco", inner_steps=2, outer_lr=outer_lr)
    with eagerloco.exit_on_errors(), eagerloco.outer_loop(
            model, opt, config, peers=connect(f"127.0.0.1:{port}", worker, 2, timeout_s=30,
                                              init_sync=scenario != "unsynced")) as outer:
        for step in range(1, 5):
            g = torch.Generator().manual_seed(zlib.crc32(f"{worker}/{step}".encode()))
            opt.zero_grad()
            ((model(torch.randn(3, 4, generator=g)) - 1.0) ** 2).mean().backward()
            opt.step()
    torch.save(outer.outer_parameters(), out / f"{scenario}_{worker}.pt")
    torch.save([p.detach() for p in model.parameters()], out / f"{scenario}_model_{worker}.pt")


if __name__ == "__main__":
    main()
