"""The local launcher, ``eagerloco launch``: a multi-process run on this machine
(:mod:`~eagerloco.launch.command`), optionally behind a link shaped on this machine (the lab's
:mod:`~eagerloco.lab.kernel_link`: network namespaces and tbf uplinks, as root).

Kernel shaping is the launcher's alone: the processes it starts learn the rate from the environment
(:data:`eagerloco.environment.KERNEL_LINK_ENV`) and do the link arithmetic in :mod:`eagerloco.comm.link`.
"""

from eagerloco.launch.command import DEFAULT_GRACE_S, LinkShaping, add_parser, launch, run

__all__ = ["DEFAULT_GRACE_S", "LinkShaping", "add_parser", "launch", "run"]
