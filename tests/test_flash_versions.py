"""flash_versions.json: FlashAttention 1 to 4 and Flash-Decoding, each row dated and sourced."""

from __future__ import annotations

import re
from datetime import date

import pytest

from flashlab.calculators import flash_versions as fv


def test_the_data_file_loads_as_package_data():
    assert fv.DATA.is_file()
    assert [v.short for v in fv.FLASH_VERSIONS] == ["FA1", "FA2", "Flash-Decoding", "FA3", "FA4"]  # in date order


@pytest.mark.parametrize("v", fv.FLASH_VERSIONS, ids=lambda v: v.short)
def test_every_row_has_a_date_and_a_source(v):
    assert date(2022, 1, 1) <= date.fromisoformat(v.date) <= date.today()
    assert v.source.startswith("https://")
    if v.arxiv is not None:  # an arXiv id yymm.nnnnn agrees with the date and the link
        assert re.fullmatch(r"\d{4}\.\d{5}", v.arxiv)
        assert v.arxiv[:4] == v.date[2:4] + v.date[5:7]
        assert v.source == f"https://arxiv.org/abs/{v.arxiv}"
    for text in (v.gpu_generation, v.changed, v.authors_headline, v.headline_baseline, v.verified):
        assert text.strip()


def test_the_papers_are_the_ones_the_lesson_cites():
    arxiv = {v.short: v.arxiv for v in fv.FLASH_VERSIONS}
    assert arxiv == {
        "FA1": "2205.14135",
        "FA2": "2307.08691",
        "FA3": "2407.08608",
        "FA4": "2603.05451",
        "Flash-Decoding": None,
    }
    fa4 = next(v for v in fv.FLASH_VERSIONS if v.short == "FA4")
    assert "cuDNN" in fa4.headline_baseline and "Triton" in fa4.headline_baseline  # FA4's baseline is stated


def test_a_row_with_a_missing_field_is_refused(monkeypatch, tmp_path):
    bad = tmp_path / "flash_versions.json"
    bad.write_text('{"versions": [{"short": "FA9", "name": "x"}]}')
    monkeypatch.setattr(fv, "DATA", bad)
    with pytest.raises(ValueError, match="FA9.*missing"):
        fv.load_flash_versions()


def test_versions_table_has_one_line_per_row():
    table = fv.versions_table().splitlines()
    assert len(table) == 2 + len(fv.FLASH_VERSIONS)
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "[arXiv 2603.05451](https://arxiv.org/abs/2603.05451)" in table[-1]
