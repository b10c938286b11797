"""Numbers for people: significant digits, not a fixed count of decimals (a learning rate
of 2e-5 must not read ``0.0000``), and throughput as a whole number."""

from __future__ import annotations

import math
from collections.abc import Callable

from phalanx.balance import slower_than_peers


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


def fmt_share(share: float) -> str:
    """A share of the global batch in percent: ``0.42`` -> ``42%``; under 1% with one
    decimal (``0.4%``: every member keeps at least one sample, never ``0%``)."""
    return f"{100 * share:.0f}%" if share >= 0.01 or share <= 0 else f"{100 * share:.1f}%"


def balance_line(
    event: object, shares_too: bool = True, where: Callable[[int], str | None] | None = None
) -> str:
    """A :class:`~phalanx.events.Balanced` event in one line: the shares from the next step
    (in percent, rank order) and each member named slow with how much slower than the
    median of its peers' it is (:func:`~phalanx.balance.slower_than_peers`), and, with
    ``where`` (a rank -> ``"worker 2 on cpu:2"``), where it runs."""
    shares = list(getattr(event, "shares", []))
    paces = list(getattr(event, "paces", []))
    step = int(getattr(event, "global_step", 0))
    parts = []
    if shares_too and getattr(event, "changed", False):
        cut = "/".join(fmt_share(s).rstrip("%") for s in shares)
        parts.append(f"balance: shares {cut}% of each global batch (by rank) from step {step + 1}")
    for rank in getattr(event, "slow", []):
        ratio = slower_than_peers(paces, rank)
        times = f" ({ratio:.1f}x the time per sample of its peers)" if ratio else ""
        place = where(rank) if where is not None else None
        parts.append(f"rank {rank} is persistently slower{times}" + (f": {place}" if place else ""))
    return "; ".join(parts)
