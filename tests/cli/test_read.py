"""The read commands (runs, ls, show, lineage, events), checkpoint references, --help,
and usage errors, through the real console script against the shared service."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from lastgood.cli import cli

from .conftest import ENV, error_line, lastgood, lastgood_many

COMMANDS = ["runs", "ls", "show", "lineage", "events", "tag", "untag", "pin", "unpin", "gc", "verify", "download", "export",
            "import-dcp", "supervise", "agent"]
NO_JSON = {"supervise", "agent"}  # they run until ended: a job, whose output is on stdout; the node agent


def rest(service, path: str, **params):
    r = httpx.get(service.url + path, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_help_on_every_command_and_exit_codes_documented():
    assert sorted(cli.commands) == sorted(COMMANDS)
    top, *each = lastgood_many([(["--help"], 0)] + [([c, "--help"], 0) for c in COMMANDS])
    for code, words in [(0, "ok"), (1, "unexpected"), (2, "usage"), (3, "not found"), (4, "conflict"),
                        (5, "verification failed"), (6, "service unreachable"), (7, "supervise: gave up"),
                        (130, "interrupted")]:
        assert f"{code:>3}  {words}" in top.out, top.out
    for c in COMMANDS:
        assert f"  {c} " in top.out
    for c, res in zip(COMMANDS, each):
        assert res.out.startswith(f"Usage: lastgood {c} "), res.out
        assert ("--json" in res.out or c in NO_JSON) and "--help" in res.out
    # python -m lastgood.cli is the same program
    proc = subprocess.run([sys.executable, "-m", "lastgood.cli", "--version"], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("lastgood, version "), proc


def test_runs(service, tree):
    doc = lastgood("--json", "runs", "--limit", "1000", url=service.url).json()
    assert doc == rest(service, "/api/v1/runs", limit=1000)
    mine = next(r for r in doc["items"] if r["name"] == tree.run)
    assert mine["last_good"]["id"] == tree.f
    assert mine["checkpoints"]["COMMITTED"] == 5 and mine["checkpoints"]["ABANDONED"] == 1

    text = lastgood("runs", "--limit", "1000", url=service.url).out
    line = next(ln for ln in text.splitlines() if ln.startswith(tree.run + " "))
    assert f"#{tree.f}" in line and "250" in line and "5 committed, 1 abandoned" in line

    first = lastgood("runs", "--limit", "1", url=service.url).out
    if doc["total"] > 1:
        assert f"runs 1-1 of {doc['total']}; more with --offset 1" in first


def test_a_url_copied_with_the_api_prefix_means_its_service(service, tree):
    """--url http://host:port/api/v1 (copied from an answer or the OpenAPI page) is the same
    service, not a vague 404 on /api/v1/api/v1/..."""
    for url in (service.url + "/api/v1", service.url + "/api/v1/"):
        doc = lastgood("--json", "show", f"{tree.run}@last-good", url=url).json()
        assert doc["id"] == tree.f


def test_ls_filters_and_pages(service, tree):
    doc = lastgood("ls", tree.run, "--json", url=service.url).json()
    assert doc == rest(service, f"/api/v1/runs/{tree.run}/checkpoints")
    assert [c["id"] for c in doc["items"]] == [tree.f, tree.d, tree.p, tree.e, tree.b, tree.a]  # step desc

    committed = lastgood("--json", "ls", tree.run, "--status", "committed", "--limit", "2", "--offset", "1",
                         url=service.url).json()
    assert committed["total"] == 5 and [c["id"] for c in committed["items"]] == [tree.d, tree.e]

    text = lastgood("ls", tree.run, url=service.url).out
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip().startswith("#")}
    assert set(rows) == {f"#{i}" for i in (tree.a, tree.b, tree.p, tree.d, tree.e, tree.f)}
    assert "← last-good" in rows[f"#{tree.f}"] and "COMMITTED" in rows[f"#{tree.f}"]
    assert "ABANDONED" in rows[f"#{tree.p}"] and "last-good" not in rows[f"#{tree.p}"]
    assert "634 B" in rows[f"#{tree.a}"]  # two ranks of 317 bytes

    paged = lastgood("ls", tree.run, "--limit", "2", url=service.url).out
    assert "checkpoints 1-2 of 6; more with --offset 2" in paged

    bad = lastgood("ls", tree.run, "--status", "sleeping", url=service.url, code=4)
    assert "status must be one of" in error_line(bad)


def test_show(service, tree):
    doc = lastgood("show", str(tree.b), "--json", url=service.url).json()
    assert doc == rest(service, f"/api/v1/checkpoints/{tree.b}")
    files = {r["rank"]: r["files"] for r in doc["manifest"]["ranks"]}
    assert sorted(files) == [0, 1]

    text = lastgood("show", str(tree.b), url=service.url).out
    assert text.splitlines()[0].split() == [f"#{tree.b}", "run", tree.run, "step", "100", "COMMITTED"]
    for rank, fs in files.items():
        (f,) = fs
        line = next(ln for ln in text.splitlines() if f["name"] in ln)
        assert line.split()[0] == str(rank) and f["xxh3_128"] in line and "317 B" in line
    assert f"parent      #{tree.a}" in text

    pending = lastgood("show", str(tree.p), url=service.url).out
    assert "ABANDONED" in pending and "no manifest: the checkpoint is ABANDONED" in pending


@pytest.mark.slow
def test_checkpoint_references(service, tree):
    assert lastgood("--json", "show", f"{tree.run}@last-good", url=service.url).json()["id"] == tree.f
    lastgood("tag", str(tree.b), "candidate", url=service.url)
    lastgood("tag", str(tree.d), "candidate", url=service.url)
    lastgood("tag", str(tree.d), "release", "--alias", url=service.url)
    assert lastgood("--json", "show", f"{tree.run}@release", url=service.url).json()["id"] == tree.d

    ambiguous = lastgood("show", f"{tree.run}@candidate", url=service.url, code=4)
    assert f"names 2 checkpoints of run '{tree.run}' (#{tree.b}, #{tree.d})" in error_line(ambiguous)
    missing = lastgood("show", f"{tree.run}@nothing", url=service.url, code=3)
    assert f"run '{tree.run}' has no checkpoint tagged 'nothing'" in error_line(missing)
    no_run = lastgood("show", "no-such-run-x@last-good", url=service.url, code=3)
    assert "run 'no-such-run-x' does not exist" in error_line(no_run)
    for name in ("candidate", "release"):
        lastgood("untag", f"{tree.run}@release" if name == "release" else str(tree.b), name, url=service.url)
    lastgood("untag", str(tree.d), "candidate", url=service.url)


@pytest.mark.slow
def test_lineage_tree(service, tree):
    doc = lastgood("lineage", tree.run, "--json", url=service.url).json()
    want = rest(service, f"/api/v1/runs/{tree.run}/lineage")
    assert doc == {k: v for k, v in want.items() if k not in ("limit", "offset")}
    assert doc["branches"] == 2 and len(doc["nodes"]) == 6

    lines = lastgood("lineage", tree.run, url=service.url).out.splitlines()
    assert lines[0] == f"{tree.run}  6 checkpoints, 2 branches, last-good #{tree.f} (step 250)"

    def at(cid):
        return next(ln for ln in lines if f"#{cid}  step" in ln)

    assert "branch 0" in lines[1]
    # branch 0 is one flat list; branch 1 hangs under the checkpoint it forks from
    indent = {cid: at(cid).index("#") for cid in (tree.a, tree.b, tree.p, tree.d, tree.e, tree.f)}
    assert indent[tree.a] == indent[tree.b] == indent[tree.p] == indent[tree.d]
    assert indent[tree.e] == indent[tree.f] > indent[tree.a]
    fork = next(i for i, ln in enumerate(lines) if f"branch 1 from #{tree.a}" in ln)
    assert lines.index(at(tree.a)) < fork < lines.index(at(tree.e)) < lines.index(at(tree.f))
    assert "ABANDONED" in at(tree.p)
    assert f"(parent #{tree.b})" in at(tree.d)  # the retry after the abandoned save
    assert at(tree.f).rstrip().endswith("← last-good") and "last-good" not in at(tree.d)

    small = lastgood("lineage", tree.run, "--max-nodes", "3", url=service.url).out
    assert "checkpoints hidden" in small or "checkpoint hidden" in small
    assert "checkpoints shown; --max-nodes 0 shows all" in small
    assert f"#{tree.f}  step" in small and f"#{tree.a}  step" in small  # last-good and the fork point stay

    lastgood("lineage", "no-such-run-y", url=service.url, code=3)


def test_events(service, tree):
    doc = lastgood("events", tree.run, "--json", "--limit", "1000", url=service.url).json()
    assert doc == rest(service, f"/api/v1/runs/{tree.run}/events", limit=1000)
    kinds = [e["kind"] for e in doc["items"]]
    assert kinds.count("commit") == 5 and "abort" in kinds

    text = lastgood("events", tree.run, "--limit", "3", url=service.url).out
    assert "begin" in text and f"events 1-3 of {doc['total']}; more with --offset 3" in text
    abort = next(ln for ln in lastgood("events", tree.run, "--limit", "1000", url=service.url).out.splitlines()
                 if " abort " in ln)
    assert f"#{tree.p}" in abort and "the job died" in abort


def test_usage_errors_exit_2(service):
    calls = [["show", "a/b"], ["show", "0"], ["show", "@tag"], ["show", "run@"], ["ls", "a/b"],
             ["ls", "run", "--limit", "0"], ["nosuchcommand"], ["download", "1"], ["--timeout", "0", "runs"]]
    urls = [(["--url", "127.0.0.1:8000", "runs"], 2), (["runs"], 2, {"LASTGOOD_URL": "localhost:8000"}),
            (["--url", "ftp://127.0.0.1", "runs"], 2), (["--url", "http://", "runs"], 2)]
    for res in lastgood_many([(["--url", service.url, *argv], 2) for argv in calls] + urls):
        assert "Usage: lastgood" in res.err and "Error: " in res.err, res.err
        assert res.out == ""
    no_scheme = lastgood_many(urls[:2])
    for res in no_scheme:  # said as what it is, with the fix, not as an unreachable service (exit 6)
        assert "is not an http:// or https:// URL (did you mean http://" in res.err, res.err


def test_text_output_ends_with_a_newline(service, tree):
    calls = [["runs"], ["ls", tree.run], ["show", str(tree.f)], ["lineage", tree.run], ["events", tree.run],
             ["gc", "--dry-run"], ["verify", str(tree.f)]]
    for res in lastgood_many([(["--url", service.url, *argv], 0) for argv in calls]):
        assert res.out.endswith("\n") and not res.out.endswith("\n\n"), (res.argv, res.out[-200:])
