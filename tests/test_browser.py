"""The sequence-length explorer in a real browser: JupyterLab on localhost, driven in headless Chromium.

The in-kernel test (``test_widgets.py``) checks what the widget computes; this one checks what a learner sees: the
notebook runs in JupyterLab, the explorer renders, and moving its slider changes the score-matrix memory on the
page. It uses Debian's chromium (``/usr/bin/chromium``) through Playwright -- never a browser Playwright downloads.
Without chromium the test is skipped, except in CI (env ``CI`` true), where it must run.

The notebook is copied into a fresh temporary folder that JupyterLab serves, so running it never writes outputs
into the repository. A screenshot of the explorer is kept at ``test-artifacts/explorer.png``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ARTIFACTS, IN_CI, NOTEBOOKS

pytestmark = pytest.mark.browser

NOTEBOOK = "02_score_matrix_and_traffic.ipynb"
CHROMIUM = os.environ.get("FLASHLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SERVER_START_S = 120  # JupyterLab's first start is slow on a 2-core machine
RUN_ALL_S = 240  # the notebook's cells, run in the browser's kernel
SCORE_MEMORY = ".flashlab-score-memory"
KERNEL_IDLE = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}"""


def _skip_or_fail(reason: str):
    if IN_CI:
        pytest.fail(f"{reason} (CI installs it, so this is an error there)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """Serve a copy of notebook 02 from a fresh folder; yield the notebook's URL; stop the server afterwards."""
    # check the tools first, so a machine without them skips at once (CI, which installs them, fails instead)
    if not Path(CHROMIUM).is_file():
        _skip_or_fail(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _skip_or_fail("playwright (the Python package) is not installed")
    if not (NOTEBOOKS / NOTEBOOK).is_file():
        pytest.fail(f"{NOTEBOOKS / NOTEBOOK} is missing")
    if "flashlab.widgets.explorer(" not in (NOTEBOOKS / NOTEBOOK).read_text(encoding="utf-8"):
        pytest.fail(f"{NOTEBOOK} has no cell that shows the explorer (flashlab.widgets.explorer())")
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(NOTEBOOKS / NOTEBOOK, root / NOTEBOOK)
    # no "would you like news?" toast over the page (JupyterLab asks on first start)
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),  # no user settings, no remembered workspace
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    cmd = [
        str(Path(sys.executable).with_name("jupyter")),
        "lab",
        "--no-browser",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, to run the notebook's commands
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = tmp_path / "jupyterlab.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                url = f"http://127.0.0.1:{port}/api/status?token={token}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}"
    finally:
        # Stop the server and its kernel: SIGTERM to the group it leads, SIGKILL if it lingers.
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if server.poll() is not None:
                break
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                break
            try:
                server.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue


def _score_text(page) -> str:
    return page.locator(SCORE_MEMORY).first.inner_text().strip()


def test_explorer_slider_changes_the_score_memory_shown(jupyterlab):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = None
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(jupyterlab, timeout=120_000)
            page.wait_for_selector(".jp-Notebook", timeout=120_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands", timeout=120_000)
            # a kernel must be attached and idle before "run all" means anything
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            # start "run all" without awaiting its promise (page.evaluate has no timeout of its own)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            score = page.locator(SCORE_MEMORY).first
            deadline = time.monotonic() + RUN_ALL_S
            while not score.is_visible():
                # JupyterLab may still ask which kernel to use: take the one it offers (the notebook's python3)
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                if dialog.count() and dialog.first.is_visible():
                    dialog.first.click()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the explorer's {SCORE_MEMORY} did not appear within {RUN_ALL_S} s")
                page.wait_for_timeout(500)
            page.wait_for_function(
                f"() => /\\d/.test(document.querySelector('{SCORE_MEMORY}').innerText)", timeout=60_000
            )
            explorer = page.locator(".flashlab-explorer").first
            explorer.scroll_into_view_if_needed()
            before = _score_text(page)
            plot = explorer.locator(".flashlab-plot").first
            plot_before = plot.inner_text()

            # Move the sequence-length slider: focus its handle and step right with the keyboard, as a user would;
            # if the keyboard does not move it, drag the handle with the mouse instead.
            handle = explorer.locator(".flashlab-seq-len .noUi-handle").first
            handle.click()
            for _ in range(2):
                handle.press("ArrowRight")
            try:
                page.wait_for_function(
                    f"(b) => document.querySelector('{SCORE_MEMORY}').innerText.trim() !== b", arg=before, timeout=5_000
                )
            except Exception:
                box = handle.bounding_box()
                page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
                page.mouse.down()
                page.mouse.move(box["x"] + 150, box["y"] + box["height"] / 2, steps=10)
                page.mouse.up()
                page.wait_for_function(
                    f"(b) => document.querySelector('{SCORE_MEMORY}').innerText.trim() !== b",
                    arg=before,
                    timeout=30_000,
                )
            after = _score_text(page)
            # the readout and the plot are redrawn one after the other: give the plot up to 10 s to follow
            plot_after, redraw_deadline = plot.inner_text(), time.monotonic() + 10
            while plot_after == plot_before and time.monotonic() < redraw_deadline:
                page.wait_for_timeout(100)
                plot_after = plot.inner_text()
            page.wait_for_timeout(500)  # let the plot redraw before the picture is taken
            explorer.screenshot(path=str(ARTIFACTS / "explorer.png"))
        except Exception:
            if page is not None:  # keep what the page showed when it failed
                page.screenshot(path=str(ARTIFACTS / "explorer-failure.png"))
            raise
        finally:
            browser.close()

    assert re.search(r"\d", after), f"the score-memory readout shows no number: {after!r}"
    assert after != before, f"moving the slider did not change the score-matrix memory shown ({before!r})"
    assert "FLOP/B" in plot_after and plot_after != plot_before, "the roofline plot did not redraw"
