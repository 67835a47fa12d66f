"""tag / untag / pin / unpin, their refusals (exit 3 and 4), and that whatever a user
named is printed as text, never as rich markup."""

from __future__ import annotations

import httpx
import pytest

from tests.service.helpers import Client

from .conftest import error_line, lastgood, lastgood_many, unique_run


def tags_of(service, cid: int) -> list[tuple[str, str]]:
    r = httpx.get(f"{service.url}/api/v1/checkpoints/{cid}", timeout=30)
    return [(t["name"], t["kind"]) for t in r.json()["tags"]]


@pytest.mark.slow
def test_tag_untag_pin_unpin(service, tree):
    res = lastgood("tag", str(tree.b), "best", url=service.url)
    assert res.out.strip() == f"tagged #{tree.b} best"
    assert ("best", "tag") in tags_of(service, tree.b)

    doc = lastgood("--json", "tag", str(tree.d), "prod", "--alias", url=service.url).json()
    assert doc == {"checkpoint_id": tree.d, "name": "prod", "kind": "alias", "moved_from": None}
    moved = lastgood("tag", f"{tree.run}@last-good", "prod", "--alias", url=service.url)
    assert moved.out.strip() == f"alias #{tree.f} prod (moved from #{tree.d})"
    assert ("prod", "alias") in tags_of(service, tree.f) and ("prod", "alias") not in tags_of(service, tree.d)

    assert lastgood("pin", str(tree.e), url=service.url).out.strip() == f"pinned #{tree.e}"
    assert ("pinned", "pin") in tags_of(service, tree.e)
    assert lastgood("unpin", str(tree.e), "--json", url=service.url).json() == {"checkpoint_id": tree.e,
                                                                                "pinned": False}
    assert ("pinned", "pin") not in tags_of(service, tree.e)

    assert lastgood("untag", str(tree.b), "best", url=service.url).out.strip() == f"untagged #{tree.b} best"
    assert lastgood("--json", "untag", f"{tree.run}@prod", "prod", url=service.url).json() == {
        "checkpoint_id": tree.f, "removed": "prod"}
    assert tags_of(service, tree.b) == [] and tags_of(service, tree.f) == [("last-good", "system")]


@pytest.mark.slow
def test_refusals_and_not_found(service, tree):
    # conflict / refused: exit 4, with the service's own message; not found: exit 3
    u = ["--url", service.url]
    cases = [
        (["tag", str(tree.p), "x"], 4, f"checkpoint {tree.p} is ABANDONED: its save never completed"),
        (["pin", str(tree.p)], 4, f"checkpoint {tree.p} is ABANDONED"),
        (["tag", str(tree.b), "suspect"], 4, "'suspect' is a system tag"),
        (["tag", str(tree.b), " padded "], 4, "without leading or trailing spaces"),
        (["untag", str(tree.f), "last-good"], 4, "'last-good' is a system tag"),
        (["show", "987654321"], 3, "checkpoint 987654321 does not exist"),
        (["tag", "987654321", "x"], 3, "checkpoint 987654321 does not exist"),
        (["untag", str(tree.b), "never-set"], 3, f"checkpoint {tree.b} has no tag 'never-set'"),
        (["ls", "no-such-run-z"], 3, "run 'no-such-run-z' does not exist"),
        (["events", "no-such-run-z"], 3, "run 'no-such-run-z' does not exist"),
        (["verify", "987654321"], 3, "checkpoint 987654321 does not exist"),
        (["download", "987654321", "unused-dir"], 3, "checkpoint 987654321 does not exist"),
    ]
    for (argv, _, message), res in zip(cases, lastgood_many([(u + argv, code) for argv, code, _ in cases])):
        assert message in error_line(res), res.err
        assert res.out == ""
    lastgood("tag", str(tree.b), "both-ways", url=service.url)
    clash = lastgood("tag", str(tree.d), "both-ways", "--alias", url=service.url, code=4)
    assert "'both-ways' is already a tag in this run; remove it first" in error_line(clash)
    lastgood("untag", str(tree.b), "both-ways", url=service.url)


MARKUP = ["[red]x[/red]", "[bold]b", ":smile:", "[link=http://evil.example]click[/link]", "a\\[b]"]


@pytest.mark.slow
def test_markup_in_user_strings_prints_literally(service):
    run = unique_run("markup")
    c = Client(service.grpc_target)
    try:
        cid, _ = c.save(run, 7)
    finally:
        c.close()
    u = ["--url", service.url]
    tagged = lastgood_many([(u + ["tag", str(cid), name], 0) for name in MARKUP])
    assert [r.out.strip() for r in tagged] == [f"tagged #{cid} {name}" for name in MARKUP]
    for res in lastgood_many([(u + ["show", str(cid)], 0), (u + ["ls", run], 0), (u + ["lineage", run], 0)]):
        for name in MARKUP:
            assert name in res.out, (name, res.out)
        assert "😄" not in res.out
    # a name with '/' travels in the DELETE path too, and prints literally
    res = lastgood("untag", str(cid), "[red]x[/red]", url=service.url)
    assert res.out.strip() == f"untagged #{cid} [red]x[/red]"
    assert lastgood("untag", str(cid), "[bold]b", url=service.url).out.strip() == f"untagged #{cid} [bold]b"
