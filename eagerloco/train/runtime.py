"""What differs between the ways of starting workers, behind one small interface the trainer drives.

A :class:`Runtime` answers, for its process: which workers live here and what they talk through, who
evaluates and writes the run's files, how checkpoint files reach the publisher, and how the summary is
gathered. The runtimes: ``inprocess``, ``distributed``, ``elastic`` and ``job`` (modules of this package)."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from eagerloco import checkpoint as ckpt
from eagerloco.comm.link import check_exchange_fits, emulated_link
from eagerloco.comm.rendezvous import Meeting
from eagerloco.config import Environment, LinkConfig, TrainConfig
from eagerloco.train.resume import resume_checkpoint
from eagerloco.train.rundir import RunManifest, claim
from eagerloco.train.worker import Worker

#: A checkpoint to continue from: its directory and its meta.json.
Found = tuple[Path, dict[str, Any]]


class Runtime:
    """The runtime of one process (``cfg`` validated); the defaults are those of a process that holds whole
    workers alone. ``doing`` names the current work in error messages; ``devices`` counts the accelerators
    MFU is measured against; ``manifest`` lists the run's files (the reporting process writes it)."""

    checkpoint_kind = "inprocess"

    def __init__(self, cfg: TrainConfig, env: Environment) -> None:
        self.cfg, self.env = cfg, env
        self.doing = "training"
        self.devices = 1
        self.lock: Any = None
        self.manifest = RunManifest(cfg.out)

    # -- the run's lifetime -------------------------------------------------------------------------
    def __enter__(self) -> Runtime:
        """Take the run directory (and, on processes, join the others)."""
        self.lock = claim(self.cfg)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Release what :meth:`__enter__` and :meth:`build` took; ``exc``: the error that ends the run."""
        self.close(exc)
        if self.lock is not None:
            self.lock.release()

    def close(self, error: BaseException | None) -> None:
        """Release the communicators and groups; on an error drop what is queued instead of waiting."""

    # -- building -----------------------------------------------------------------------------------
    def resume_point(self) -> Found | None:
        """The checkpoint to continue from (with ``--resume``), checked against this runtime."""
        return resume_checkpoint(self.cfg, self.checkpoint_kind)

    def build(self, corpus: Any, tok: Any, base: nn.Module) -> dict[int, Worker]:
        """This process's workers, by the id of their checkpoint file (empty: nothing left to do)."""
        raise NotImplementedError

    def load(self, files: dict[int, Worker], found: Found | None) -> tuple[int, float]:
        """Load each worker's state from the checkpoint, if any; returns (the step to continue after, the
        real seconds the run spent before)."""
        if found is None:
            return 0, 0.0
        path, meta = found
        for i, w in files.items():
            w.load_state_dict(ckpt.load_worker_state(path, i))
        return int(meta["step"]), float(meta.get("real_elapsed", 0.0))

    def agreement(self) -> Meeting | None:
        """Where this process agrees its settings with the others' (None: it has no others)."""
        return None

    def ready(self, start_step: int, found: Found | None) -> None:
        """Every process is about to train from ``start_step``: announce it, make the run directory, meet."""
        if self.reports():
            if found is not None:
                print(f"resuming from {found[0]} (step {start_step} of {self.cfg.steps})", flush=True)
            Path(self.cfg.out).mkdir(parents=True, exist_ok=True)
            first = self.next_checkpoint(start_step)
            if first is not None:  # listed before any process (the others wait for this one) writes into it
                self.manifest.record(self.manifest.staging(first))

    def next_checkpoint(self, step: int) -> int | None:
        """The step of the first checkpoint after ``step`` (None: there is none)."""
        every = self.cfg.checkpoint_every
        nxt = (step // every + 1) * every if every else None
        return nxt if nxt is not None and nxt <= self.cfg.steps else None

    # -- who does what ------------------------------------------------------------------------------
    def reports(self) -> bool:
        """Whether this process writes the run's files (metrics, summary, checkpoint manifest) now."""
        return True

    def evaluates(self) -> bool:
        """Whether this process evaluates (and scores the zero-shot tasks) now."""
        return True

    # -- during training ----------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        """After every worker of this process completed ``step`` (membership changes)."""

    def after_eval(self, step: int) -> None:
        """On every process at each evaluation point, once the evaluating one is done."""

    def log_fields(self) -> dict[str, Any]:
        """What this runtime adds to each metrics line."""
        return {}

    # -- checkpoints --------------------------------------------------------------------------------
    def gather_checkpoint(self, step: int, entries: dict[int, Any], problem: str | None
                          ) -> tuple[dict[int, Any] | None, str | None]:
        """Bring every process's manifest entries (or its write error) to the publishing process: (entries by
        file id, the first problem) there, (None, problem) elsewhere."""
        return entries, problem

    def checkpoint_meta(self) -> dict[str, Any]:
        """What this runtime records in meta.json besides the settings and the time."""
        return {}

    def share_verdict(self, problem: str | None) -> None:
        """Tell every process how the checkpoint went; raise CheckpointError where it failed."""
        if problem is not None:
            raise ckpt.CheckpointError(problem)

    # -- the end ------------------------------------------------------------------------------------
    def summarize(self, summary: dict[str, Any], files: dict[int, Worker]) -> dict[str, Any] | None:
        """The run's summary from this process's (the accounting of all workers, on the reporting
        process); None on a process that does not report."""
        return summary

    def checked_link(self, num_params: int) -> LinkConfig:
        """What the communicators emulate (:func:`eagerloco.comm.link.emulated_link`), checked to carry one
        exchange of a model of ``num_params`` within the timeout."""
        cfg = self.cfg
        link = emulated_link(cfg.link, cfg.runtime.kernel_link_gbps)
        check_exchange_fits(link, cfg.outer, cfg.workers, num_params, cfg.runtime.dist_timeout)
        return link

    def link_shaping(self) -> str:
        """What the summary calls the bandwidth limit: the kernel's or emulated."""
        return "kernel" if self.cfg.runtime.kernel_link_gbps is not None else "emulated"


def num_params(model: nn.Module) -> int:
    """Parameters of a model (this rank's shards count whole: FSDP's DTensors report the full size)."""
    return sum(p.numel() for p in model.parameters())


def device_count(device: torch.device, world_size: int) -> int:
    """The accelerators a run of ``world_size`` processes uses on a host with this device."""
    return min(world_size, torch.cuda.device_count()) if device.type == "cuda" else 1
