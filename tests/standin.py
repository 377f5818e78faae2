"""The tests' own data cache and matplotlib folder, so that no test reads the home folder or the network.

The trainer's tests train on the default corpus (``--data brown``), which needs a corpus, not Brown's
words; fetching Brown needs npm and the network. :func:`session_folders` makes a folder for the session
holding a stand-in in the Brown cache's format (its manifest, 500 documents in Brown's 15 genres with
Brown's document names, their text generated from a seed) and points ``EAGERLOCO_DATA_DIR`` at it; the
tests of the fetch itself (tests/test_data.py, marked ``network``) fetch the real corpus into folders of
their own. Matplotlib's font cache is built there too, before any test runs (it runs ``fc-list``).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
from pathlib import Path

from eagerloco.data.store import Doc, stored

#: Brown's genres: the letter in its document names, the genre and its number of documents (500 in all).
GENRES = {"a": ("news", 44), "b": ("editorial", 27), "c": ("reviews", 17), "d": ("religion", 17),
          "e": ("hobbies", 36), "f": ("lore", 48), "g": ("belles_lettres", 75), "h": ("government", 30),
          "j": ("learned", 80), "k": ("fiction", 29), "l": ("mystery", 24), "m": ("science_fiction", 6),
          "n": ("adventure", 29), "p": ("romance", 29), "r": ("humor", 9)}
COMMON = ("the of and to a in that is was he for it with as his on be at by had not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out "
          "so said what up its about into than them can only other new some could time these two may then do").split()
TOPICS = ("city state county court board plan bill tax school church faith water river house garden engine "
          "market price company money game team season player music play book story poem language theory "
          "method result value system energy cell field report member office law war peace army ship night "
          "door window street road train letter voice face hand eye heart mind horse dog fire light").split()


def _document(rng: random.Random, topic: list[str]) -> str:
    paragraphs = []
    for _ in range(rng.randint(2, 4)):
        sentences = []
        for _ in range(rng.randint(3, 6)):
            words = [rng.choice(COMMON) if rng.random() < 0.6 else rng.choice(topic) for _ in range(rng.randint(5, 16))]
            if len(words) > 8 and rng.random() < 0.5:
                words[rng.randint(3, len(words) - 3)] += ","
            sentences.append(" ".join(words).capitalize() + ("." if rng.random() < 0.9 else rng.choice("?!")))
        paragraphs.append(" ".join(sentences))
    return "\n".join(paragraphs) + "\n"


def write_brown_standin(data_dir: Path) -> None:
    """Write the stand-in into ``data_dir/brown`` as the Brown loader stores the real corpus."""
    rng = random.Random(0)
    docs = []
    for letter, (genre, count) in GENRES.items():
        topic = rng.sample(TOPICS, 12)  # each genre talks about its own things
        docs += [Doc(f"c{letter}{i:02d}", genre, _document(rng, topic)) for i in range(1, count + 1)]
    stored("brown", data_dir, lambda _: (docs, {}))


def session_folders() -> None:
    """Make the session's folder (removed at exit) and point this process and every process it starts at it."""
    root = Path(tempfile.mkdtemp(prefix="eagerloco-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_brown_standin(root / "data")
    os.environ["EAGERLOCO_DATA_DIR"] = str(root / "data")
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")
    try:
        import matplotlib.font_manager  # noqa: F401 - builds the font cache now, not in the first test that plots
    except ImportError:  # pragma: no cover - without the plot extra no test plots
        pass
