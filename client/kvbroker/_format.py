"""Numbers and tables as the operator CLI and the benchmark print them."""

from __future__ import annotations

import math


def fmt_size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_gbps(gbps: float) -> str:
    """GB/s with two decimals, or as many as two significant digits need: a small pull shows 0.0031, not 0.00."""
    if gbps <= 0 or gbps >= 0.01:
        return f"{gbps:.2f}"
    decimals = min(9, 1 - math.floor(math.log10(gbps)))
    return f"{gbps:.{decimals}f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns two spaces apart, the header first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])
