"""Real-browser checks with the system Chromium (pip ``playwright``, no downloaded browser).

1. Offline reports: a rendered page shows live ipywidgets, plotly figures and MathJax equations
   (in markdown and in widget labels) while every non-local request is blocked (and none is
   attempted), and it throws no error.
2. JupyterLab: the notebook runs in a real kernel, and moving the explorer's slider makes the
   Python ``observe`` callback update the readout.

Skipped when ``chromium`` is not installed, except under CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit

import nbformat
import pytest
from playwright.sync_api import expect, sync_playwright

from lab import report

try:  # shared synthetic notebook (tests/ may or may not be a package)
    from .test_report import demo_notebook, execute_demo
except ImportError:
    from test_report import demo_notebook, execute_demo

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
TOUR = REPO / "notebooks" / "00_tour.ipynb"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic"]
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def chromium_executable() -> str:
    """Path of the system Chromium; skip the test without it (fail under CI)."""
    path = shutil.which("chromium")
    if path is None:
        reason = "the system Chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: browser tests must run in CI")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def offline_browser():
    executable = chromium_executable()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def is_local(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in {"file", "data", "blob", "about"} or parts.hostname in LOCAL_HOSTS


def open_offline_page(browser):
    """A new page that aborts every non-local request; returns (page, blocked URLs, page errors)."""
    blocked, errors = [], []
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()

    def route(r):
        if is_local(r.request.url):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page, blocked, errors


def check_report(browser, html: Path, screenshot: Path, *, widget_math: bool = False) -> dict:
    """Open an offline report and assert that widgets, plotly and MathJax rendered, without page errors.

    ``widget_math``: a widget description holds ``$...$``, which must be typeset too (the widget
    controls call MathJax 2's ``MathJax.Hub.Queue``; the page maps it onto MathJax 3).
    """
    page, blocked, errors = open_offline_page(browser)
    try:
        page.goto(html.resolve().as_uri(), wait_until="load")
        page.wait_for_selector(".widget-slider", timeout=30_000)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30_000)
        page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
        page.evaluate("() => MathJax.startup.promise")
        page.wait_for_selector("mjx-container", timeout=30_000)
        if widget_math:
            page.wait_for_selector(".widget-slider .widget-label mjx-container svg", state="visible",
                                   timeout=30_000)
            page.evaluate("() => MathJax.startup.promise")  # the label's typesetting is chained on it
        counts = page.evaluate("""() => Object.fromEntries(
            ['.widget-slider', '.js-plotly-plot .main-svg', 'mjx-container', 'img',
             '.widget-label mjx-container']
            .map(s => [s, document.querySelectorAll(s).length]))""")
        labels = page.locator(".widget-slider .widget-label").all_inner_texts()
        page.screenshot(path=str(screenshot), full_page=True)
        print(f"report screenshot: {screenshot}")
    finally:
        page.context.close()
    assert counts[".widget-slider"] >= 1, counts
    assert counts[".js-plotly-plot .main-svg"] >= 1, counts
    assert counts["mjx-container"] >= 1, counts
    if widget_math:
        assert counts[".widget-label mjx-container"] >= 1, counts
        assert not any("$" in text for text in labels), labels  # no raw TeX left in the labels
    assert blocked == [], f"the report asked for non-local resources: {blocked}"
    assert errors == [], errors
    return counts


@pytest.mark.timeout(180)
def test_synthetic_report_offline(offline_browser, tmp_path):
    executed = execute_demo(tmp_path / "run")
    report.ensure_static(tmp_path / "reports")
    html = report.export_html(executed, tmp_path / "reports" / "demo.html")
    check_report(offline_browser, html, tmp_path / "demo.png", widget_math=True)


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("tour")
def test_tour_report_offline(offline_browser, tour_report, tmp_path):
    assert (tour_report.parent / "_static" / "widgets-embed.js").is_file()
    check_report(offline_browser, tour_report, tmp_path / "00_tour.png")


# ------------------------------------------------------------------------------------- JupyterLab

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(root: Path, home: Path) -> tuple[subprocess.Popen, str, Path]:
    """Start ``jupyter lab`` on 127.0.0.1 serving ``root``, with its config, state and logs in ``home``.

    Returns the process, the base URL and the log file; waits until the server answers.
    """
    port, token = free_port(), secrets.token_hex(16)
    labconfig = home / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(json.dumps(  # no "Jupyter news?" toast
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "IPYTHONDIR": str(home / "ipython")}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly"]
    log_path = home / "lab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    return proc, f"{base}/lab/tree/%s?token={token}", log_path
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    stop_lab(proc)
    pytest.fail(f"jupyter lab did not start; log:\n{log_path.read_text()[-3000:]}")


def stop_lab(proc: subprocess.Popen) -> None:
    """Stop the server (it shuts its kernels down on SIGTERM); kill it if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("notebook", ["synthetic", "tour"])
def test_jupyterlab_explorer_runs_kernel_callback(notebook, offline_browser, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    if notebook == "tour":
        if not TOUR.exists():
            pytest.skip(f"{TOUR} does not exist yet")
        name = TOUR.name
        shutil.copy(TOUR, root / name)
    else:
        name = "demo.ipynb"
        nbformat.write(demo_notebook(), root / name)

    proc, url, log_path = start_lab(root, tmp_path / "lab")
    page = None
    try:
        page, blocked, errors = open_offline_page(offline_browser)
        page.goto(url % quote(name))
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.wait_for_function("window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel"
                               "?.status === 'idle'", timeout=60_000)
        page.evaluate("""() => { window.__runAll = null;
            window.jupyterapp.commands.execute('notebook:run-all-cells').then(
                ok => { window.__runAll = String(ok); }, err => { window.__runAll = 'error: ' + err; }); }""")
        page.wait_for_function("window.__runAll !== null", timeout=150_000)
        assert page.evaluate("window.__runAll") == "true", "a cell failed; see the screenshot and lab.log"

        explorer = page.locator(".jp-OutputArea .lab-explorer").first
        explorer.scroll_into_view_if_needed()
        readout = explorer.locator(".lab-readout").first
        expect(readout).to_be_visible(timeout=30_000)
        before = readout.inner_text()
        explorer.locator(".widget-slider .noUi-handle").first.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        expect(readout).not_to_have_text(before, timeout=20_000)  # the kernel callback ran
        after = readout.inner_text()
        page.screenshot(path=str(tmp_path / "jupyterlab.png"), full_page=True)
        print(f"JupyterLab screenshot: {tmp_path / 'jupyterlab.png'}; readout {before!r} -> {after!r}")
        assert blocked == [], f"JupyterLab asked for non-local resources: {blocked}"
        assert errors == [], errors
    except Exception:
        if page is not None:
            page.screenshot(path=str(tmp_path / "jupyterlab-failure.png"))
        print(f"JupyterLab log ({log_path}):\n{log_path.read_text()[-4000:]}")
        raise
    finally:
        if page is not None:
            page.context.close()
        stop_lab(proc)
