"""Human-readable quantities and tables for reports, progress bars and plot labels (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Container
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


def text_table(head: list[str], body: list[list[str]], right: Container[int] | None = None) -> str:
    """Columns as wide as their widest cell under a rule; the columns in ``right`` (default: all but the first)
    right-aligned."""
    right = range(1, len(head)) if right is None else right
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = []
    for n, x in enumerate([head, *body]):
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(x, widths, strict=True))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
