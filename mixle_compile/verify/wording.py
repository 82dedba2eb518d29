"""Small helpers for the words of rule messages and hints."""

from __future__ import annotations

from collections.abc import Iterable


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def alternatives(values: Iterable[object], limit: int = 6) -> str:
    """``[1, 2, 4]`` -> ``1, 2 or 4`` (at most ``limit`` values, the rest elided)."""
    items = [str(v) for v in values]
    if len(items) > limit:
        items = items[: limit - 1] + ["...", items[-1]]
    if not items:
        return "none"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def product(*factors: int) -> int:
    out = 1
    for f in factors:
        out *= f
    return out


def percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"
