"""Browser tests of the web page: a real service process, Debian's Chromium driven by Playwright.

Every page a test opens is watched: console messages, uncaught errors, dialogs (alert,
confirm, ...) and Content-Security-Policy violations (both the console's report and the
`securitypolicyviolation` DOM event). A test fails on any console error, page error, CSP
violation or dialog unless it names what it expects (`watch.allow(...)`).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..conftest import ROOT, ServiceProc
from ..service.helpers import Client
from . import seed

CHROMIUM = os.environ.get("LASTGOOD_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
        "--no-first-run", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "test-artifacts"

# the page's own settings for these tests: saves stay pending, GC never runs by itself, and
# failed checkpoints are in the GC plan at once
UI_ENV = {"LASTGOOD_LEASE_SECONDS": "600", "LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_GC_GRACE_SECONDS": "0"}

# records CSP violations as the page sees them; init scripts run outside the page's CSP
CSP_LISTENER = """
window.__lastgoodTest = {csp: []};
document.addEventListener('securitypolicyviolation', (e) => {
  window.__lastgoodTest.csp.push({directive: e.violatedDirective, blocked: e.blockedURI, sample: e.sample});
});
"""


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = []
    if sync_playwright is None:
        missing.append("the playwright package (requirements-dev.txt)")
    if not Path(CHROMIUM).exists() and not shutil.which(CHROMIUM):
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does it)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail("browser tests need " + " and ".join(missing))
        pytest.skip("browser tests need " + " and ".join(missing))
    return sync_playwright


@pytest.fixture(scope="session")
def browser():
    sync_playwright = _playwright()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="session")
def ui_service(tmp_path_factory):
    svc = ServiceProc(tmp_path_factory.mktemp("ui-service"), dict(UI_ENV)).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def grpc_client(ui_service):
    c = Client(ui_service.grpc_target)
    yield c
    c.close()


@pytest.fixture(scope="session")
def world(ui_service, grpc_client) -> seed.World:
    """The seeded service: a run with a rollback branch, tags, pins, an abandoned, a pending
    and a corrupt checkpoint, hostile tags and event data; a small run; a 2,000-checkpoint run."""
    return seed.seed_world(ui_service, grpc_client)


@dataclass
class Watch:
    console: list = field(default_factory=list)
    page_errors: list = field(default_factory=list)
    dialogs: list = field(default_factory=list)
    allowed: list = field(default_factory=list)

    def allow(self, pattern: str) -> None:
        """Console errors matching this regex are expected (e.g. a 401 the page answers with a form)."""
        self.allowed.append(re.compile(pattern))

    def problems(self, page) -> list[str]:
        out = []
        for kind, text in self.console:
            if kind in ("error", "warning") and not any(p.search(text) for p in self.allowed):
                out.append(f"console {kind}: {text}")
            elif "Content Security Policy" in text or "Content-Security-Policy" in text:
                out.append(f"CSP (console): {text}")
        out += [f"page error: {e}" for e in self.page_errors]
        out += [f"dialog: {d}" for d in self.dialogs]
        try:
            csp = page.evaluate("() => window.__lastgoodTest ? window.__lastgoodTest.csp : []")
        except Exception as exc:  # the page is gone: nothing more to read
            csp = [] if page.is_closed() else [f"could not read CSP reports: {exc}"]
        out += [f"CSP violation: {v}" for v in csp]
        return out


@pytest.fixture
def open_page(browser, request):
    """open_page(url) -> (page, watch): a fresh browser context (own sessionStorage) per page."""
    opened = []

    def _open(url: str, *, width: int = 1440, height: int = 900):
        context = browser.new_context(viewport={"width": width, "height": height})
        context.add_init_script(CSP_LISTENER)
        page = context.new_page()
        watch = Watch()
        page.on("console", lambda m: watch.console.append((m.type, m.text)))
        page.on("pageerror", lambda e: watch.page_errors.append(str(e)))

        def on_dialog(d):
            watch.dialogs.append(f"{d.type}: {d.message}")
            d.dismiss()

        page.on("dialog", on_dialog)
        page.set_default_timeout(15_000)
        opened.append((context, page, watch))
        page.goto(url)
        return page, watch

    yield _open
    failures = []
    for context, page, watch in opened:
        failures += watch.problems(page)
        context.close()
    if failures:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print("the page also reported:\n" + "\n".join(failures))  # the test's own failure says more
        else:
            pytest.fail("the page reported problems:\n" + "\n".join(failures))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def wait_graph(page, run: str, *, newer_than: int = 0):
    """Wait until the graph shows `run` (and was drawn again after version `newer_than`)."""
    page.wait_for_function(
        "([run, v]) => { const g = document.getElementById('graph');"
        " return g.dataset.state === 'ready' && g.dataset.run === run && Number(g.dataset.version) > v; }",
        arg=[run, newer_than])
    return page.evaluate("() => window.lastgoodGraph.snapshot()")


def graph_version(page) -> int:
    return page.evaluate("() => window.lastgoodGraph.version()")


def click_node(page, key: str) -> None:
    """A real mouse click where cytoscape drew the element, once the drawing holds still:
    a resize the page is still going through (the detail panel opening, the runs list
    filling in) refits the graph and moves every node, and a click computed before it
    lands beside the node (seen once in CI, on the first click of a fresh page)."""
    def where():
        # after two frames, so that a resize the last action caused is drawn
        pos = page.evaluate("(k) => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame("
                            "() => done(window.lastgoodGraph.renderedPosition(k)))))", key)
        return pos, page.locator("#graph").bounding_box()

    deadline = time.monotonic() + 10
    pos, box = where()
    while time.monotonic() < deadline:
        page.wait_for_timeout(150)
        again = where()
        if again == (pos, box):
            break
        pos, box = again
    assert pos is not None, f"{key} is not drawn"
    assert 0 <= pos["x"] <= box["width"] and 0 <= pos["y"] <= box["height"], f"{key} is drawn out of view: {pos}"
    page.mouse.click(box["x"] + pos["x"], box["y"] + pos["y"])
