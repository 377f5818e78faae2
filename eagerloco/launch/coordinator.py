"""``eagerloco coordinator --port P``: the store where the workers of a run meet, in a process no worker hosts.

It serves a TCPStore every worker is a client of, so no worker's death takes the meeting point, and keeps
nothing on disk: after a restart the workers set again what they keep there. Why a TCPStore:
docs/architecture.md, "The coordinator".
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import timedelta
from typing import Any


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Serve the store at host:port until ``stop`` is set."""
    import torch.distributed as dist  # here: `eagerloco --help` stays fast

    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except (RuntimeError, OSError) as e:  # DistNetworkError: the port is taken
        raise ValueError(f"the coordinator cannot listen at {host}:{port} ({str(e).splitlines()[0]}); another "
                         "program has the port: pick another --port") from None
    print(f"eagerloco: coordinator listening at {host}:{store.port}; start the workers with --outer-addr "
          f"HOST:{store.port}", flush=True)
    stop.wait()
    del store


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("coordinator", help="serve the store where the jobs of a run meet (--outer-addr)")
    p.add_argument("--port", type=int, required=True, help="the port the workers' --outer-addr names")
    p.add_argument("--host", default="0.0.0.0", help="the address to listen at (default: every interface)")
    return p


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.host, args.port, stop)
    return 0
