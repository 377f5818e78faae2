"""One worker of tests/test_hooks_meet.py, started as its own job.

Usage: python tests/hooks_meet_job.py SCENARIO OUTDIR WORKER PORT

Each worker seeds its model with its own id (the workers' weights differ) unless the scenario says
otherwise, and runs DiLoCo (H = 2) for 4 steps through ``eagerloco.outer_loop`` inside
``exit_on_errors``; it saves its outer parameters to OUTDIR/<scenario>_<worker>.pt.

- ``synced``: init_sync left on: both start from worker 0's weights and end with the same outer parameters;
- ``unsynced``: init_sync=False: the different weights stop both workers with one line;
- ``outer_lr``: worker 1 passes another outer lr: both stop with one line naming it;
- ``eager``: eager instead of DiLoCo; the end's consensus leaves both with one model (saved too, as
  OUTDIR/eager_model_<worker>.pt).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch
from conftest import Toy

import eagerloco


def main() -> None:
    scenario, out, worker, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(worker)  # a script that does not seed alike: each worker its own weights
    model = Toy(num_blocks=2, width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs: dict = {"init_sync": scenario != "unsynced"}
    if scenario == "outer_lr" and worker == 1:
        kwargs["outer_lr"] = 0.4
    method = "eager" if scenario == "eager" else "diloco"
    with eagerloco.exit_on_errors(), eagerloco.outer_loop(
            model, opt, outer_addr=f"127.0.0.1:{port}", worker_id=worker, workers=2, timeout_s=30,
            method=method, inner_steps=2, **kwargs) as outer:
        for step in range(1, 5):
            g = torch.Generator().manual_seed(zlib.crc32(f"{worker}/{step}".encode()))
            opt.zero_grad()
            ((model(torch.randn(3, 4, generator=g)) - 1.0) ** 2).mean().backward()
            opt.step()
    torch.save(outer.outer_parameters(), out / f"{scenario}_{worker}.pt")
    torch.save([p.detach() for p in model.parameters()], out / f"{scenario}_model_{worker}.pt")


if __name__ == "__main__":
    main()
