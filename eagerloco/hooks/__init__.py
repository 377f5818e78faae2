"""Bring your own loop: the outer algorithm as step hooks on the user's inner optimizer.

    with eagerloco.outer_loop(model, inner_optimizer, OuterConfig(method="eager", inner_steps=50)) as outer:
        for x, y in batches:                 # the loop stays as it was
            loss_fn(model(x), y).backward()
            inner_optimizer.step()           # + the outer algorithm, in the optimizer's hooks
            inner_optimizer.zero_grad()

A pre-step hook runs :meth:`OuterSync.before_inner_step` (the gradient mean of ``dp``; nothing for
the other methods) and a post-step hook :meth:`OuterSync.after_inner_step`, so the parameters are
bit for bit those of the explicit per-step calls. Where the workers are is the connection's
(``peers=``, :func:`eagerloco.comm.connect.connect`): an outer rendezvous (each worker its own job), a
torchrun WORLD, or one worker alone.

One module per concern: :mod:`.loop` (the hooks, :class:`OuterLoop`, :func:`outer_loop`), :mod:`.start`
(where the workers start: what they compare, worker 0's weights), :mod:`.settings` (the API's errors).
"""

from eagerloco.hooks.loop import STATE_VERSION, OuterLoop, outer_loop
from eagerloco.hooks.settings import exit_on_errors, innermost_optimizer

__all__ = ["STATE_VERSION", "OuterLoop", "exit_on_errors", "innermost_optimizer", "outer_loop"]
