"""How a metric value is shown in the console (shared by report.py and the tasks' console sections)."""
from __future__ import annotations

import math
from typing import Any


def fmt(value: Any) -> str:
    """``n/a`` for None/NaN, 4 decimals for floats, ``str`` otherwise."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
