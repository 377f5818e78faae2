"""The README's Python API example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(capsys) -> None:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the README lost its Python API example"
    exec(compile(code.group(1), str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    before = float(re.search(r"eval loss before ([0-9.]+)", out).group(1))
    after = float(re.search(r"eval loss after ([0-9.]+)", out).group(1))
    assert after < 0.5 * before, out  # the wrapped loop really trains
    sent = int(re.search(r"sent (\d+) B", out).group(1))
    assert sent > 0
