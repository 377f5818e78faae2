"""The local launcher, ``eagerloco launch``: a multi-process run on this machine, optionally behind a link the
kernel shapes (the lab's :mod:`~eagerloco.lab.kernel_link`; its processes learn the rate from the environment)."""

from eagerloco.launch.command import DEFAULT_GRACE_S, LinkShaping, add_parser, launch, run

__all__ = ["DEFAULT_GRACE_S", "LinkShaping", "add_parser", "launch", "run"]
