"""Hugging Face datasets: streamed on first use (network and the `datasets` package), then cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagerloco.data.cache import DataError
from eagerloco.data.store import Doc, slug, stored, unzip_docs

HF_DEFAULT_DOCS = 2000


def parse_hf(spec: str) -> tuple[str, str | None, int]:
    """"hf:NAME[:CONFIG][@DOCS]" -> (NAME, CONFIG, DOCS)."""
    body = spec.removeprefix("hf:")
    n = HF_DEFAULT_DOCS
    if "@" in body:
        body, raw = body.rsplit("@", 1)
        if not raw.isdigit() or int(raw) < 2:
            raise DataError(f"--data {spec!r}: @DOCS must be an integer >= 2")
        n = int(raw)
    path, _, config = body.partition(":")
    if not path:
        raise DataError(f"--data {spec!r}: expected hf:NAME[:CONFIG][@DOCS], e.g. hf:allenai/c4:en@5000")
    return path, config or None, n


def hf_dir(root: Path, path: str, config: str | None, n: int) -> Path:
    """The cache directory of the first ``n`` documents of dataset ``path`` (``config``)."""
    return root / "hf" / f"{slug(path)}--{slug(config or 'default')}--{n}"


def hf_label(spec: str) -> str:
    """"hf:NAME[:CONFIG][@DOCS]" -> "hf:NAME[:CONFIG]": the source's name and its documents' group."""
    path, config, _ = parse_hf(spec)
    return f"hf:{path}" + (f":{config}" if config else "")


def _hf_text(row: dict[str, Any]) -> str:
    text = row.get("text")
    if isinstance(text, str):
        return text
    strings = [v for v in row.values() if isinstance(v, str)]
    return max(strings, key=len) if strings else ""


def load_hf(spec: str, root: Path) -> tuple[list[str], list[str], list[str]]:
    """The first DOCS non-empty documents of the dataset's train split ("text" field, else its longest string)."""
    path, config, n = parse_hf(spec)
    directory = hf_dir(root, path, config, n)
    label = hf_label(spec)

    def build(_: Path) -> tuple[list[Doc], dict[str, Any]]:
        try:
            import datasets
        except ImportError as e:
            raise DataError(
                f"--data {spec!r} needs the Hugging Face `datasets` package (pip install datasets) and network "
                "access to the Hub on first use; or pass a named corpus or your own .txt files"
            ) from e
        try:
            stream = datasets.load_dataset(path, config, split="train", streaming=True)
            docs: list[Doc] = []
            for row in stream:
                text = _hf_text(row)
                if text.strip():
                    docs.append(Doc(f"{len(docs):06d}", label, text))
                if len(docs) >= n:
                    break
        except Exception as e:  # network, unknown name, gated dataset: all end the same way
            raise DataError(f"--data {spec!r}: loading {path!r} from the Hugging Face Hub failed (network "
                            f"access is needed on first use): {type(e).__name__}: {e}") from e
        if len(docs) < 2:
            raise DataError(f"--data {spec!r}: the dataset gave {len(docs)} non-empty document(s), need >= 2")
        return docs, {"dataset": path, "config": config, "split": "train", "requested_docs": n}

    return unzip_docs(stored(directory.name, directory.parent, build))
