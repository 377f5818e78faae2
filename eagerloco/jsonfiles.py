"""JSON files every reader can parse, written atomically (torch-free)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


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
    """Write obj as JSON to path through a temporary file and a rename: readers see old or new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(finite_json(obj), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written .tmp left behind
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["finite_json", "write_json_atomic"]
