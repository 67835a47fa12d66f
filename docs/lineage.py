"""Draw docs/lineage.png, the picture in README.md: `make screenshot`.

Not a test (it asserts nothing); it seeds a service of its own through the real
interfaces (gRPC saves, REST rollback, tags, a pin) and photographs the page in Debian's
Chromium with Playwright, as the browser tests do. A run as a person would see it: a long
line folded, a spike and its rollback, training going on on a new branch, tags, a pin, a
failed save and one in progress.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import ServiceProc as ServiceProcess  # noqa: E402 - the launcher's, with .post for seed
from tests.service.helpers import Client  # noqa: E402
from tests.ui import seed  # noqa: E402
from tests.ui.conftest import ARGS, CHROMIUM, UI_ENV, click_node, wait_graph  # noqa: E402


def seed_service(svc: ServiceProcess, grpc: Client) -> int:
    """The run shown; returns the checkpoint whose detail panel is open."""
    run = "gpt-small"
    parent, ids = 0, {}
    for step in range(0, 3100, 100):
        parent = ids[step] = seed.save(grpc, run, step, parent)
    httpx.post(f"{svc.url}/api/v1/runs/{run}/rollback", timeout=30, json={
        "target_id": ids[2500], "spike_step": 2950,
        "data": {"metric": "loss", "value": 11.2, "loss": 11.2, "median": 2.4, "mad": 0.1, "z": 58.0,
                 "threshold": 6.0, "lr_factor": 0.5, "skipped": {"steps": [2501, 2950], "samples": [7, 11, 19]}},
    }).raise_for_status()
    parent = ids[2500]
    for step in range(2600, 3600, 100):
        # after the rollback the same job saves under "<launch>.1" (Checkpointer.attempt)
        parent = ids[("b", step)] = seed.save(grpc, run, step, parent, "attempt-1.1")
    aborted = grpc.begin(run, 3600, parent_id=parent, attempt="attempt-1.1").checkpoint_id
    grpc.abort(aborted, reason="rank 3 lost")
    grpc.begin(run, 3600, parent_id=parent, attempt="attempt-2")  # the relaunch, saving
    seed.tag(svc, ids[1000], "pre-lr-change")
    seed.tag(svc, ids[("b", 3000)], "best", alias=True)
    seed.pin(svc, ids[1000])
    parent = 0
    for step in range(0, 500, 100):  # a second run, for the runs list
        parent = seed.save(grpc, "gpt-small-ablation", step, parent)
    return ids[("b", 3500)]


def main(out: Path = ROOT / "docs" / "lineage.png") -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="lastgood-screenshot-") as tmp:
        svc = ServiceProcess(Path(tmp), dict(UI_ENV)).start()
        try:
            grpc = Client(svc.grpc_target)
            try:
                shown = seed_service(svc, grpc)
            finally:
                grpc.close()
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                page = browser.new_context(viewport={"width": 1600, "height": 900}).new_page()
                page.set_default_timeout(15_000)
                page.goto(f"{svc.url}/#run=gpt-small")
                wait_graph(page, "gpt-small")
                click_node(page, f"c{shown}")
                page.wait_for_selector("#restore-curl")
                page.screenshot(path=str(out))
                browser.close()
        finally:
            svc.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:2]))
