"""What ``eagerloco launch --kernel-link-gbps`` tells the processes it starts: the rate at which the
kernel shapes their uplink (see :mod:`eagerloco.launch.kernel_link`). The launcher writes it, the
multi-process runtimes read it; the link arithmetic itself is in :mod:`eagerloco.comm.link`.
"""

from __future__ import annotations

import os

from eagerloco.config import ConfigError

#: Environment of every launched process in this mode: the uplink rate in Gbit/s (the runtime then
#: emulates only latency and jitter, and records the rate as the run's link bandwidth).
KERNEL_LINK_ENV = "EAGERLOCO_KERNEL_LINK_GBPS"


def kernel_link_from_env() -> float | None:
    """The uplink rate this process runs behind (Gbit/s), or None when the link is emulated."""
    raw = os.environ.get(KERNEL_LINK_ENV)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{KERNEL_LINK_ENV}={raw!r} is not a number of Gbit/s (it is set by eagerloco launch "
                          "--kernel-link-gbps; unset it)") from None
    return value


def link_shaping() -> str:
    """What the summary calls the bandwidth limit: the kernel's (``--kernel-link-gbps``) or emulated."""
    return "kernel" if kernel_link_from_env() is not None else "emulated"


__all__ = ["KERNEL_LINK_ENV", "kernel_link_from_env", "link_shaping"]
