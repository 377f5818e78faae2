"""Bring your own loop: the outer algorithm as step hooks on the user's inner optimizer.

    with eagerloco.outer_loop(model, inner_optimizer, method="eager", inner_steps=50) as outer:
        for x, y in batches:                 # the loop stays as it was
            loss_fn(model(x), y).backward()
            inner_optimizer.step()           # + the outer algorithm, in the optimizer's hooks
            inner_optimizer.zero_grad()

A pre-step hook runs :meth:`OuterSync.before_inner_step` (the gradient mean of ``dp``; nothing for
the other methods) and a post-step hook :meth:`OuterSync.after_inner_step`, so the parameters are
bit for bit those of the explicit per-step calls. Where the workers are:

- ``outer_addr`` / ``worker_id`` / ``workers`` (or EAGERLOCO_OUTER_ADDR / EAGERLOCO_WORKER_ID /
  EAGERLOCO_WORKERS): every worker is its own job (its own torchrun WORLD, its own DDP or FSDP);
  the job's rank 0 joins an outer gloo group across the jobs through a TCPStore worker 0 hosts
  (:func:`eagerloco.comm.groups.join_outer_group`);
- else under torchrun (RANK and WORLD_SIZE, WORLD_SIZE > 1): one WORLD of M workers x R ranks,
  as ``eagerloco launch`` runs them;
- else one worker alone (M = 1): handy for debugging a script before launching it twice.

One module per concern: :mod:`.loop` (the hooks, :class:`OuterLoop`, :func:`outer_loop`),
:mod:`.workers` (joining the other workers, agreeing with them, the first weights, letting go),
:mod:`.settings` (the settings by name, torchft's names, the API's errors).
"""

from eagerloco.hooks.loop import STATE_VERSION, OuterLoop, outer_loop
from eagerloco.hooks.settings import (
    TORCHFT_NAMES,
    EagerWeighting,
    FragmentPattern,
    Method,
    OuterOptimizerName,
    api_message,
    exit_on_errors,
    innermost_optimizer,
    outer_config,
)
from eagerloco.hooks.workers import Workers

__all__ = ["STATE_VERSION", "TORCHFT_NAMES", "EagerWeighting", "FragmentPattern", "Method", "OuterLoop",
           "OuterOptimizerName", "Workers", "api_message", "exit_on_errors", "innermost_optimizer", "outer_config",
           "outer_loop"]
