"""Small arithmetic shared by the engine and the benchmarks' baselines."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots hold ``a`` tokens."""
    return -(-a // b)
