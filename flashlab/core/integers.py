"""Integer arithmetic of tiles and grids: how many tiles cover a length, the tile width a head dim pads to.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are JIT functions, and each call from
Python costs microseconds, which a short decode step's launch pays several times over.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of b-sized tiles that cover a."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()
