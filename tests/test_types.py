"""eagerloco's annotations are its types for a user's type checker: the wheel carries ``py.typed`` (PEP 561).

``make typecheck`` (run by ``make test``) checks the annotations themselves with ``mypy --strict``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.processes
def test_the_wheel_carries_py_typed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "eagerloco", src / "eagerloco", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("eagerloco-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "eagerloco/py.typed" in z.namelist()
