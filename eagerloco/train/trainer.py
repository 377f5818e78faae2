"""The training loop, once, for every way of starting workers: ``Trainer(cfg, runtime).run()``.

Take the run directory, find the checkpoint to resume, build this process's workers (the runtime says
which), agree with the other processes (:mod:`.agree`), then per inner step: forward and backward ->
``OuterSync.before_inner_step`` -> inner step -> ``OuterSync.after_inner_step`` -> the runtime's
per-step work -> evaluate, log, checkpoint. At the end: drain, the final evaluation, the summary."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagerloco import checkpoint as ckpt
from eagerloco import events
from eagerloco.config import TrainConfig
from eagerloco.errors import DivergedError
from eagerloco.flops import mfu
from eagerloco.jsonfiles import write_json_atomic
from eagerloco.metrics import link_metrics
from eagerloco.outer import after_inner_step_all, before_inner_step_all
from eagerloco.schedule import short_run_note
from eagerloco.train.agree import agree_before_start
from eagerloco.train.outputs import ProgressLines, RunOutput, accounting, add_throughput
from eagerloco.train.resume import checkpoint_meta
from eagerloco.train.runtime import Runtime, num_params
from eagerloco.train.worker import Worker, evaluate, model_flops, prepare, task_evals


class Trainer:
    """One process's share of a run (``cfg`` validated): its workers, driven in lockstep to the summary."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime) -> None:
        self.cfg, self.runtime = cfg, runtime
        self.out = Path(cfg.out)
        self.files: dict[int, Worker] = {}  # this process's workers by checkpoint file id
        self.workers: list[Worker] = []
        self.eval_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.final_evals: Any = None
        self.start_step = 0
        self.real_elapsed = 0.0  # real seconds of the runs this one resumes
        self.t_run = 0.0
        self.perf: dict[str, Any] = {}  # what MFU is computed from (model_flops)

    def run(self) -> dict[str, Any] | None:
        """Train; returns the summary (also written to ``<out>/summary.json``) on the reporting process, None
        elsewhere. Raises ConfigError, PeerError (naming the worker) or CheckpointError."""
        cfg, rt = self.cfg, self.runtime
        torch.manual_seed(cfg.seed)
        with rt:
            found = rt.resume_point()
            corpus, tok, base, self.eval_batches = prepare(cfg)
            self.files = rt.build(corpus, tok, base)
            if not self.files:
                return None
            self.workers = list(self.files.values())
            self.final_evals = task_evals(cfg, tok)
            found = agree_before_start(rt, found, base)
            self.start_step, self.real_elapsed = rt.load(self.files, found)
            rt.ready(self.start_step, found)
            self.t_run = time.perf_counter()
            ours = self.loop()
            rt.doing = "gathering the results"
            ours.update(link_shaping=rt.link_shaping(), num_params=num_params(base), config=asdict(cfg))
            summary = rt.summarize(ours, self.files)
            if summary is not None:
                rt.manifest.record({"summary.json": "file", "summary.json.tmp": "file"})
                write_json_atomic(self.out / "summary.json", summary)
            return summary

    def loop(self) -> dict[str, Any]:
        """Inner steps from the start (or the resumed) step to ``cfg.steps``; returns this process's summary."""
        cfg, rt, workers = self.cfg, self.runtime, self.workers
        syncs = [w.sync for w in workers]
        self.perf = model_flops(workers[0], cfg)
        output = RunOutput(cfg, self.start_step, rt.reports, rt.manifest)
        short = None if cfg.outer.per_step else short_run_note(cfg.steps, cfg.outer.inner_steps)
        if short is not None and rt.reports():
            print(f"eagerloco: warning: {short}", flush=True)
        try:
            progress = (ProgressLines(cfg.outer.method, cfg.steps, self.start_step, log_every=cfg.log_every)
                        if cfg.progress and rt.reports() else None)
            real_t0 = time.perf_counter() - self.real_elapsed
            for step in range(self.start_step + 1, cfg.steps + 1):
                # One tick: an inner step of every worker, or under adaptive steps each worker's own (0 or more)
                due = [s.inner_steps_due() for s in syncs]
                for w, n in zip(workers, due, strict=True):
                    if n:
                        w.forward_backward()
                before_inner_step_all(syncs)
                for w, n in zip(workers, due, strict=True):
                    w.finish_tick(n)
                after_inner_step_all(syncs)
                rt.on_step(step)  # first: a membership change publishes the step a lost worker got to
                for w in workers:
                    events.inner_step_done(w.comm.rank, step)
                eval_point = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.steps
                eval_loss = self.evaluate(step)[0] if eval_point else None
                if step % cfg.log_every == 0 or step == cfg.steps or eval_loss is not None:
                    output.log(self.record(step, real_t0, eval_loss))
                    self.check_loss(step)
                if progress is not None:
                    progress.update(step, self.mean_loss, workers[0].comm.stats, self.tokens(step),
                                    self.perf["flops_per_token"], self.perf["peak_tflops"], rt.devices)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    self.save(step)
            real_wall = time.perf_counter() - real_t0
            self.drain()
            if progress is not None:
                progress.close()
        finally:
            output.close()
        final_eval, extra = self.evaluate(cfg.steps, final=True)
        return self.summary(float("nan") if final_eval is None else final_eval, real_wall, extra)

    def mean_loss(self) -> float:
        """The mean over this process's workers of their last inner step's loss."""
        return sum(w.last_loss for w in self.workers) / len(self.workers)

    def check_loss(self, step: int) -> None:
        """A loss that is not finite stops the run where it is found (at a log point or a checkpoint, where the
        loss is read back anyway): the checkpoints written before it stay, none is written after it."""
        for w in self.workers:
            if not math.isfinite(w.last_loss):
                raise DivergedError("loss", step, w.comm.rank)

    def evaluate(self, step: int, final: bool = False) -> tuple[float | None, dict[str, float]]:
        """The eval loss of the outer parameters at an evaluation point and, at the ``final`` one, the zero-shot
        scores (None, {} where another process evaluates); a final loss that is not finite stops the run."""
        loss, extra = None, {}
        if self.runtime.evaluates():
            with self.workers[0].sync.outer_weights() as m:
                loss = evaluate(m, self.eval_batches, self.workers[0].precision)
                if final and self.final_evals is not None:
                    extra = self.final_evals(m)
            events.evaluation_done(step)
            if final and not math.isfinite(loss):
                raise DivergedError("eval loss of the outer parameters", step, self.workers[0].comm.rank)
        self.runtime.after_eval(step)
        return loss, extra

    def record(self, step: int, real_t0: float, eval_loss: float | None) -> dict[str, Any]:
        """One metrics line: loss, link accounting, clock and throughput after ``step``."""
        workers = self.workers
        st, comm = workers[0].comm.stats, workers[0].comm
        clock = comm.clock() if comm.simulated_clock else time.perf_counter() - real_t0
        tokens = self.tokens(step)
        real = time.perf_counter() - real_t0
        rate = tokens / real if real > 0 else float("nan")
        rec: dict[str, Any] = {
            "step": step,
            "tokens": tokens,
            "loss": self.mean_loss(),
            "lr": workers[0].sched.get_last_lr()[0],
            **link_metrics(st, clock),
            "wall_s": clock,
            "tokens_per_s": rate,
        }
        run_mfu = mfu(rate, self.perf["flops_per_token"], self.perf["peak_tflops"], self.runtime.devices)
        if run_mfu is not None:
            rec["mfu"] = run_mfu
        if eval_loss is not None:
            rec["eval_loss"] = eval_loss
        if self.cfg.inner_optimizer == "muon":  # AdamW's lr is "lr" (the first group), Muon's the last group's
            rec["muon_lr"] = workers[0].sched.get_last_lr()[-1]
        rec.update(self.runtime.log_fields())
        rec.update(self.rounds())
        return rec

    def tokens(self, step: int) -> int:
        """Tokens all workers trained on by ``step``: under adaptive steps each worker's own inner steps count."""
        cfg, adaptive = self.cfg, self.workers[0].sync.adaptive
        steps = step * cfg.workers if adaptive is None else sum(adaptive.trained)
        return steps * cfg.batch_size * cfg.seq_len

    def rounds(self) -> dict[str, Any]:
        """Under adaptive steps: each worker's inner steps in the current round (H_m) and so far."""
        adaptive = self.workers[0].sync.adaptive
        if adaptive is None:
            return {}
        return {"round_steps": list(adaptive.rounds.lengths), "worker_steps": list(adaptive.rounds.done)}

    def drain(self) -> None:
        """Wait for what is still in flight. That wait is shutdown, not training: it goes to ``drain_s``
        and the clock stays where training ended, so it does not count against utilization."""
        clocks = [w.comm.clock() for w in self.workers]
        blocked = [w.comm.stats.blocked_s for w in self.workers]
        for w in self.workers:
            w.sync.drain()
        for w, c, b in zip(self.workers, clocks, blocked, strict=True):
            w.comm.stats.drain_s += w.comm.stats.blocked_s - b
            w.comm.stats.blocked_s = b
            w.comm.set_clock(c)

    def summary(self, final_eval: float, real_wall: float, extra: dict[str, float]) -> dict[str, Any]:
        """This process's summary: the settings that name the run, losses, link accounting, throughput."""
        cfg, workers = self.cfg, self.workers
        walls = [w.comm.clock() if w.comm.simulated_clock else real_wall for w in workers]
        acc = accounting([(w.comm.stats.as_dict(), wall) for w, wall in zip(workers, walls, strict=True)])
        per_worker = acc.pop("per_worker")
        oc = cfg.outer
        summary: dict[str, Any] = {
            "method": oc.method, "workers": cfg.workers, "inner_steps": oc.inner_steps, "fragments": oc.fragments,
            "overlap_steps": oc.overlap_steps, "alpha": oc.alpha, "eager_rounds": oc.eager_rounds,
            "eager_weighting": oc.eager_weighting, "codec": oc.codec, "steps": cfg.steps,
            "tokens": self.tokens(cfg.steps),
            "final_eval_loss": final_eval,
            "final_train_loss": self.mean_loss(),
            **acc,
            "real_wall_s": real_wall,
            "bandwidth_gbps": cfg.link.bandwidth_gbps, "latency_ms": cfg.link.latency_ms,
            "per_worker": per_worker,
            **self.perf,
            **self.rounds(),
            **extra,
        }
        add_throughput(summary, self.runtime.devices)
        return summary

    def save(self, step: int) -> None:
        """The one checkpoint protocol: every process writes its files into the staging directory, the publisher
        gets their entries (or a write error), writes meta.json last and renames the directory into place;
        every process learns the outcome (a failure raises CheckpointError everywhere)."""
        cfg, rt = self.cfg, self.runtime
        self.check_loss(step)
        rt.doing = f"the checkpoint of step {step}"
        root = ckpt.checkpoint_root(self.out)
        stage = ckpt.staging_dir(root, step)
        mine: dict[int, Any] = {}
        problem: str | None = None
        try:
            for i, w in self.files.items():
                mine[i] = ckpt.write_worker_state(stage, i, w.state_dict())
        except ckpt.CheckpointError as e:
            problem = str(e)
        entries, problem = rt.gather_checkpoint(step, mine, problem)
        if entries is not None and problem is None:
            meta = checkpoint_meta(cfg, self.real_elapsed + time.perf_counter() - self.t_run, **rt.checkpoint_meta())
            files = [entries[i] for i in sorted(entries)]
            try:
                final = ckpt.publish(root, step, files, meta, keep=cfg.keep_checkpoints)
                # Before the verdict: the next checkpoint's staging directory is listed before any process writes it.
                rt.manifest.record_checkpoint(final, [e["file"] for e in files], rt.next_checkpoint(step))
            except (ckpt.CheckpointError, OSError, ValueError) as e:
                problem = str(e)
        elif entries is not None:
            shutil.rmtree(stage, ignore_errors=True)
        rt.share_verdict(problem)
        rt.doing = "training"
