"""The King James Bible: the `bible` program of ``bible-kjv`` run over the data file of ``bible-kjv-text``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from eagerloco.data.cache import DataError
from eagerloco.data.store import Doc, stored, unzip_docs
from eagerloco.lab.corpora.debian import from_debs

KJV_PACKAGES = ("bible-kjv", "bible-kjv-text")
KJV_RANGE = "gen1:1-rev22:21"
KJV_NUM_BOOKS = 66
KJV_NUM_VERSES = 31102
KJV_OT_BOOKS = 39
_KJV_HEADER = re.compile(r"^(\S.*?) (\d+)$")
_KJV_VERSE = re.compile(r"^\s+(\d+) (.*)$")


def parse_kjv(text: str) -> list[tuple[str, list[list[str]]]]:
    """The pretty-printed output of `bible` as [(book, [chapter: [verse text]])]: a chapter starts with "Book N" after
    a blank line, a verse with its indented number; wrapped lines are joined back."""
    books: list[tuple[str, list[list[str]]]] = []
    after_blank = True
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            after_blank = True
            continue
        header = _KJV_HEADER.match(line) if after_blank else None
        verse = _KJV_VERSE.match(line)
        after_blank = False
        if header:
            book, chapter = header.group(1), int(header.group(2))
            if not books or books[-1][0] != book:
                books.append((book, []))
            if chapter != len(books[-1][1]) + 1:
                raise DataError(f"bible output line {lineno}: {book} chapter {chapter} out of order")
            books[-1][1].append([])
        elif not books or not books[-1][1]:
            raise DataError(f"bible output line {lineno}: text before the first chapter: {line[:80]!r}")
        elif verse:
            books[-1][1][-1].append(verse.group(2).strip())
        elif books[-1][1][-1]:
            books[-1][1][-1][-1] += " " + line.strip()
        else:
            raise DataError(f"bible output line {lineno}: text before the first verse: {line[:80]!r}")
    return books


def _kjv_docs(books: list[tuple[str, list[list[str]]]]) -> list[Doc]:
    """One document per book: a verse per line, a blank line between chapters, no numbers."""
    verses = sum(len(ch) for _, chapters in books for ch in chapters)
    if len(books) != KJV_NUM_BOOKS or verses != KJV_NUM_VERSES or books[0][0] != "Genesis":
        raise DataError(
            f"bible printed {len(books)} books and {verses} verses, expected {KJV_NUM_BOOKS} and {KJV_NUM_VERSES} "
            "starting with Genesis: the packages are not the expected KJV text"
        )
    return [
        Doc(book, "Old Testament" if i < KJV_OT_BOOKS else "New Testament",
             "\n\n".join("\n".join(ch) for ch in chapters) + "\n")
        for i, (book, chapters) in enumerate(books)
    ]


def _kjv_from_tree(tree: Path) -> list[Doc]:
    data = next(tree.rglob("bible.data"), None)
    binary = tree / "usr" / "bin" / "bible"
    if data is None or not binary.is_file():
        raise DataError(f"unpacked {', '.join(KJV_PACKAGES)} lack usr/bin/bible or bible.data")
    # -p takes space-separated directories: run inside the tree with a relative path so a cache
    # directory whose name has spaces still works.
    cmd = [str(binary), "-p", data.parent.relative_to(tree).as_posix(), KJV_RANGE]
    try:
        proc = subprocess.run(cmd, cwd=tree, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"running the unpacked `bible` program failed: {e}") from e
    if proc.returncode != 0 or not proc.stdout:
        err = proc.stderr.decode("utf-8", "replace").strip()[-800:]
        hint = " (it needs libreadline8: `apt-get install libreadline8`)" if "libreadline" in err else ""
        raise DataError(f"`bible -p {cmd[2]} {KJV_RANGE}` failed (exit {proc.returncode}){hint}: {err}")
    return _kjv_docs(parse_kjv(proc.stdout.decode("utf-8", errors="replace")))


def load_kjv(root: Path) -> tuple[list[str], list[str], list[str]]:
    """(names, texts, testaments) of the 66 books, one document per book, extracted from the Debian packages into
    <root>/kjv (with a verified manifest) when missing."""
    return unzip_docs(stored("kjv", root, lambda d: from_debs(d, KJV_PACKAGES, _kjv_from_tree)))
