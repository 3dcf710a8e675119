"""FlashAttention 1 to 4 and Flash-Decoding, dated and sourced: what each changed, for which GPU generation.

The rows live in ``data/flash_versions.json`` beside this module (package data, read with ``importlib.resources``
as ``catalog.py`` reads the GPU catalogue). Each row cites its paper's arXiv id (or, for Flash-Decoding, its blog
post) and the date it appeared. The headline figures are the authors' own, on their kernels and shapes, and say
what they were compared against; flashlab did not measure them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources

DATA = resources.files("flashlab.calculators") / "data" / "flash_versions.json"


@dataclass(frozen=True)
class FlashVersion:
    """One release: ``date`` is ISO 8601 (first arXiv version or post); ``arxiv`` is None where there is no paper."""

    name: str
    short: str
    date: str
    arxiv: str | None
    source: str
    title: str
    gpu_generation: str
    changed: str
    authors_headline: str
    headline_baseline: str
    verified: str


def load_flash_versions() -> list[FlashVersion]:
    """The rows of ``flash_versions.json`` in date order. A row missing a field, or with an unknown one, is an error."""
    rows = json.loads(DATA.read_text(encoding="utf-8"))["versions"]
    names = {f.name for f in fields(FlashVersion)}
    out = []
    for row in rows:
        missing, unknown = names - set(row), set(row) - names
        if missing or unknown:
            raise ValueError(
                f"flash_versions.json row {row.get('short')!r}: missing {missing or '{}'}, unknown {unknown or '{}'}"
            )
        out.append(FlashVersion(**row))
    return sorted(out, key=lambda v: v.date)


FLASH_VERSIONS = load_flash_versions()


def versions_table(versions=None) -> str:
    """The rows as a Markdown table: version, date, source, GPU generation, what changed, headline, its baseline."""
    versions = FLASH_VERSIONS if versions is None else versions
    lines = [
        "| version | date | source | GPU generation | what changed | the authors' own headline | compared with |",
        "|:--|:--|:--|:--|:--|:--|:--|",
    ]
    for v in versions:
        cite = f"[arXiv {v.arxiv}]({v.source})" if v.arxiv else f"[blog post]({v.source})"
        cells = (v.short, v.date, cite, v.gpu_generation, v.changed, v.authors_headline, v.headline_baseline)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
