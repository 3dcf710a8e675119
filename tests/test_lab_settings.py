"""``make lab`` starts JupyterLab with the lab's own settings: no news feed and no update check.

JupyterLab asks on first start whether to fetch Jupyter's news, in a popup over the corner of the page where the
notebooks' widgets draw. ``make lab`` points JupyterLab's application settings at ``jupyter/lab-settings/``, whose
``overrides.json`` turns both off. The test reads the command ``make`` would run and asks jupyterlab_server, the
code JupyterLab serves its settings with, what the notification plugin's settings come out as from that folder.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PLUGIN = "@jupyterlab/apputils-extension:notification"
SCHEMAS = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"


def lab_settings_dir() -> Path:
    """The application settings folder in the JupyterLab command ``make lab`` runs (a dry run starts nothing)."""
    done = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True)
    command = next(line for line in done.stdout.splitlines() if "jupyter lab" in line)
    found = re.search(r"--LabApp\.app_settings_dir=(\S+)", command)
    assert found, f"make lab does not give JupyterLab the lab's settings folder: {command}"
    return Path(found.group(1))


def notification_defaults(app_settings_dir: Path, user_settings: Path) -> dict:
    settings_utils = pytest.importorskip("jupyterlab_server.settings_utils")
    if not (SCHEMAS / PLUGIN.replace(":", "/")).with_suffix(".json").exists():
        pytest.skip(f"JupyterLab's schemas are not installed under {SCHEMAS}")
    result, _ = settings_utils.get_settings(str(app_settings_dir), str(SCHEMAS), str(user_settings), PLUGIN)
    return {name: spec.get("default") for name, spec in result["schema"]["properties"].items()}


def test_make_lab_uses_the_repositorys_settings_folder():
    folder = lab_settings_dir()
    assert folder.resolve() == (ROOT / "jupyter" / "lab-settings").resolve()
    assert (folder / "overrides.json").is_file()


def test_the_lab_fetches_no_news_and_checks_for_no_updates(tmp_path):
    defaults = notification_defaults(lab_settings_dir(), tmp_path)
    assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults


def test_without_the_settings_folder_jupyterlab_would_ask(tmp_path):
    empty = tmp_path / "app-settings"
    empty.mkdir()
    defaults = notification_defaults(empty, tmp_path)
    assert defaults["fetchNews"] != "false", defaults  # JupyterLab's own default: ask on first start
