"""JupyterLab in headless Chromium: open the explorer, run it, move a slider, see it redraw.

Needs Debian's chromium at /usr/bin/chromium (CI: ``apt-get install -y chromium``).
Screenshots land in test-artifacts/ at the repository root.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from graphborrow.run import points

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
EXPLORER = ROOT / "notebooks" / "07_explorer.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server on 127.0.0.1 with a token for the module, rooted in a temp dir whose
    ``explorer/`` holds the explorer to run and ``executed/`` the executed notebooks to view. The
    app is exposed to the page (``window.jupyterapp``) so one loaded page opens every notebook."""
    tmp_path = tmp_path_factory.mktemp("browser")
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} not found; install Debian's chromium (apt-get install -y chromium)"
        if os.environ.get("CI"):  # CI installs it (make browser): never pass there by skipping
            pytest.fail(message)
        pytest.skip(message)
    import playwright.sync_api  # noqa: F401  (a test dependency: missing, the test fails)
    if not EXPLORER.exists():
        pytest.fail(f"{EXPLORER.name} is missing from notebooks/")
    root = tmp_path / "lab"
    (root / "explorer").mkdir(parents=True)
    (root / "executed").mkdir()
    shutil.copy(EXPLORER, root / "explorer" / EXPLORER.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "MPLBACKEND": "Agg"}
    # start the notebook's kernel without JupyterLab's "Select Kernel" dialog, which otherwise
    # appears on opening (or not: a test waiting for it either way lost 15 s)
    settings = tmp_path / "settings"
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"autoStartDefaultKernel": True}))
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--ServerApp.port_retries=0",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={settings}", "--LabApp.expose_app_in_browser=True"]
        + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


KERNEL_READY = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
        && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}"""


def _image_bytes(image) -> bytes:
    return image.screenshot()


def test_explorer_redraws_when_a_slider_moves(lab):
    from playwright.sync_api import sync_playwright

    url, token, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        try:
            page.goto(f"{url}/lab/tree/explorer/{EXPLORER.name}?reset&token={token}")
            page.locator(".jp-Notebook").first.wait_for(timeout=60_000)
            # the kernel connected and idle (the status bar can read idle before it connects,
            # and cells run then are dropped)
            page.wait_for_function(KERNEL_READY, timeout=60_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            image = page.locator("img.widget-image").first
            image.wait_for(state="visible", timeout=120_000)
            # the notebook moves the slider itself and saves its results last: wait for that,
            # so "before" is the figure the finished notebook leaves, not one mid-run
            done, deadline = root / "explorer" / "results" / "07_explorer.json", time.time() + 180
            while not done.exists() and time.time() < deadline:
                page.wait_for_timeout(500)
            assert done.exists(), "the explorer notebook did not run to the end in the browser"
            image.scroll_into_view_if_needed()
            page.wait_for_timeout(1000)
            before = _image_bytes(image)
            ARTIFACTS.joinpath("explorer_before.png").write_bytes(before)
            page.screenshot(path=str(ARTIFACTS / "explorer_page_before.png"))

            slider = page.locator(".widget-slider", has_text="batch size").first
            handle = slider.locator(".noUi-handle").first
            handle.focus()
            handle.press("End")
            after, deadline = before, time.time() + 120
            while after == before and time.time() < deadline:
                page.wait_for_timeout(1000)
                after = _image_bytes(image)
            ARTIFACTS.joinpath("explorer_after.png").write_bytes(after)
            page.screenshot(path=str(ARTIFACTS / "explorer_page_after.png"))
            readout = slider.locator(".widget-readout").first.inner_text()
            assert readout.strip() == "32", f"slider readout is {readout!r}, expected the ladder's top 32"
            assert after != before, "the explorer figure did not change after moving the batch-size slider"
        finally:
            page.screenshot(path=str(ARTIFACTS / "explorer_page_final.png"))
            browser.close()


# ----------------------------------------------------------------------------- every notebook's figures

NUMBERED = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# make test opens two executed notebooks (the first, and the sweep's plot with its caption); the
# others render through the same output area and run in make test-deep (marker deep)
IN_MAKE_TEST = ("00_overview", "06_capacity_sweep")
POINTS = ROOT / "output" / "points"   # make test leaves the executed notebooks here (the H200 preset)


def _executed_copy(path: Path, folder: Path) -> Path:
    """The notebook as the points run executed it (defaults or the H200 preset), else run now at its defaults."""
    done = next((POINTS / path.stem / f"{label}.ipynb" for label in ("defaults", "h200")
                 if (POINTS / path.stem / f"{label}.ipynb").exists()), POINTS / path.stem / "defaults.ipynb")
    if not done.exists():
        record = points.run_point(path, "defaults", {}, folder / "points", timeout=300)
        assert record["ok"], f"{path.name} failed at its defaults: {record['problems']}"
        done = folder / "points" / path.stem / "defaults.ipynb"
    return done


@pytest.fixture(scope="module")
def lab_page(lab):
    """One headless Chromium page with JupyterLab loaded (a fresh workspace): the notebooks open in it."""
    from playwright.sync_api import sync_playwright

    url, token, _ = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{url}/lab?reset&token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started", timeout=60_000)
            page.evaluate("() => window.jupyterapp.started")
            yield page
        finally:
            browser.close()


@pytest.mark.parametrize("path", [p if p.stem in IN_MAKE_TEST else pytest.param(p, marks=pytest.mark.deep)
                                  for p in NUMBERED], ids=lambda p: p.stem)
def test_executed_notebook_shows_its_figures_in_jupyterlab(lab, lab_page, path):
    """Opens the executed notebook (outputs stored, no kernel run) and counts rendered images:
    at least one per cell tagged 'figure'. Screenshot: test-artifacts/<notebook>.png."""
    import json

    _, _, root = lab
    page = lab_page
    executed = _executed_copy(path, root.parent)
    shutil.copy(executed, root / "executed" / path.name)
    nb = json.loads(executed.read_text())
    tagged = sum("figure" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])
    stored = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert stored >= tagged, f"{path.name}: {tagged} figure cells but only {stored} stored images"
    ARTIFACTS.mkdir(exist_ok=True)
    # open it without a kernel (the stored outputs are what is checked), in the page already loaded
    page.evaluate("path => window.jupyterapp.commands.execute('docmanager:open', "
                  "{path, factory: 'Notebook', kernel: {name: null}})", f"executed/{path.name}")
    try:
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
        panel.locator(".jp-Notebook").first.wait_for(timeout=60_000)
        images = panel.locator(".jp-OutputArea-output img")
        deadline = time.time() + 60
        while images.count() < stored and time.time() < deadline:
            page.wait_for_timeout(300)
        shown = images.count()
        for i in range(shown):  # an image that failed to decode has no natural width
            assert images.nth(i).evaluate("img => img.complete && img.naturalWidth > 0"), (
                f"{path.name}: image {i} did not render")
        page.screenshot(path=str(ARTIFACTS / f"{path.stem}.png"))
        if shown:
            images.first.scroll_into_view_if_needed()
            page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACTS / f"{path.stem}_figure.png"))
        assert shown >= max(stored, 1 if tagged else 0), (
            f"{path.name}: JupyterLab shows {shown} images; the executed notebook stores {stored}")
    finally:  # the next notebook opens in a clean main area: close this one unsaved, stop its kernel
        page.evaluate("async () => { const app = window.jupyterapp;"
                      " for (const w of Array.from(app.shell.widgets('main'))) w.dispose();"
                      " await app.serviceManager.sessions.shutdownAll(); }")
