"""Human-readable quantities for tables, progress bars and plot labels (torch-free)."""

from __future__ import annotations

import math
from typing import Any

_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB")


def fmt_bytes(n: Any, spec: str = ".2f", sep: str = " ") -> str:
    """Decimal byte count, ``fmt_bytes(1.5e6) == "1.50 MB"`` (``spec`` formats the number, ``sep`` goes before the
    unit); ``n/a`` for anything but a finite number."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "n/a"
    for unit in _BYTE_UNITS:
        if abs(n) < 1000 or unit == _BYTE_UNITS[-1]:
            whole = unit == "B" and spec.endswith("f")
            return f"{n:{'.0f' if whole else spec}}{sep}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


__all__ = ["fmt_bytes"]
