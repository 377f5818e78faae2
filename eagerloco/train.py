"""The training loop: M workers, each a model replica with its inner AdamW and data stream.

One loop serves every runtime: it drives the list of workers that live in this process in
lockstep (all M in-process, or the single worker of a torch.distributed rank), so the algorithm,
data and accounting are the same whichever transport carries the exchange.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagerloco.comm.base import Communicator
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.config import ConfigError, LinkConfig, OuterConfig
from eagerloco.fsdp import load_model_state, local_state, shard_optimizer_state
from eagerloco.outer import OuterSync, after_inner_step_all, before_inner_step_all

SUMMARY_KEYS = (
    "method", "workers", "inner_steps", "fragments", "overlap_steps", "alpha", "eager_rounds", "codec",
    "steps", "tokens", "final_eval_loss", "bytes_sent_per_worker", "peak_sync_bytes", "compute_s",
    "blocked_s", "wall_s", "compute_utilization",
)


@dataclass
class TrainConfig:
    """Everything a training run needs; validated before the first step."""

    model: str = "tiny"
    data: str = "brown"
    data_dir: str | None = None
    tokenizer: str = "byte"
    iid: bool = True
    eval_tasks: str = ""
    eval_limit: int = 200
    tensorboard: bool = False
    batch_size: int = 8
    seq_len: int = 128
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    eval_every: int = 0
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 0
    workers: int = 2
    out: str = "runs/latest"
    sim_step_time: float | None = None
    progress: bool = True
    tokens: int | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    elastic: bool = False  # multi-process: survivors of a dead worker go on (see eagerloco.faults)
    rejoin: bool = False  # this process comes back into a running elastic run
    slow_workers: list[str] = field(default_factory=list)  # "ID:FACTOR": emulated stragglers
    outer: OuterConfig = field(default_factory=OuterConfig)
    link: LinkConfig = field(default_factory=LinkConfig)

    def validate(self) -> TrainConfig:
        for name in ("batch_size", "seq_len", "steps", "workers", "eval_batches", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
                raise ConfigError(f"--tokens must be a positive integer token budget, got {self.tokens!r}")
            per_step = self.batch_size * self.seq_len * self.workers
            self.steps = -(-self.tokens // per_step)
        for name in ("warmup_steps", "eval_every", "seed", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
        for name in ("lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (name == "lr" and v == 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0 (lr > 0), got {v!r}")
        if self.sim_step_time is not None and not (math.isfinite(self.sim_step_time) and self.sim_step_time > 0):
            raise ConfigError(f"--sim-step-time must be a positive number of seconds, got {self.sim_step_time}")
        from eagerloco.model import model_config

        try:
            model_config(self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if not re.fullmatch(r"byte|bpe(:\d+)?", self.tokenizer):
            raise ConfigError(f"--tokenizer must be byte, bpe or bpe:<vocab size>, got {self.tokenizer!r}")
        from eagerloco.evals import TASKS

        unknown = [t for t in self.eval_task_list if t not in TASKS]
        if unknown:
            raise ConfigError(f"--eval-tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if isinstance(self.eval_limit, bool) or not isinstance(self.eval_limit, int) or self.eval_limit < 1:
            raise ConfigError(f"--eval-limit must be an integer >= 1, got {self.eval_limit!r}")
        self.outer.validate()
        self.link.validate()
        from eagerloco.faults import validate_faults

        validate_faults(self)
        return self


    @property
    def eval_task_list(self) -> list[str]:
        return [t.strip() for t in self.eval_tasks.split(",") if t.strip()]


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class Worker:
    """One replica: model, inner optimizer with its schedule, outer algorithm, data stream."""

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
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg.warmup_steps, cfg.steps))
        self.sync = OuterSync(model, self.opt, comm, cfg.outer, seed=cfg.seed)
        self.last_loss = float("nan")
        from eagerloco.faults import slowdown_for

        self.slowdown = slowdown_for(cfg, comm.rank)  # --slow-worker: an emulated straggler
        self._step_real = 0.0  # real compute of the current step so far (fixed step time on a real clock)

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
        """A fixed step time on a real clock: an emulated accelerator that takes step_s per inner step.

        The step's real compute (forward/backward, then the optimizer step; share 1.0 and 0.0) is
        padded with a sleep to step_s, so that workers sharing a few cores run in step as equal
        accelerators would instead of drifting apart with the scheduler. Time waiting on an
        exchange between the two parts is not part of the step. A step whose real compute alone
        exceeds step_s keeps its real length and is counted in ``stats.slow_steps``.
        """
        self._step_real += seconds
        if share != 0.0:  # the forward/backward half: the optimizer step comes next
            return
        real, self._step_real = self._step_real, 0.0
        if real > step_s:
            self.comm.stats.slow_steps += 1
        else:
            t0 = time.perf_counter()
            time.sleep(step_s - real)
            real += time.perf_counter() - t0
        self.comm.add_compute(real)

    def forward_backward(self) -> None:
        t0 = time.perf_counter()
        x, y = self.stream.next_batch()
        self.opt.zero_grad(set_to_none=True)
        _, loss = self.model(x, y)
        loss.backward()
        if self.inner_group is not None:
            self._average_inner_grads()
        self.last_loss = float(loss.detach())
        self._compute(time.perf_counter() - t0, 1.0)

    def _average_inner_grads(self) -> None:
        # One flat all-reduce instead of DDP: the outer algorithm needs the bare module (its blocks)
        # and the lockstep loop already knows when gradients are ready.
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.inner_group)
        flat /= dist.get_world_size(self.inner_group)
        i = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[i : i + n].view_as(p.grad))
            i += n

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
        load_model_state(self.model, state["model"])
        self.opt.load_state_dict(state["opt"])
        shard_optimizer_state(self.opt)
        self.sched.load_state_dict(state["sched"])
        self.sync.load_state_dict(state["sync"])
        self.stream.load_state_dict(state["stream"])
        for k, v in state["stats"].items():
            setattr(self.comm.stats, k, v)
        if state["clock"] is not None and self.comm.simulated_clock:
            self.comm.set_clock(state["clock"])
        self.last_loss = state["last_loss"]
        torch.set_rng_state(state["torch_rng"])

    def optimizer_step(self) -> None:
        t0 = time.perf_counter()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self._compute(time.perf_counter() - t0, 0.0)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        total += float(loss)
    model.train(was_training)
    return total / max(1, len(batches))


def build_model(cfg: TrainConfig, vocab_size: int) -> nn.Module:
    from eagerloco.model import GPT, model_config

    try:
        mcfg = model_config(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    torch.manual_seed(cfg.seed)
    return GPT(mcfg)


def run_training(
    cfg: TrainConfig,
    workers: list[Worker],
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]],
    num_workers: int,
    log: Callable[[dict[str, Any]], None],
    show_progress: bool,
    start_step: int = 0,
    checkpoint: Callable[[int], None] | None = None,
    real_elapsed: float = 0.0,
    evaluate_on: bool | Callable[[], bool] = True,
    on_step: Callable[[int], None] | None = None,
    final_evals: Callable[[nn.Module], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Drive the local workers from start_step to cfg.steps inner steps; returns the summary.

    checkpoint(step) is called every cfg.checkpoint_every steps (after the step is complete).
    evaluate_on: whether this process evaluates (a callable: asked each time, as the evaluating
    worker of an elastic run can change). on_step(step): called once each inner step is complete,
    before evaluation, logging and checkpointing (elastic membership changes, fault injection).
    """
    evaluating = evaluate_on if callable(evaluate_on) else (lambda: bool(evaluate_on))
    syncs = [w.sync for w in workers]
    tokens_per_step = cfg.batch_size * cfg.seq_len * num_workers
    bar = None
    if show_progress:
        from tqdm import tqdm

        # disable=None: a bar on a terminal, nothing in a pipe (the metrics lines say enough there).
        bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.outer.method, unit="step",
                   dynamic_ncols=True, leave=False, disable=None)
    real_t0 = time.perf_counter() - real_elapsed
    eval_loss = float("nan")
    for step in range(start_step + 1, cfg.steps + 1):
        for w in workers:
            w.forward_backward()
        before_inner_step_all(syncs)
        for w in workers:
            w.optimizer_step()
        after_inner_step_all(syncs)
        if on_step is not None:
            on_step(step)
        do_eval = evaluating() and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps
        if do_eval:
            with syncs[0].outer_weights() as m:
                eval_loss = evaluate(m, eval_batches)
        if step % cfg.log_every == 0 or step == cfg.steps or do_eval:
            st = workers[0].comm.stats
            clock = workers[0].comm.clock() if workers[0].comm.simulated_clock else time.perf_counter() - real_t0
            rec: dict[str, Any] = {
                "step": step,
                "tokens": step * tokens_per_step,
                "loss": sum(w.last_loss for w in workers) / len(workers),
                "lr": workers[0].sched.get_last_lr()[0],
                "bytes_sent": st.bytes_sent,
                "blocked_s": st.blocked_s,
                "compute_s": st.compute_s,
                "wall_s": clock,
                "compute_utilization": st.compute_s / clock if clock > 0 else 1.0,
            }
            if do_eval:
                rec["eval_loss"] = eval_loss
            log(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", sent=_human(st.bytes_sent), blocked=f"{st.blocked_s:.2f}s")
        if bar is not None:
            bar.update(1)
        if checkpoint is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoint(step)
    # Training is over: what is still in flight is waited on (every handle is), but that wait is
    # shutdown, not training, so it goes to drain_s and does not count against utilization.
    real_wall = time.perf_counter() - real_t0
    clocks = [w.comm.clock() for w in workers]
    blocked = [w.comm.stats.blocked_s for w in workers]
    for s in syncs:
        s.drain()
    for w, c, b in zip(workers, clocks, blocked, strict=True):
        w.comm.stats.drain_s += w.comm.stats.blocked_s - b
        w.comm.stats.blocked_s = b
        w.comm.set_clock(c)
    if bar is not None:
        bar.close()
    final_eval = float("nan")
    extra: dict[str, float] = {}
    if evaluating():
        with syncs[0].outer_weights() as m:
            final_eval = evaluate(m, eval_batches)
            if final_evals is not None:
                extra = final_evals(m)
    stats = [w.comm.stats for w in workers]
    walls = [w.comm.clock() if w.comm.simulated_clock else real_wall for w in workers]
    n = len(workers)
    compute = sum(s.compute_s for s in stats)
    summary: dict[str, Any] = {
        "method": cfg.outer.method,
        "workers": num_workers,
        "inner_steps": cfg.outer.inner_steps,
        "fragments": cfg.outer.fragments,
        "overlap_steps": cfg.outer.overlap_steps,
        "alpha": cfg.outer.alpha,
        "eager_rounds": cfg.outer.eager_rounds,
        "eager_weighting": cfg.outer.eager_weighting,
        "codec": cfg.outer.codec,
        "steps": cfg.steps,
        "tokens": cfg.steps * tokens_per_step,
        "final_eval_loss": final_eval,
        "final_train_loss": sum(w.last_loss for w in workers) / n,
        "bytes_sent_per_worker": sum(s.bytes_sent for s in stats) / n,
        "bytes_received_per_worker": sum(s.bytes_received for s in stats) / n,
        "peak_sync_bytes": max(s.peak_sync_bytes for s in stats),
        "syncs_per_worker": sum(s.num_syncs for s in stats) / n,
        "compute_s": compute / n,
        "overhead_s": sum(s.overhead_s for s in stats) / n,
        "blocked_s": sum(s.blocked_s for s in stats) / n,
        "drain_s": sum(s.drain_s for s in stats) / n,
        "wall_s": max(walls),
        "compute_utilization": compute / sum(walls) if sum(walls) > 0 else 1.0,
        "real_wall_s": real_wall,
        "bandwidth_gbps": cfg.link.bandwidth_gbps,
        "latency_ms": cfg.link.latency_ms,
        "per_worker": [s.as_dict() for s in stats],
        **extra,
    }
    return summary


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}PB"


def finite_json(obj: Any) -> Any:
    """JSON has no inf/nan: write them as strings ("inf") so every reader can parse the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(finite_json(obj), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def tensorboard_writer(cfg: TrainConfig, out: Path) -> Any:
    """A TensorBoard writer under <out>/tensorboard when --tensorboard is set (metrics.jsonl is always written)."""
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'eagerloco[tensorboard]'") from e
    return SummaryWriter(str(out / "tensorboard"))


def prepare(cfg: TrainConfig) -> tuple[Any, Any, nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Corpus, tokenizer (trained on the training split when BPE), the initial model, eval batches."""
    from eagerloco.data import eval_batches, get_tokenizer, load_corpus

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


#: Settings that may change between a run and its resumption without changing its numbers.
_RESUMABLE_CHANGES = {"progress", "resume", "out", "checkpoint_every", "keep_checkpoints", "eval_every", "log_every",
                      "elastic", "rejoin", "slow_workers", "eval_tasks", "eval_limit", "tensorboard"}


def _check_resume_config(saved: dict[str, Any], cfg: TrainConfig) -> None:
    now = finite_json(asdict(cfg))
    diffs = sorted(k for k in set(saved) | set(now) if k not in _RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if diffs:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diffs)
        raise ConfigError(
            f"--resume: the checkpoint was made with different settings ({detail}); "
            "rerun with the original settings or start a fresh run in another --out directory"
        )


def resume_checkpoint(cfg: TrainConfig) -> tuple[Path, dict[str, Any]] | None:
    """With --resume, the newest valid checkpoint of this run (its settings checked); else None."""
    from eagerloco import checkpoint as ckpt

    if not cfg.resume:
        return None
    root = ckpt.checkpoint_root(Path(cfg.out))
    found = ckpt.latest_valid(root)
    if found is None:
        raise ConfigError(f"--resume: no checkpoint under {root}; run without --resume to start fresh")
    _check_resume_config(found[1]["config"], cfg)
    return found


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train M in-process workers on the configured text; writes metrics.jsonl and summary.json.

    With cfg.checkpoint_every, checkpoints go to <out>/checkpoints; cfg.resume continues from the
    newest valid one, giving the same numbers as a run that was never interrupted.
    """
    from eagerloco import checkpoint as ckpt
    from eagerloco.data import worker_streams

    cfg.validate()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    root = ckpt.checkpoint_root(out)
    found = resume_checkpoint(cfg)
    corpus, tok, base, evb = prepare(cfg)
    streams = worker_streams(corpus, tok, cfg.workers, cfg.batch_size, cfg.seq_len, cfg.seed, iid=cfg.iid)
    group = InProcessGroup(cfg.workers, cfg.link, seed=cfg.seed, count_overhead=cfg.sim_step_time is None)
    workers = [
        Worker(base if m == 0 else copy.deepcopy(base), group.communicator(m), streams[m], cfg)
        for m in range(cfg.workers)
    ]
    start_step, real_elapsed = 0, 0.0
    if found is not None:
        path, meta = found
        for m, w in enumerate(workers):
            w.load_state_dict(ckpt.load_worker_state(path, m))
        group.load_state_dict(meta["group"])
        start_step, real_elapsed = int(meta["step"]), float(meta.get("real_elapsed", 0.0))
        print(f"resuming from {path} (step {start_step} of {cfg.steps})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    kept = []
    if start_step and metrics_path.exists():  # drop lines logged after the checkpoint
        kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start_step]
    t_run = time.perf_counter()

    def save(step: int) -> None:
        states = {m: w.state_dict() for m, w in enumerate(workers)}
        meta = {"config": finite_json(asdict(cfg)), "group": group.state_dict(),
                "real_elapsed": real_elapsed + time.perf_counter() - t_run}
        ckpt.save(root, step, states, meta, keep=cfg.keep_checkpoints)

    tb = tensorboard_writer(cfg, out)
    with open(metrics_path, "w") as mf:
        for ln in kept:
            mf.write(ln + "\n")

        def log(rec: dict[str, Any]) -> None:
            mf.write(json.dumps(finite_json(rec)) + "\n")
            mf.flush()
            if tb is not None:
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)):
                        tb.add_scalar(k, v, rec["step"])

        summary = run_training(cfg, workers, evb, cfg.workers, log, cfg.progress, start_step, save, real_elapsed,
                               final_evals=task_evals(cfg, tok))
    if tb is not None:
        tb.close()
    summary["num_params"] = sum(p.numel() for p in base.parameters())
    summary["config"] = asdict(cfg)
    write_json_atomic(out / "summary.json", summary)
    return summary
