"""One worker of tests/test_sites_entrypoints.py, started as its own job: an elastic run through one library entry
point, the same command at the start and for a worker that comes back.

Usage: python tests/rejoin_job.py ENTRY OUTDIR WORKER WORKERS PORT STEPS [OUTER_LR [EXPECTED]]

ENTRY is ``hooks`` (outer_loop on connect(elastic=True)), ``hf`` (the Hugging Face callback), ``lightning`` (the
Lightning callback) or ``torchft`` (the torchft port). DiLoCo rounds of 2 steps; while fewer than EXPECTED
workers (default: WORKERS) are in the run, each sleeps 0.2 s a step, so that the run lasts until a worker killed
mid-run is back or a new one has joined (whatever the machine's load), and then goes on at full speed. Each
worker writes OUTDIR/<ENTRY>_<WORKER>.json: where it joined, the workers at the end, and the outer parameters'
digest after its last step, before the loop's end (which makes them equal anyway), and its learning rate.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

import eagerloco
from eagerloco.comm.connect import connect
from eagerloco.comm.elastic import outer_digest
from eagerloco.config import OuterConfig

CONFIG: dict[str, Any] = {"method": "diloco", "inner_steps": 2, "outer_lr": 0.7}
TIMEOUT_S = 20
EXPECTED = [2]  # the workers the run waits for, pacing its steps until they are in


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{worker}/{step}".encode()))
    return torch.randn(4, 8, generator=g), torch.randn(4, generator=g)


def _model() -> torch.nn.Sequential:
    """A small regression net (8 features in, one number out); not the tests' Toy, whose module (conftest) imports
    pytest and makes a session folder: seconds of each job's start."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())],
                               torch.nn.Linear(8, 1), torch.nn.Flatten(0))


def _pace(outer: Any) -> None:
    if outer.num_workers < EXPECTED[0]:
        time.sleep(0.2)


def _report(out: Path, entry: str, worker: int, outer: Any) -> None:
    (out / f"{entry}_{worker}.json").write_text(json.dumps({
        "joined_at": outer.joined_at, "ticks": outer.ticks, "workers": outer.num_workers,
        "lr": outer.inner_optimizer.param_groups[0]["lr"],  # the frameworks' schedules decay it to 0 at their end
        "digest": outer_digest(outer.outer_parameters())}))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, outer: Any, worker: int, steps: int) -> None:
    """The inner steps a hook-API loop runs, from the run's step on (a worker that joined goes on from there)."""
    for step in range(outer.ticks + 1, steps + 1):
        x, y = _batch(worker, step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        _pace(outer)


def hooks(out: Path, worker: int, workers: int, port: int, steps: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    peers = connect(f"127.0.0.1:{port}", worker, workers, timeout_s=TIMEOUT_S, elastic=True)
    with eagerloco.outer_loop(model, opt, OuterConfig(**CONFIG), peers=peers) as outer:
        _train(model, opt, outer, worker, steps)
        _report(out, "hooks", worker, outer)


def torchft(out: Path, worker: int, workers: int, port: int, steps: int) -> None:
    from eagerloco.integrations.torchft import DiLoCo, Manager

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(f"127.0.0.1:{port}", worker, workers, timeout_s=TIMEOUT_S, elastic=True)
    with DiLoCo(manager, [model], inner, outer_opt, 2) as outer:
        _train(model, inner, outer, worker, steps)
        _report(out, "torchft", worker, outer)


class _Regression(torch.nn.Module):
    """The model as a Trainer's model: a dict of tensors in, the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = _model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.toy(x) - y) ** 2).mean()}


def hf(out: Path, worker: int, workers: int, port: int, steps: int) -> None:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from eagerloco.integrations.hf import OuterLoopCallback

    class Batches(Dataset):
        def __len__(self) -> int:
            return 4 * steps

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = _batch(worker, i)
            return {"x": x[0], "y": y[0]}

    callback = OuterLoopCallback(OuterConfig(**CONFIG), outer_addr=f"127.0.0.1:{port}", worker_id=worker,
                                 workers=workers, timeout_s=TIMEOUT_S, elastic=True)

    class Watch(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            assert callback.outer is not None
            _pace(callback.outer)
            if state.global_step == state.max_steps:
                _report(out, "hf", worker, callback.outer)

    args = TrainingArguments(output_dir=str(out / f"hf{worker}"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, logging_steps=steps)
    Trainer(model=_Regression(), args=args, train_dataset=Batches(), callbacks=[callback, Watch()]).train()


def lightning(out: Path, worker: int, workers: int, port: int, steps: int) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from eagerloco.integrations.lightning import OuterLoopCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.toy = _model()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return ((self.toy(x) - y) ** 2).mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            decay = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=steps)  # to 0 at the end
            return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    callback = OuterLoopCallback(OuterConfig(**CONFIG), outer_addr=f"127.0.0.1:{port}", worker_id=worker,
                                 workers=workers, timeout_s=TIMEOUT_S, elastic=True)

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            assert callback.outer is not None
            _pace(callback.outer)
            if trainer.global_step == steps:
                _report(out, "lightning", worker, callback.outer)

    batches = [_batch(worker, i) for i in range(steps)]
    data = DataLoader(TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])),
                      batch_size=4, shuffle=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[callback, Watch()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), data)


def main() -> None:
    entry, outdir, worker, workers, port, steps, *more = sys.argv[1:]
    CONFIG["outer_lr"] = float(more[0]) if more else CONFIG["outer_lr"]
    EXPECTED[0] = int(more[1]) if len(more) > 1 else int(workers)
    torch.set_num_threads(1)
    run = {"hooks": hooks, "hf": hf, "lightning": lightning, "torchft": torchft}[entry]
    with eagerloco.exit_on_errors():
        run(Path(outdir), int(worker), int(workers), int(port), int(steps))


if __name__ == "__main__":
    try:
        main()
        code = 0
    except SystemExit as stop:  # exit_on_errors has printed its one line
        code = stop.code if isinstance(stop.code, int) else 1
    # Out without the interpreter's teardown: a job forked from the tests' job server holds torch, transformers and
    # Lightning, whose teardown takes seconds and checks nothing here (the output and the report are written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
