"""The errors every layer raises for bad input or bad numbers: a torch-free leaf, so that the lowest modules can
raise them."""

#: The exit status of a run that stopped because its numbers stopped being finite.
DIVERGED_EXIT_CODE = 5


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the allowed values."""


class DivergedError(ArithmeticError):
    """A run's numbers stopped being finite (a loss, or what an exchange would send): it stops there, before
    anything not finite reaches a codec, a peer or a checkpoint.

    Args:
        what: the numbers that are not finite (``"loss"``, ``"outer gradient of fragment 0"``).
        step: the inner step after which they were found.
        worker: the worker whose numbers they are.
    """

    def __init__(self, what: str, step: int, worker: int) -> None:
        super().__init__(f"worker {worker}'s {what} at step {step} is not finite (NaN or inf): the run diverged; "
                         "start it again with lower learning rates (--lr, --outer-lr) or a longer --warmup-steps")
        self.what, self.step, self.worker = what, step, worker
