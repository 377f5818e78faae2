"""A worker of the loop: a model replica with its inner optimizer, data stream and outer algorithm; and
what every runtime builds workers from (:func:`prepare`, evaluation, the model's FLOPs)."""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from eagerloco.checkpoint import CheckpointError
from eagerloco.comm.base import Communicator
from eagerloco.config import ConfigError, TrainConfig
from eagerloco.data import eval_batches, get_tokenizer, load_corpus
from eagerloco.device import (
    autocast,
    compile_model,
    device_name,
    inner_optimizer,
    peak_tflops,
    resolve_precision,
    synchronize,
)
from eagerloco.flops import flops_per_token
from eagerloco.fsdp import load_model_state, local_state, shard_optimizer_state
from eagerloco.model import GPT, model_config
from eagerloco.optim import muon_with_adamw
from eagerloco.outer import OuterSync

#: AdamW's betas for the inner steps.
BETAS = (0.9, 0.95)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_inner_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The inner optimizer of --inner-optimizer: AdamW over every parameter, or Muon for the blocks'
    matrices with AdamW for the rest, combined into one (:func:`eagerloco.optim.muon_with_adamw`)."""
    if cfg.inner_optimizer == "muon":
        return muon_with_adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=BETAS,
                               muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum)
    return inner_optimizer(model.parameters(), device, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=BETAS)


class Worker:
    """One replica: model, inner optimizer with its schedule, outer algorithm, data stream. On CUDA each
    half-step ends with a synchronization, so the accounted compute time is the kernels', not their launch's."""

    def __init__(
        self, model: nn.Module, comm: Communicator, stream: Any, cfg: TrainConfig, inner_group: Any = None
    ) -> None:
        """inner_group: the process group of this worker's ranks, whose gradients are averaged
        every step (data parallelism inside the worker); None when the worker is one rank."""
        self.model = model
        self.inner_group = inner_group
        self.comm = comm
        self.stream = stream
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.precision = resolve_precision(cfg.precision, self.device)
        #: What the inner steps call: the compiled model with --compile (same parameters), else the model.
        self.forward = compile_model(model) if cfg.compile else model
        self.opt = build_inner_optimizer(model, cfg, self.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.warmup_steps, cfg.steps))
        self.sync = OuterSync(model, self.opt, comm, cfg.outer, seed=cfg.seed)
        self.sync.ends_at(cfg.steps)
        self._loss: torch.Tensor | float = float("nan")
        self.slowdown = cfg.slowdown(comm.rank)  # --slow-worker: an emulated straggler
        self._step_real = 0.0  # real compute of the current step so far (fixed step time on a real clock)

    @property
    def last_loss(self) -> float:
        """The loss of the last inner step (read back from the device on first use)."""
        if isinstance(self._loss, torch.Tensor):
            self._loss = float(self._loss)
        return self._loss

    @last_loss.setter
    def last_loss(self, value: float) -> None:
        self._loss = value

    def autocast(self) -> Any:
        """The context of this worker's forward passes (bf16 autocast, or nothing for fp32)."""
        return autocast(self.device, self.precision)

    def _compute(self, seconds: float, share: float) -> None:
        fixed = self.cfg.sim_step_time
        if fixed is not None and not self.comm.simulated_clock:
            self._pace(seconds, share, fixed * self.slowdown)
            return
        t = fixed * share if fixed is not None else seconds
        if self.slowdown != 1.0:  # a straggler: really sleep on a real clock, add time on a simulated one
            if not self.comm.simulated_clock:
                time.sleep((self.slowdown - 1.0) * seconds)
            t *= self.slowdown
        self.comm.add_compute(t)

    def _pace(self, seconds: float, share: float, step_s: float) -> None:
        """An emulated accelerator on a real clock: the step's real compute (``share`` 1.0 for forward/backward,
        0.0 for the optimizer step) is padded with a sleep to ``step_s``, so workers sharing cores keep pace as
        equal accelerators would; a step whose compute alone exceeds it counts in ``stats.slow_steps``."""
        self._step_real += seconds
        if share != 0.0:  # the forward/backward half: the optimizer step comes next
            return
        real, self._step_real = self._step_real, 0.0
        if real > step_s:
            if not self.comm.stats.slow_steps:  # once: the count is summary.json's slow_steps
                print(f"eagerloco: warning: worker {self.comm.rank}'s inner step took {real:.3g} s of real compute, "
                      f"more than the {step_s:.3g} s it emulates (--sim-step-time, over its --worker-speeds): such "
                      "steps run at this machine's speed, not the emulated one; raise --sim-step-time",
                      file=sys.stderr, flush=True)
            self.comm.stats.slow_steps += 1
        else:
            t0 = time.perf_counter()
            time.sleep(step_s - real)
            real += time.perf_counter() - t0
        self.comm.add_compute(real)

    def forward_backward(self) -> None:
        t0 = time.perf_counter()
        x, y = self.stream.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)  # no copy on the CPU
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            _, loss = self.forward(x, y)
        loss.backward()
        if self.inner_group is not None:
            self._average_inner_grads()
        self._loss = loss.detach()
        if self.device.type == "cpu":
            self._loss = float(self._loss)  # the CPU path as it always was: no tensor kept alive
        synchronize(self.device)
        self._compute(time.perf_counter() - t0, 1.0)

    def _average_inner_grads(self) -> None:
        # One flat all-reduce instead of DDP: the outer algorithm needs the bare module (its blocks)
        # and the lockstep loop already knows when gradients are ready.
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.inner_group)
        flat /= dist.get_world_size(self.inner_group)
        for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def state_dict(self) -> dict[str, Any]:
        comm = self.comm
        return {  # a sharded (FSDP) worker: this rank's shards
            "model": local_state(self.model.state_dict()),
            "opt": local_state(self.opt.state_dict()),
            "sched": self.sched.state_dict(),
            "sync": self.sync.state_dict(),
            "stream": self.stream.state_dict(),
            "stats": comm.stats.as_dict(),
            "clock": comm.clock() if comm.simulated_clock else None,
            "last_loss": self.last_loss,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; CheckpointError naming what differs when the state does not fit
        this run's model, optimizers or outer settings."""
        try:
            load_model_state(self.model, state["model"])
            self.opt.load_state_dict(state["opt"])
            shard_optimizer_state(self.opt)
            self.sched.load_state_dict(state["sched"])
            self.sync.load_state_dict(state["sync"])
            self.stream.load_state_dict(state["stream"])
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
            raise CheckpointError(
                f"--resume: worker {self.comm.rank}'s state in the checkpoint does not fit this run's settings "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}), although its meta.json says it "
                "does (edited?): remove that checkpoint to resume from an earlier one, or start afresh with --overwrite"
            ) from None
        for k, v in state["stats"].items():
            setattr(self.comm.stats, k, v)
        if state["clock"] is not None and self.comm.simulated_clock:
            self.comm.set_clock(state["clock"])
        self.last_loss = state["last_loss"]
        torch.set_rng_state(state["torch_rng"])

    def optimizer_step(self, schedule: bool = True) -> None:
        """The inner optimizer's step; schedule: and the learning rate's (one inner step per tick)."""
        t0 = time.perf_counter()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        if schedule:
            self.sched.step()
        synchronize(self.device)
        self._compute(time.perf_counter() - t0, 0.0)

    def finish_tick(self, steps: int) -> None:
        """The rest of this worker's ``steps`` inner steps of a tick (its first forward and backward done when
        steps > 0). The learning rate moves once a tick, so every worker is at the same point of its schedule."""
        if steps == 1:  # the run without adaptive steps, exactly
            self.optimizer_step()
            return
        for i in range(steps):
            if i:
                self.forward_backward()
            self.optimizer_step(schedule=False)
        with warnings.catch_warnings():  # a slow worker's first ticks may come before its first step: fine here
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.sched.step()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str = "fp32") -> float:
    """Mean loss over held-out batches, on the model's device and in the inner steps' precision."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for x, y in batches:
        with autocast(device, precision):
            _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / max(1, len(batches))


def build_model(cfg: TrainConfig, vocab_size: int) -> nn.Module:
    try:
        mcfg = model_config(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    torch.manual_seed(cfg.seed)
    return GPT(mcfg)


def model_flops(worker: Worker, cfg: TrainConfig) -> dict[str, Any]:
    """What MFU is computed from: the model's FLOPs per token and the device's peak, with the device,
    precision and compile setting they belong to."""
    model = worker.model
    shape = getattr(model, "cfg", None)
    n = sum(p.numel() for p in model.parameters())
    per_token = (flops_per_token(n, shape.n_layers, shape.d_model, cfg.seq_len) if shape is not None
                 else 6.0 * n)
    return {
        "device": device_name(worker.device),
        "device_type": worker.device.type,
        "precision": worker.precision,
        "compile": cfg.compile,
        "flops_per_token": per_token,
        "peak_tflops": peak_tflops(worker.device, worker.precision, cfg.peak_tflops),
    }


def prepare(cfg: TrainConfig) -> tuple[Any, Any, nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Corpus, tokenizer (trained on the training split when BPE), the initial model, eval batches."""
    corpus = load_corpus(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    tok = get_tokenizer(cfg.tokenizer, corpus, cfg.data_dir)
    base = build_model(cfg, tok.vocab_size)
    cfg.outer.validate(num_blocks=len(getattr(base, "blocks", [])))
    evb = eval_batches(corpus, tok, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    return corpus, tok, base, evb


def task_evals(cfg: TrainConfig, tok: Any) -> Callable[[nn.Module], dict[str, float]] | None:
    """Zero-shot accuracy on --eval-tasks of the final outer parameters, or None."""
    if not cfg.eval_task_list:
        return None

    def run(model: nn.Module) -> dict[str, float]:
        from eagerloco.evals import run_evals

        return run_evals(model, tok, cfg.eval_task_list, limit=cfg.eval_limit, seq_len=cfg.seq_len, seed=cfg.seed)

    return run
