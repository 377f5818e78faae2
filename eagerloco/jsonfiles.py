"""JSON files every reader can parse, written atomically (torch-free)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eagerloco.atomic import atomic_write


def finite_json(obj: Any) -> Any:
    """JSON has no inf/nan: write them as strings ("inf") so every reader can parse the file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write obj as JSON to path atomically, through ``<name>.tmp`` (the name a run lists and removes after a crash)."""
    atomic_write(path, json.dumps(finite_json(obj), indent=2).encode(), temp=path.with_name(path.name + ".tmp"))
