"""``eagerloco data fetch``: the lab's corpora (or hf: datasets) fetched into the cache and verified.

Apart from :mod:`eagerloco.lab.corpora`, which imports torch through the data layer: registering the command
must not, so that `eagerloco simulate` never loads it."""

from __future__ import annotations

import argparse
from typing import Any


def run(args: argparse.Namespace) -> int:
    """``eagerloco data fetch``: fetch each source of ``--data``, naming the directory of each."""
    from eagerloco.lab.corpora import fetch_source

    for path in fetch_source(args.data, args.data_dir):
        print(f"ready: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register the ``data`` subcommand; its handler is :func:`run`."""
    p = subparsers.add_parser("data", help="fetch and cache the default data (the Brown Corpus)")
    p.add_argument("action", choices=["fetch"], help="fetch: download once, verify the cache afterwards")
    p.add_argument("--data", default="brown", help="source(s): brown, kjv, austen, or a comma list (default brown)")
    p.add_argument("--data-dir", default=None, help="cache dir (default $EAGERLOCO_DATA_DIR or ~/.cache/eagerloco)")
    p.set_defaults(func=run)
