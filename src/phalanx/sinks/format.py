"""Numbers for people: significant digits, not a fixed count of decimals (a learning rate
of 2e-5 must not read ``0.0000``), and throughput as a whole number."""

from __future__ import annotations

import math


def fmt_number(value: float) -> str:
    """4 significant digits: ``0.5`` -> ``0.5000``, ``2e-05`` -> ``2.000e-05``, ``1234.5`` ->
    ``1234.5``... fixed-point from 1e-3 to 1e5, scientific outside; ``0`` -> ``0``."""
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e5:
        decimals = max(0, 3 - math.floor(math.log10(magnitude)))
        return f"{value:.{decimals}f}"
    return f"{value:.3e}"


def fmt_metric(key: str, value: float) -> str:
    """A metric's value: throughput (``samples_per_s``) as ``1,234``, the rest by
    :func:`fmt_number`."""
    if key.endswith("samples_per_s") and math.isfinite(value):
        return f"{value:,.0f}"
    return fmt_number(value)
