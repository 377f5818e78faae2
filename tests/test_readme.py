"""The README: short, the two commands first, its hook-API example the one that runs as two jobs
(examples/plain_loop.py, tests/test_hooks_jobs.py), every link leading somewhere, one method table with the site.

What the README held before moved into the site (docs/); tests/test_docs.py runs the examples there."""

from __future__ import annotations

import re
from pathlib import Path

from eagerloco.config import METHODS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def table_rows(text: str, header: str) -> list[str]:
    """The rows of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_is_short_and_says_what_it_is_first() -> None:
    lines = README.splitlines()
    assert len(lines) < 160
    assert "trains neural networks across workers joined by slow links" in " ".join(lines[:4])
    first_code = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    assert first_code.splitlines()[0].startswith("make demo") and first_code.splitlines()[1].startswith("make test")


def test_readme_hook_example_is_the_two_job_example() -> None:
    """The README's hook-API example is examples/plain_loop.py's loop, verbatim (that file runs as two jobs in
    the tests), and the README gives the two commands that run it."""
    example = (REPO / "examples" / "plain_loop.py").read_text()
    loop = re.search(r"# --8<-- \[start:loop\]\n(.*?)# --8<-- \[end:loop\]\n", example, re.S)
    assert loop is not None, "examples/plain_loop.py lost its loop section (the README and the site show it)"
    shown = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert shown == loop.group(1)
    assert len(shown.splitlines()) <= 20
    for worker in (0, 1):
        assert f"examples/plain_loop.py --outer-addr 127.0.0.1:29600 --worker-id {worker} --workers 2" in README


def test_readme_links_lead_to_files_and_the_quickstart_runs_two_jobs() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        assert (REPO / link).is_file(), link
    assert "docs/quickstart.md" in links
    quickstart = (REPO / "docs" / "quickstart.md").read_text()
    assert '--8<-- "examples/plain_loop.py"' in quickstart
    assert "--worker-id 0 --workers 2 &" in quickstart and "--worker-id 1 --workers 2" in quickstart


def test_readme_method_table_is_the_sites() -> None:
    header = "| method | what crosses the link |"
    assert table_rows(README, header) == table_rows((REPO / "docs" / "index.md").read_text(), header)
    methods = [re.match(r"\| `(\w+)", row).group(1) for row in table_rows(README, header)]
    assert set(methods) == set(METHODS)
