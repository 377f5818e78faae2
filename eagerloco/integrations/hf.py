"""Hugging Face ``transformers``: a TrainerCallback that runs the outer algorithm around ``Trainer.train``
(docs/guides/frameworks.md). Each ``checkpoint-<step>/`` gets the worker's outer state, read back on resume;
every log line gets ``outer.metrics()``; under ``fp16=True`` the loop gets the Trainer's GradScaler.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

import torch

from eagerloco.atomic import atomic_file
from eagerloco.comm.base import Communicator
from eagerloco.comm.connect import Connection
from eagerloco.config import OuterConfig
from eagerloco.extras import require
from eagerloco.hooks import OuterLoop
from eagerloco.integrations import check_options, start_loop

#: The base class, or the one line that names the [hf] extra (transformers is not a dependency of eagerloco).
TrainerCallback = require("transformers", "eagerloco.integrations.hf").TrainerCallback

#: The file each checkpoint folder gets per worker (the same folder may hold several workers' files).
STATE_FILE = "eagerloco_outer_worker{worker}.pt"


class OuterLoopCallback(TrainerCallback):
    """Run ``eagerloco.outer_loop`` inside a Trainer.

    ``peers``: the other workers (default: connect at train begin with ``options``, connect()'s keywords and the
    loop's); ``resume_from``: the checkpoint folder to read the outer state from (default: the one the Trainer
    resumed from).
    """

    def __init__(self, config: OuterConfig | None = None, *, peers: Connection | Communicator | None = None,
                 resume_from: str | Path | None = None, **options: Any) -> None:
        check_options(config, options)  # a bad setting fails here, not at train start
        self.config, self.peers, self.options, self.resume_from = config, peers, options, resume_from
        self.outer: OuterLoop | None = None
        self._ended_early: _EndedEarly | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if optimizer is None or model is None:
            raise RuntimeError("the Trainer gave the callback no model or optimizer at train begin")
        model = getattr(model, "module", model)  # the bare model under a DDP wrapper
        # Under fp16 accelerate's wrapper steps through the GradScaler (accelerate/optimizer.py,
        # AcceleratedOptimizer.step); the loop must count a step the scaler skips on this worker alone, or the
        # others wait for an exchange this one never launches. A grad_scaler= of the user's own wins.
        self.outer = start_loop(model, optimizer, self.config, self.peers, self.options,
                                getattr(optimizer, "scaler", None), kwargs.get("lr_scheduler"))
        if self.outer.joined_at is not None:  # joined an elastic run under way: it goes on from the run's step
            state.global_step = self.outer.joined_at
        elif state.global_step > 0:  # resumed: the outer state of the checkpoint it resumed from
            folder = Path(self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}")
            path = folder / STATE_FILE.format(worker=self.outer.worker)
            if not path.exists():
                self.outer.close()
                raise FileNotFoundError(
                    f"the Trainer resumed at step {state.global_step} but {path} holds no eagerloco outer state "
                    "(was the checkpoint written with OuterLoopCallback, by this worker?); pass resume_from= "
                    "the checkpoint folder")
            self.outer.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        self.outer.start()
        self._ended_early = _EndedEarly(self.outer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.outer is not None
        outer_state = self.outer.state_dict()  # every rank: in-flight exchanges resolve together
        if self.outer.is_reporting_rank:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            with atomic_file(folder / STATE_FILE.format(worker=self.outer.worker)) as f:  # never half a file
                torch.save(outer_state, f)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.outer is None or logs is None:
            return
        metrics = self.outer.metrics()
        logs.update(metrics)
        # The Trainer copied the line into its history before calling back: complete that copy too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.outer is not None:
            if self._ended_early is not None:
                self._ended_early.disarm()
            self.outer.finish()


class _EndedEarly:
    """A Trainer stopped before its end never calls on_train_end: say so in one line and release the loop, before
    the hook API's own advice (which does not apply here). The Trainer has no exception callback, so this hooks
    sys.excepthook for Ctrl-C and the exit for anything else.
    """

    def __init__(self, loop: OuterLoop) -> None:
        self.loop, self.previous = loop, sys.excepthook
        sys.excepthook = self.excepthook
        atexit.register(self.at_exit)  # runs before the loop's own exit handler (last in, first out)

    def disarm(self) -> None:
        if sys.excepthook == self.excepthook:
            sys.excepthook = self.previous
        atexit.unregister(self.at_exit)

    def excepthook(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt) or self.loop.finished:
            self.previous(kind, value, tb)
            return
        self.release("stopped by Ctrl-C (SIGINT)")

    def at_exit(self) -> None:
        if not self.loop.finished:
            self.release("training ended before the Trainer's end (see above)")

    def release(self, what: str) -> None:
        print(f"eagerloco: {what}: the outer loop's exchanges in flight are dropped; continue from the Trainer's "
              "last checkpoint (trainer.train(resume_from_checkpoint=True))", file=sys.stderr, flush=True)
        self.loop.close(cancel=True)
