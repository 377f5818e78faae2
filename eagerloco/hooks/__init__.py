"""Bring your own loop: the outer algorithm as step hooks on the user's inner optimizer (docs/guides/own-loop.md).

    with eagerloco.outer_loop(model, inner_optimizer, OuterConfig(method="eager", inner_steps=50)) as outer:
        for x, y in batches:                 # the loop stays as it was
            loss_fn(model(x), y).backward()
            inner_optimizer.step()           # + the outer algorithm, in the optimizer's hooks
            inner_optimizer.zero_grad()

The hooks call :meth:`OuterSync.before_inner_step` and :meth:`OuterSync.after_inner_step`, so the parameters
are bit for bit the explicit calls'. :mod:`.loop` holds the hooks, :mod:`.start` where the workers start,
:mod:`.settings` the API's errors.
"""

from eagerloco.hooks.loop import STATE_VERSION, OuterLoop, outer_loop
from eagerloco.hooks.settings import exit_on_errors, innermost_optimizer

__all__ = ["STATE_VERSION", "OuterLoop", "exit_on_errors", "innermost_optimizer", "outer_loop"]
