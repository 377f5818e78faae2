"""PyTorch Lightning: a Callback that runs the outer algorithm around ``Trainer.fit`` (docs/guides/frameworks.md).

The hooks go on the module's single optimizer (Lightning's closure is handled); the outer state is the
callback's state in every checkpoint, restored on ``fit(ckpt_path=...)``; the link accounting is logged every
step; under ``precision="16-mixed"`` the loop gets the precision plugin's GradScaler.
"""

from __future__ import annotations

from typing import Any

from eagerloco.comm.base import Communicator
from eagerloco.comm.connect import Connection
from eagerloco.config import OuterConfig
from eagerloco.extras import require
from eagerloco.hooks import OuterLoop
from eagerloco.integrations import check_options, start_loop

#: The base class, or the one line that names the [lightning] extra (Lightning is not a dependency of eagerloco).
Callback = require("pytorch_lightning", "eagerloco.integrations.lightning").Callback


class OuterLoopCallback(Callback):
    """Run ``eagerloco.outer_loop`` inside a Lightning Trainer; takes what the Hugging Face callback takes
    (an OuterConfig, ``peers=`` or connect()'s keywords, the loop's options; see :mod:`eagerloco.integrations`)."""

    def __init__(self, config: OuterConfig | None = None, *, peers: Connection | Communicator | None = None,
                 log_every: int = 1, **options: Any) -> None:
        check_options(config, options)  # a bad setting fails here, not at train start
        self.config, self.peers, self.options, self.log_every = config, peers, options, log_every
        self.outer: OuterLoop | None = None
        self._restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"OuterLoopCallback needs exactly one optimizer, the module has {len(trainer.optimizers)}")
        # A worker joining an elastic run takes a live worker's schedule: one stepped after each step (interval "step").
        scheduler = next((c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"), None)
        # precision="16-mixed" steps through the precision plugin's GradScaler (plugins/precision/amp.py,
        # MixedPrecision.optimizer_step); the loop must count a step the scaler skips on this worker alone, or
        # the others wait for an exchange this one never launches. A grad_scaler= of the user's own wins.
        self.outer = start_loop(pl_module, trainer.optimizers[0], self.config, self.peers, self.options,
                                getattr(trainer.precision_plugin, "scaler", None), scheduler)
        if self.outer.joined_at is not None:  # joined an elastic run under way: it goes on from the run's step
            continue_at(trainer, self.outer.joined_at)
        elif self._restored is not None:  # fit(ckpt_path=...): Lightning restored the callbacks first
            self.outer.load_state_dict(self._restored)
        self._restored = None
        self.outer.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.outer is None or trainer.global_step % self.log_every:
            return
        m = self.outer.metrics()
        pl_module.log_dict({"outer/bytes_sent": m["bytes_sent"], "outer/blocked_s": m["blocked_s"],
                            "outer/compute_utilization": m["compute_utilization"]},
                           on_step=True, on_epoch=False, rank_zero_only=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.outer is not None:
            self.outer.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.outer is not None:
            self.outer.close(cancel=True)

    def state_dict(self) -> dict[str, Any]:
        """The outer state (every rank calls this when Lightning checkpoints)."""
        if self.outer is None:
            return dict(self._restored or {})
        return self.outer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._restored = state_dict


def continue_at(trainer: Any, step: int) -> None:
    """Lightning's step count set to ``step``, as its own restore of a checkpoint sets it, so that the loop ends where
    the run's other workers end: at ``max_steps``, or (a run of epochs) at the steps its epochs make."""
    loop = trainer.fit_loop.epoch_loop
    automatic = trainer.lightning_module.automatic_optimization
    done = (loop.automatic_optimization.optim_progress.optimizer.step.total if automatic
            else loop.manual_optimization.optim_step_progress.total)
    done.ready = done.completed = step
    if loop.max_steps < 0:  # epochs: its own start at batch 0 would run past the others' end
        loop.max_steps = int(trainer.estimated_stepping_batches)
