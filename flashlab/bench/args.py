"""Command-line argument types shared by the benchmark's modes (``cli`` and ``traffic``)."""

from __future__ import annotations

import argparse


def size_list(text: str) -> list[int]:
    """'1024,2k,16K' -> [1024, 2048, 16384] (k = 1024)."""
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        try:
            out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated sizes like 1024,2k,16k; got {text!r}") from None
    return out


def name_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [x.strip() for x in text.split(",") if x.strip()]
