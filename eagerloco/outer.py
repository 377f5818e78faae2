"""The outer algorithm: one object (:class:`OuterSync`, which says how it works), one code path, for the whole
DiLoCo family."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from eagerloco.adaptive import AdaptiveSteps
from eagerloco.codecs import Codec, get_codec
from eagerloco.comm.base import Communicator, Handle, flatten
from eagerloco.config import OuterConfig
from eagerloco.error_feedback import ErrorFeedback
from eagerloco.errors import DivergedError
from eagerloco.fragments import assign_fragments, find_blocks, trainable_fragments
from eagerloco.fsdp import like_param, local_shard
from eagerloco.outer_optimizer import OuterOptimizerFactory, make_outer_optimizer
from eagerloco.outer_state import InFlight, check_state, load_in_flight, save_in_flight
from eagerloco.quorum import OwnWindows, quorum_rule
from eagerloco.schedule import apply_delay, fragment_offsets, fragments_due


@torch.no_grad()
def copy_fragments(dst: Sequence[Sequence[torch.Tensor]], src: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy every fragment's tensors of ``src`` into ``dst``'s, fragment by fragment."""
    for d, s in zip(dst, src, strict=True):
        for t, v in zip(d, s, strict=True):
            t.copy_(v)


class OuterSync:
    """Wraps a model and its inner optimizer with the configured outer algorithm.

    The method and its settings come from :class:`eagerloco.config.OuterConfig`; the update rules of dp,
    DiLoCo, Streaming, overlap, delayed and eager are docs/algorithms.md, sections 1-6, and quorum
    exchanges section 12. Each worker keeps its own outer copies and outer-optimizer state (eager makes
    them differ), and sees its peers only through a :class:`~eagerloco.comm.base.Communicator`.

    Per inner step a worker calls :meth:`before_inner_step` (after backward, before the inner optimizer
    step) and :meth:`after_inner_step`; each is two halves, launch and finish, so M workers in one process
    can run in lockstep. Frozen parameters are not exchanged; sharded ones (FSDP's DTensors) are handled
    through this rank's shards, since every outer operation is elementwise.

    ``outer_optimizer`` is a factory taking a list of FP32 tensors (default from the config); ``seed``
    seeds stochastic rounding, mixed with ``comm.rank``. Raises ConfigError on an invalid setting or
    fragments that do not fit the model's blocks.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        comm: Communicator,
        config: OuterConfig | None = None,
        *,
        blocks: Sequence[nn.Module] | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
        seed: int = 0,
    ) -> None:
        self.config = config or OuterConfig()
        cfg = self.config
        block_list = find_blocks(model) if blocks is None else list(blocks)
        cfg.validate(num_blocks=len(block_list))
        self.model, self.inner_optimizer, self.comm = model, inner_optimizer, comm
        self.codec = get_codec(cfg.codec, block_size=cfg.codec_block, stochastic=cfg.stochastic_rounding,
                               topk=cfg.topk, chunk=cfg.topk_chunk, shared=cfg.transport == "shared-support",
                               guided=cfg.support_guided)
        # On the parameters' device: the codecs draw their rounding noise where they encode.
        first = next(iter(model.parameters()), None)
        where = local_shard(first).device if first is not None else torch.device("cpu")
        self.generator = torch.Generator(device=where).manual_seed(seed * 1_000_003 + comm.rank)
        self.step = 0  # inner steps completed
        self.is_dp = cfg.method == "dp"
        self.eager_like = cfg.method in ("delayed", "eager")
        self.own_state = cfg.method == "eager"  # each worker's outer copies and state differ (its own share)
        self.in_flight: list[InFlight] = []
        #: Whether the workers agreed on this schedule (:meth:`_agreed`; None: not asked yet).
        self._agreement: bool | None = None
        self._grad_handle: Handle | None = None
        self._grad_params: list[nn.Parameter] = []
        #: Workers of unequal speed (--adaptive-steps): each worker's inner steps and weights; None: off.
        self.adaptive: AdaptiveSteps | None = None
        #: Quorum exchanges (--quorum below M): the rule every outer exchange is launched with, and where this
        #: worker's windows landed; None: every exchange waits for every worker.
        self.quorum = quorum_rule(cfg, comm)
        self.own_windows: OwnWindows | None = None
        #: What this worker's compressed exchanges have not sent yet (None: --error-feedback off, and dp).
        self.feedback: ErrorFeedback | None = None
        #: A guided shared support (--support-guided): each fragment's last landed mean, flat on the CPU, which every
        #: worker holds alike; None where none has landed yet, and no list without the setting.
        self.guides: list[torch.Tensor | None] | None = None
        #: The model's parameters by fragment, and the tensors the algorithm reads and writes for
        #: them: the parameters themselves, or this rank's shards of sharded ones (same storage).
        # dp: one fragment of every parameter. Else frozen parameters are not exchanged: no inner step moves them.
        frags = [list(model.named_parameters())] if self.is_dp else trainable_fragments(
            assign_fragments(model, cfg.fragments, cfg.fragment_pattern, block_list))
        self.fragment_names: list[list[str]] = [[n for n, _ in f] for f in frags]
        self.params: list[list[nn.Parameter]] = [[p for _, p in f] for f in frags]
        self.local: list[list[torch.Tensor]] = [[local_shard(p) for p in f] for f in self.params]
        self.outer: list[list[torch.Tensor]] = []
        self.outer_opts: list[torch.optim.Optimizer] = []
        if self.is_dp:
            return
        self.outer = [[p.detach().clone().to(torch.float32) for p in f] for f in self.local]
        factory = outer_optimizer or make_outer_optimizer(cfg)
        self.outer_opts = [factory(params) for params in self.outer]
        if cfg.error_feedback is not None:
            self.feedback = ErrorFeedback(self.outer, cfg.error_feedback)
        if cfg.support_guided:
            self.guides = [None] * len(self.outer)
        self.offsets = fragment_offsets(cfg.inner_steps, cfg.fragments)
        self.delay = apply_delay(cfg.method, cfg.inner_steps, cfg.overlap_steps, cfg.eager_rounds)
        if cfg.adaptive_steps:
            self.adaptive = AdaptiveSteps(cfg, comm)
        if self.quorum is not None:
            self.own_windows = OwnWindows(comm.rank, self.quorum, len(self.outer), self.feedback, cfg.inner_steps)

    def ends_at(self, step: int) -> None:
        """The run ends after inner step ``step``: under a quorum each fragment's last exchange waits for every live
        worker, so that no window is left unmerged (docs/algorithms.md, 12.4)."""
        if self.own_windows is not None:
            self.own_windows.end = step

    def restart_from_model(self) -> None:
        """Take the model's current parameters as the outer copies; only before the first inner step."""
        if self.step != 0 or self.in_flight:
            raise RuntimeError("restart_from_model() is for the start of a run, before the first inner step")
        if self.is_dp:  # no outer copies: the model is the state
            return
        copy_fragments(self.outer, self.local)

    @property
    def num_workers(self) -> int:
        """Workers present now (the communicator's count; elastic runs change it between rounds)."""
        return self.comm.num_workers

    def inner_steps_due(self) -> int:
        """Inner steps this worker takes before its next :meth:`after_inner_step`: 1, or under adaptive steps
        its share of the next tick of the round (0, 1 or more; see :class:`eagerloco.schedule.Rounds`)."""
        due = 1 if self.adaptive is None else self.adaptive.due()
        return due if self.own_windows is None else self.own_windows.due(due)

    # ------------------------------------------------------------------ data-parallel gradients
    def launch_grads(self) -> None:
        """dp: start averaging the gradients (call after backward); other methods: nothing."""
        if not self.is_dp:
            return
        t0 = time.perf_counter()
        self._grad_params = [p for p in self.params[0] if p.requires_grad]
        grads = [local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p))
                 for p in self._grad_params]
        self._refuse_non_finite(grads, "gradient")
        self._grad_handle = self.comm.allreduce_mean(grads, self.codec, self.generator, keep_own=False,
                                                     **self._agreed())
        self.comm.add_overhead(time.perf_counter() - t0)

    def finish_grads(self) -> None:
        """dp: write the mean gradient into .grad (call before the inner optimizer step)."""
        if self._grad_handle is None:
            return
        t0 = time.perf_counter()
        params = self._grad_params
        grads = [p.grad for p in params if p.grad is not None]
        if len(grads) == len(params):  # the mean lands in the gradients themselves: no allocation every step
            _, waited = self._wait(self._grad_handle, out=[local_shard(g) for g in grads])
        else:
            mean, waited = self._wait(self._grad_handle)
            with torch.no_grad():
                for p, g in zip(params, mean, strict=True):
                    p.grad = like_param(p, g.to(dtype=p.dtype, device=p.device))  # fresh tensors: no copy needed
        self._grad_handle = None
        self.comm.add_overhead(time.perf_counter() - t0 - waited)

    def before_inner_step(self) -> None:
        """One worker per process: :meth:`launch_grads` then :meth:`finish_grads`, after backward and before the
        inner optimizer's step(), every inner step. Raises PeerError or ScheduleMismatchError."""
        self.launch_grads()
        self.finish_grads()

    # ------------------------------------------------------------------ outer exchange
    def launch_outer(self) -> None:
        """Count the inner step just taken and launch the exchanges due at it (no waiting)."""
        self.step += 1
        if self.is_dp:
            return
        t0 = time.perf_counter()
        cfg, feedback, adaptive = self.config, self.feedback, self.adaptive
        # A quorum: the steps this tick ran (none while catching up); None: the schedule's.
        ran = None if self.own_windows is None else self.own_windows.tick(
            1 if adaptive is None else adaptive.due(), self.comm.stats.compute_s)
        if adaptive is not None:
            adaptive.tick(ran)
        for p in fragments_due(self.step, cfg.inner_steps, self.offsets):
            with torch.no_grad():
                delta = [o - l.detach().to(torch.float32) for o, l in zip(self.outer[p], self.local[p], strict=True)]
            sent = delta if feedback is None else feedback.add(p, delta)
            self._refuse_non_finite(sent, f"outer gradient{'' if feedback is None else ' with its error feedback'} "
                                          f"of fragment {p}")
            # Adaptive steps: M * w_m times the contribution, so the mean is the token-weighted sum_m w_m Delta_m.
            weight = None if adaptive is None else adaptive.weigh(p)
            window, scale = (None, 1.0 if weight is None else weight.scale) if self.own_windows is None else \
                self.own_windows.window(p, self.step, self.num_workers, weight)
            if scale != 1.0:
                sent = [t * scale for t in sent]
            # Only eager and error feedback read their own share back (handle.own); elsewhere the runtime may reuse it.
            launch = self._agreed() if window is None else {**self._agreed(), "window": window}
            handle = self.comm.allreduce_mean(sent, self._codec_for(p), self.generator,
                                              keep_own=self.own_state or feedback is not None, **launch)
            payload = None
            if feedback is not None and scale:  # the buffer loses what it sent (unweighted)
                payload = handle.own if scale == 1.0 else [o / scale for o in handle.own]
                feedback.sent(p, payload)
            if self.own_windows is not None:
                self.own_windows.launched(p, self.step, self.comm.clock(), payload)
            # Eager applies its own share now: what it sent (C_m, as the others decode it), so that every value
            # sent is applied once; the unsent rest stays in the error-feedback buffer, or is dropped without one.
            fresh = handle.own if self.own_state else None
            item = InFlight(p, handle, self.step, self.step + self.delay, fresh, self.comm.num_workers)
            if weight is not None:
                item.workers, item.others, item.window = weight.workers, weight.others, weight.window
            self.in_flight.append(item)
        self.comm.add_overhead(time.perf_counter() - t0)

    def finish_outer(self) -> None:
        """Wait for and apply the exchanges due at this step (outer step, then merge into the model).

        On PeerError nothing of the failed exchange is applied: the state stays that of the last exchange that
        landed, the exchange leaves ``in_flight``, and the run must restart from a checkpoint.
        """
        if self.is_dp:
            return
        t0 = time.perf_counter()
        waited = 0.0
        if self.eager_like:
            for p in fragments_due(self.step, self.config.inner_steps, self.offsets):
                waited += self._eager_update(p)
        else:
            for item in [x for x in self.in_flight if x.apply_step == self.step]:
                self.in_flight.remove(item)
                mean, w = self._land(item)
                waited += w
                self._outer_step(item.fragment, mean)
                self._merge(item.fragment)
        if self.adaptive is not None and self.step % self.config.inner_steps == 0:
            waited += self.adaptive.round_end(**self._agreed())
        self.comm.add_overhead(time.perf_counter() - t0 - waited)

    def after_inner_step(self) -> None:
        """One worker per process: :meth:`launch_outer` then :meth:`finish_outer`, after the inner optimizer's
        step(), every inner step. Raises PeerError or ScheduleMismatchError."""
        self.launch_outer()
        self.finish_outer()

    def _refuse_non_finite(self, tensors: list[torch.Tensor], what: str) -> None:
        """Nothing that is not finite reaches a codec or a peer: the run stops at once (docs/algorithms.md, 13)."""
        if tensors and not bool(torch.stack([t.isfinite().all() for t in tensors]).all()):
            raise DivergedError(what, self.step, self.comm.rank)

    def _agreed(self) -> dict[str, Any]:
        """Agree once with the other workers on everything that decides which exchanges launch when, so a runtime
        may skip its per-exchange check; returns the launch keywords (``agreed``, a non-default ``transport``)."""
        if self._agreement is None:
            cfg = self.config
            sizes = [sum(t.numel() for t in frag) for frag in self.local]
            describe = (f"method {cfg.method}, H {cfg.inner_steps}, {cfg.fragments} fragment(s) of "
                        f"{sizes} values ({cfg.fragment_pattern}), overlap {cfg.overlap_steps}, "
                        f"eager rounds {cfg.eager_rounds}, codec {self.codec.name}/{cfg.codec_block}, "
                        f"transport {cfg.transport}, error feedback {cfg.error_feedback}, adaptive steps "
                        f"{(cfg.worker_speeds or 'measured') if cfg.adaptive_steps else 'off'}, "
                        f"at step {self.step} of {self.num_workers} workers")
            if self.quorum is not None:  # only with one, so that a run without keeps its schedule's digest
                describe += f", {self.quorum}"
            if self.guides is not None:  # the same: workers that choose positions differently must not meet
                describe += f", support guided {cfg.support_guided}"
            self._agreement = self.comm.agree(describe.encode(), describe)
        launch = {} if self.config.transport == "allgather" else {"transport": self.config.transport}
        return {"agreed": True, **launch} if self._agreement else launch

    def _codec_for(self, p: int) -> Codec:
        """The codec of fragment p's exchange launched now (a guided shared support reads the fragment's last mean)."""
        return self.codec.for_step(self.step, None if self.guides is None else self.guides[p])

    def _eager_update(self, p: int) -> float:
        """Delayed / eager outer step of fragment p at one of its sync steps; returns seconds waited."""
        cfg = self.config
        fresh_item = next(x for x in self.in_flight if x.fragment == p and x.launch_step == self.step)
        m = float(fresh_item.workers)
        arrived = next((x for x in self.in_flight if x.fragment == p and x.apply_step == self.step), None)
        waited = 0.0
        mean: list[torch.Tensor] | None = None
        if arrived is not None:
            self.in_flight.remove(arrived)
            mean, waited = self._land(arrived)
        if cfg.method == "delayed":
            grad = mean
        else:
            fresh = fresh_item.fresh
            assert fresh is not None
            fresh_item.fresh = None  # only needed now; the quantized copy stays in handle.own
            grad = [f / m for f in fresh]
            if mean is not None and arrived is not None:
                # Replace last time's proxy (own share) by the others' part of the real average.
                grad = [g + d for g, d in zip(grad, self._others_share(mean, arrived), strict=True)]
        if grad is not None:
            self._outer_step(p, grad)
        self._merge(p)
        return waited

    def _others_share(self, mean: list[torch.Tensor], item: InFlight) -> list[torch.Tensor]:
        """Eager's correction: what the others added to an exchange's mean, with the M of its round
        (docs/algorithms.md, 6): nonlocal, the mean less its own share as sent; stale_average, (M-1)/M of the mean."""
        m = float(item.workers)
        if self.config.eager_weighting == "nonlocal":  # own: this worker's weighted contribution, M w_m Delta_m
            return [d - o / m for d, o in zip(mean, item.handle.own, strict=True)]
        others = (m - 1) / m if item.others is None else item.others
        return [d * others for d in mean]

    def _land(self, item: InFlight) -> tuple[list[torch.Tensor], float]:
        """An outer exchange's mean (:meth:`_wait`), and where this worker's windows landed in a quorum's."""
        mean, waited = self._wait(item.handle, window=item.window)
        if self.guides is not None:
            self.guides[item.fragment] = flatten(mean).cpu()
        if self.own_windows is not None:
            self.own_windows.landed(item.fragment, item.launch_step, item.handle.quorum, self.comm.stats,
                                    self.comm.clock())
        return mean, waited

    def _wait(self, handle: Handle, out: list[torch.Tensor] | None = None, window: list[int] | None = None
              ) -> tuple[list[torch.Tensor], float]:
        """The mean and the real seconds spent blocked (left out of overhead_s); under adaptive steps renormalised
        over the workers whose payloads it holds. On a simulated clock wait() moves the clock, so its real
        seconds are the mean's computation, counted as overhead.
        """
        t0 = time.perf_counter()
        mean = handle.wait() if out is None else handle.wait(out)
        if window is not None and handle.quorum is None:  # a quorum's mean is token-weighted already
            mean = AdaptiveSteps.settle(mean, window, handle.contributors)
        return mean, 0.0 if self.comm.simulated_clock else time.perf_counter() - t0

    def _outer_step(self, p: int, grad: list[torch.Tensor]) -> None:
        for o, g in zip(self.outer[p], grad, strict=True):
            o.grad = g
        self.outer_opts[p].step()
        for o in self.outer[p]:
            o.grad = None

    @torch.no_grad()
    def _merge(self, p: int) -> None:
        """local <- alpha * local + (1 - alpha) * outer, in place (alpha weights the local side)."""
        alpha = self.config.alpha
        for local, outer in zip(self.local[p], self.outer[p], strict=True):
            if alpha == 0.0:
                local.copy_(outer)
            elif alpha != 1.0:
                local.lerp_(outer.to(local.dtype), 1.0 - alpha)

    # ------------------------------------------------------------------ run end and evaluation
    def drain(self, apply: bool = False) -> None:
        """Wait on every exchange still in flight (end of a run). ``apply=True`` applies them, so every outer
        gradient of the run counts once; False leaves the parameters as the schedule has them."""
        t0 = time.perf_counter()
        waited = 0.0
        for item in list(self.in_flight):
            mean, w = self._land(item)
            waited += w
            if not apply:
                continue
            if self.own_state:
                mean = self._others_share(mean, item)
            self._outer_step(item.fragment, mean)
            self._merge(item.fragment)
        self.in_flight.clear()
        if self.own_windows is not None:
            self.own_windows.drain(self.comm.stats)
        if self.adaptive is not None:
            waited += self.adaptive.drain()
        self.comm.add_overhead(time.perf_counter() - t0 - waited)

    def launch_consensus(self) -> list[Handle]:
        """End of an eager run, first half: launch the mean of every fragment's outer parameters (other methods'
        are equal already and launch nothing). Call after :meth:`drain`."""
        if self.config.method != "eager":
            return []
        if self.in_flight:
            raise RuntimeError("launch_consensus() after drain(): exchanges are still in flight")
        handles = [self.comm.allreduce_mean(frag, get_codec("fp32"), keep_own=False) for frag in self.outer]
        self.comm.stats.num_syncs -= len(handles)  # the closing mean is no outer sync (metrics.OuterMetrics)
        return handles

    @torch.no_grad()
    def finish_consensus(self, handles: list[Handle]) -> None:
        """Second half: the outer parameters and the model become the workers' mean."""
        for frag_outer, frag_local, handle in zip(self.outer, self.local, handles, strict=False):
            mean, _ = self._wait(handle)
            for outer, local, m in zip(frag_outer, frag_local, mean, strict=True):
                outer.copy_(m)
                local.copy_(outer)

    def consensus(self) -> None:
        """Both halves, for a worker alone in its process (:meth:`launch_consensus`)."""
        self.finish_consensus(self.launch_consensus())

    def outer_parameters(self) -> list[torch.Tensor]:
        """The outer (global) parameters in model order (this rank's shards if sharded): what
        evaluation should use."""
        if self.is_dp:
            return [local_shard(p.detach()) for p in self.model.parameters()]
        by_id = {id(param): outer for fp, fo in zip(self.params, self.outer, strict=True)
                 for param, outer in zip(fp, fo, strict=True)}
        # A frozen parameter has no outer copy: it is the same in the outer and the local model.
        return [by_id[id(p)] if id(p) in by_id else local_shard(p.detach()) for p in self.model.parameters()]

    @contextmanager
    def outer_weights(self) -> Iterator[nn.Module]:
        """Temporarily load the outer parameters into the model (for evaluation)."""
        if self.is_dp:
            yield self.model
            return
        saved = [[t.detach().clone() for t in frag] for frag in self.local]
        copy_fragments(self.local, self.outer)
        try:
            yield self.model
        finally:
            copy_fragments(self.local, saved)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly. In-flight exchanges are resolved and replaced by ready handles in
        this run too, so the run that continues and the run that resumes apply the very same numbers."""
        in_flight = save_in_flight(self.in_flight, self.comm)
        return {"method": self.config.method, "step": self.step, "outer": [[t.clone() for t in f] for f in self.outer],
                "outer_opts": [opt.state_dict() for opt in self.outer_opts], "in_flight": in_flight,
                "generator": self.generator.get_state(),
                "error_feedback": None if self.feedback is None else self.feedback.state(),
                "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
                **({} if self.guides is None else {"support_guides": [None if g is None else g.clone()
                                                                      for g in self.guides]}),
                **({} if self.own_windows is None else {"own_windows": self.own_windows.state_dict(),
                                                        "quorum_held": self.comm.quorum_state()})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (model and inner optimizer are restored separately). Raises
        ValueError when the state lacks a part, is for another method or fragmenting, or differs in settings."""
        check_state(state, self.config.method, self.outer, {"error_feedback": self.feedback, "adaptive": self.adaptive})
        self.step = int(state["step"])
        copy_fragments(self.outer, state["outer"])
        for opt, s in zip(self.outer_opts, state["outer_opts"], strict=True):
            opt.load_state_dict(s)
        self.generator.set_state(state["generator"])
        if self.feedback is not None:
            self.feedback.load(state["error_feedback"])
        if self.adaptive is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        if self.guides is not None:
            self.guides = list(state["support_guides"])
        if self.own_windows is not None:
            self.own_windows.load_state_dict(state.get("own_windows", []))
            self.comm.load_quorum_state(state.get("quorum_held"))
        self.in_flight = load_in_flight(state["in_flight"], self.comm)


def before_inner_step_all(syncs: Sequence[OuterSync]) -> None:
    """:meth:`OuterSync.before_inner_step` for M workers of one in-process group, in lockstep: every worker
    launches before any waits (a worker waiting first would wait for a launch that never comes)."""
    for s in syncs:
        s.launch_grads()
    for s in syncs:
        s.finish_grads()


def after_inner_step_all(syncs: Sequence[OuterSync]) -> None:
    """:meth:`OuterSync.after_inner_step` for M workers of one in-process group, in lockstep (as
    :func:`before_inner_step_all`)."""
    for s in syncs:
        s.launch_outer()
    for s in syncs:
        s.finish_outer()
