"""The page on a service that requires bearer tokens: it asks for one when the API answers
401, keeps it in sessionStorage, sends it on every API call, and says so when a reader
token may not do something. (Without auth the page never asks: test_web_ui.py.)"""

from __future__ import annotations

import secrets

import httpx
import pytest

from ..conftest import ServiceProc
from ..service.helpers import Client
from . import seed
from .conftest import UI_ENV, click_node, wait_graph

ADMIN = "ui-admin-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A run saved with auth off, then the same data served with tokens required."""
    data = tmp_path_factory.mktemp("ui-auth")
    svc = ServiceProc(data, dict(UI_ENV)).start()
    client = Client(svc.grpc_target)
    try:
        run = seed.unique("secure")
        c1 = seed.save(client, run, 10)
        c2 = seed.save(client, run, 20, c1)
    finally:
        client.close()
        svc.stop()
    svc = ServiceProc(data, {**UI_ENV, "LASTGOOD_AUTH_REQUIRED": "true", "LASTGOOD_ADMIN_TOKEN": ADMIN}).start()
    try:
        if httpx.get(svc.url + "/api/v1/overview", timeout=30).status_code != 401:
            pytest.skip("this service does not require tokens with LASTGOOD_AUTH_REQUIRED=true")
        r = httpx.post(svc.url + "/api/v1/tokens", json={"name": "web page test", "role": "reader"},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        assert r.status_code == 200, r.text
        yield svc, run, (c1, c2), r.json()["token"]
    finally:
        svc.stop()


def test_the_page_asks_for_a_token_and_sends_it_on_every_call(open_page, secured):
    svc, run, (c1, c2), reader = secured
    page, watch = open_page(f"{svc.url}/#run={run}")
    watch.allow(r"status of 401")  # the page's first calls, and the wrong token
    watch.allow(r"status of 403")  # a reader may not tag
    page.wait_for_selector("#auth:not([hidden])")
    assert page.locator("#runs-body tr").count() == 0

    page.fill("#auth-token", "lg_999_not-a-token")
    page.click("#auth-form button[type=submit]")
    page.wait_for_function("() => document.getElementById('auth-msg').textContent.includes('refused')")
    assert not page.locator("#auth").is_hidden()

    calls: list[tuple[str, str | None]] = []
    page.on("request", lambda r: calls.append((r.url, r.headers.get("authorization"))) if "/api/" in r.url else None)
    page.fill("#auth-token", reader)
    page.click("#auth-form button[type=submit]")
    snap = wait_graph(page, run)
    assert page.locator("#auth").is_hidden()
    assert [n["id"] for n in snap["nodes"]] == [c1, c2]
    assert page.evaluate("() => sessionStorage.getItem('lastgood.token')") == reader

    click_node(page, f"c{c2}")
    page.wait_for_selector("#detail-files table")
    page.wait_for_selector("#restore-curl")
    curl = page.locator("#restore-curl").inner_text()
    assert '-H "Authorization: Bearer $LASTGOOD_TOKEN"' in curl and reader not in curl  # never the token itself
    assert "LASTGOOD_TOKEN" in page.locator("#restore-python").inner_text()

    # a reader may not tag: the page says so, and nothing changes
    page.fill("#tag-name", "from-a-reader")
    page.click("#tag-form button[type=submit]")
    page.wait_for_selector("#action-msg.error")
    assert page.locator("#action-msg").inner_text().startswith("Not allowed")
    tags = httpx.get(f"{svc.url}/api/v1/checkpoints/{c2}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert "from-a-reader" not in {t["name"] for t in tags.json()["tags"]}

    assert calls, "no API call after the token was given"
    assert {auth for _, auth in calls} == {f"Bearer {reader}"}, calls

    # the token lasts as long as the tab: a reload does not ask again
    page.reload()
    wait_graph(page, run)
    assert page.locator("#auth").is_hidden()
    # and the page forgets it on request
    page.click("#signout")
    page.wait_for_selector("#auth:not([hidden])")
    assert page.evaluate("() => sessionStorage.getItem('lastgood.token')") is None
