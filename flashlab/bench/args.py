"""Command-line argument types shared by the benchmark's modes (``cli`` and ``traffic``).

Each one turns the text of a flag into its value or refuses it with an ``argparse.ArgumentTypeError`` that says
what was expected, so a bad flag stops the command at once with one line and exit status 2, before anything runs.
"""

from __future__ import annotations

import argparse
import math

# The largest size a flag takes: tensor extents and counts fit in a signed 32-bit int, as the kernels index them.
MAX_SIZE = 2**31 - 1
# torch.Generator.manual_seed takes 0 ... 2**64 - 1.
MAX_SEED = 2**64 - 1


def size_list(text: str) -> list[int]:
    """'1024,2k,16K' -> [1024, 2048, 16384] (k = 1024); every size positive, at most ``MAX_SIZE``."""
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        try:
            out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated sizes like 1024,2k,16k; got {text!r}") from None
        if not 1 <= out[-1] <= MAX_SIZE:
            raise argparse.ArgumentTypeError(f"sizes must be from 1 to {MAX_SIZE}; got {x!r} in {text!r}")
    return out


def name_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; at least one name."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated names; got {text!r}")
    return names


def whole_number(least: int, most: int = MAX_SIZE):
    """The type of a flag that takes one integer from ``least`` to ``most``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be from {least} to {most}; got {value}")
        return value

    return parse


def finite_number(least: float, *, above: bool = False):
    """The type of a flag that takes one finite number, at least ``least`` (more than it, if ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
        if not math.isfinite(value) or value < least or (above and value == least):
            bound = f"above {least:g}" if above else f"at least {least:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}; got {text!r}")
        return value

    return parse


def output_prefix(text: str) -> str:
    """A ``--out PREFIX``: the path the results are written beside as ``PREFIX.json`` and ``PREFIX.csv``."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path PREFIX (PREFIX.json and PREFIX.csv are written); got ''")
    if text.endswith(("/", "\\")):
        raise argparse.ArgumentTypeError(
            f"expected a path PREFIX, not a folder: {text!r} (e.g. {text.rstrip('/')}/run writes run.json, run.csv)"
        )
    return text
