"""The shared workload of the peer benchmark: one model, one data recipe, one loop, for every variant.

Everything that is not the outer machinery lives here, so that the variants differ only in what
wraps the loop. The data is a fixed random Markov chain over bytes (4 successors per token, so
the best possible loss is ln 4 = 1.386): learnable, so "does it train" is a real check, and
generated before the timed loop, so data loading cannot dominate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from eagerloco.model import GPT, GPTConfig

VOCAB = 256
SEQ_LEN = 64
BATCH = 8
SUCCESSORS = 4  # distinct next tokens per token in the chain
BEST_LOSS = math.log(SUCCESSORS)
MODEL_SEED = 1234  # every replica starts from the same weights (init_sync is not needed)
CHAIN_SEED = 99  # the chain is shared; each replica draws its own sequences from it
EVAL_SEED = 7_777
EVAL_SEQUENCES = 32
INNER_LR = 3e-3
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
EAGER_OUTER_LR = 0.4  # the eager paper's tuned outer lr; 0.7 overshoots here (see worker.run_ours)
WARMUP_PASSES = 2  # forward/backward without a step before timing: first-call allocations


def model_config() -> GPTConfig:
    """A 4-block GPT of 935,040 parameters (about the 0.93M of the reference measurement)."""
    return GPTConfig(vocab_size=VOCAB, d_model=128, n_layers=4, n_heads=4, d_mlp=624, max_seq_len=SEQ_LEN)


def build_model() -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(model_config())


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR)


def outer_sgd(params: list[torch.Tensor] | object) -> torch.optim.Optimizer:
    """SGD lr 0.7, momentum 0.9, Nesterov: the DiLoCo papers' outer optimizer, for both libraries."""
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)  # type: ignore[arg-type]


def fragment_modules(model: GPT, fragments: int) -> list[nn.Module]:
    """Modules covering the model, split like eagerloco's strided fragments.

    Fragment p holds blocks p, p+P, ...; fragment 0 also holds the embedding (tied with the head)
    and the final norm. This is the partition eagerloco's ``assign_fragments`` makes, given to
    torchft as modules so both libraries synchronize the same parameters at each sync.
    """
    out: list[nn.Module] = []
    for p in range(fragments):
        mods: list[nn.Module] = [model.blocks[b] for b in range(p, len(model.blocks), fragments)]
        if p == 0:
            mods = [model.tok_emb, model.norm, *mods]
        out.append(nn.ModuleList(mods))
    return out


def _chain() -> torch.Tensor:
    g = torch.Generator().manual_seed(CHAIN_SEED)
    return torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=g)


def sequences(n: int, seed: int) -> torch.Tensor:
    """n token sequences of SEQ_LEN + 1 from the chain (inputs are [:-1], targets [1:])."""
    succ = _chain()
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, SEQ_LEN + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ_LEN):
        pick = torch.randint(0, SUCCESSORS, (n,), generator=g)
        out[:, t + 1] = succ[out[:, t], pick]
    return out


def train_batches(steps: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's batches for the whole run, built before timing starts."""
    seqs = sequences(steps * BATCH, seed=1000 + replica).view(steps, BATCH, SEQ_LEN + 1)
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs]


@torch.no_grad()
def eval_loss(model: GPT) -> float:
    seqs = sequences(EVAL_SEQUENCES, seed=EVAL_SEED)
    _, loss = model(seqs[:, :-1], seqs[:, 1:])
    assert loss is not None
    return float(loss)


@dataclass
class LoopResult:
    """What the timed loop measured on one replica."""

    wall_s: float
    cpu_s: float  # CPU seconds of the whole process (every thread) during the loop
    hook_s: float  # seconds inside the caller's before/after/finish callables (outer machinery)
    losses: list[float] = field(default_factory=list)
    #: Per inner step, the increase of each of the caller's counters (the final finish counts in
    #: the last step); lets the launcher line the replicas' syncs up step by step. "step_s": each
    #: step's wall time, hooks included.
    per_step: dict[str, list[float]] = field(default_factory=dict)


def warm_up(model: GPT, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Forward and backward without a step: the model is unchanged, one-time costs are paid."""
    for _ in range(WARMUP_PASSES):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*batch)
        assert loss is not None
        loss.backward()
    opt.zero_grad(set_to_none=True)


def run_loop(
    model: GPT,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
    finish: Callable[[], None] | None = None,
    counters: dict[str, Callable[[], float]] | None = None,
) -> LoopResult:
    """The inner loop every variant runs; before/after wrap the inner optimizer step.

    before runs after backward and before opt.step(); after runs after opt.step(); finish runs
    once after the last step (waiting on what is still in flight). Their time is summed in
    hook_s and recorded per step as "hook". torchft's work happens inside opt.step() (optimizer
    hooks), so the caller times it and passes cumulative counters, recorded per step by name.
    """
    counters = dict(counters or {})
    hook = [0.0]
    counters["hook"] = lambda: hook[0]
    last = {k: c() for k, c in counters.items()}
    per_step: dict[str, list[float]] = {k: [] for k in counters}

    def timed(fn: Callable[[], None] | None) -> None:
        if fn is not None:
            t0 = time.perf_counter()
            fn()
            hook[0] += time.perf_counter() - t0

    def record() -> None:
        for k, c in counters.items():
            now = c()
            per_step[k].append(now - last[k])
            last[k] = now

    losses: list[float] = []
    step_s: list[float] = []
    c_start, t_start = time.process_time(), time.perf_counter()
    t_step = t_start
    for i, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        assert loss is not None
        loss.backward()
        timed(before)
        opt.step()
        timed(after)
        if i == len(batches) - 1:
            timed(finish)
        record()
        losses.append(loss.item())
        now = time.perf_counter()
        step_s.append(now - t_step)
        t_step = now
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    per_step["step_s"] = step_s
    return LoopResult(wall, cpu, hook[0], losses, per_step)
