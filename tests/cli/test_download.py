"""`download` and `verify`: a checkpoint saved by the real client comes back byte for byte;
a blob corrupted on the service's disk fails verification (exit 5) and leaves nothing
behind; plus the exit codes for an unreachable or silent service and a local error,
and that the command line runs where torch cannot be imported."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from lastgood.wire.hashing import hash_bytes
from tests.service.helpers import Client, shard_blob

from .conftest import ENV, error_line, lastgood, unique_run


def rest_bytes(service, path: str) -> bytes:
    r = httpx.get(service.url + path, timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def files_under(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def saved(service):
    """A checkpoint written by lastgood.Checkpointer from a tiny model."""
    torch = pytest.importorskip("torch")
    import lastgood

    run = unique_run("saved")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with lastgood.Checkpointer(service.url, run=run) as ckpt:
        ckpt.save(3, lastgood.TrainState(model=model, optimizer=opt, extra={"epoch": 1}))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    return run, cid


def test_download_verifies_and_matches_the_service(service, saved, tmp_path):
    run, cid = saved
    out = tmp_path / "ckpt"
    doc = lastgood("download", f"{run}@last-good", str(out), "--json", url=service.url).json()
    manifest = json.loads(rest_bytes(service, f"/api/v1/checkpoints/{cid}/manifest"))
    (entry,) = manifest["ranks"][0]["files"]
    assert doc["checkpoint_id"] == cid and doc["run"] == run and doc["step"] == 3 and doc["verified"] is True
    assert doc["files"] == [{"rank": 0, "name": entry["name"], "size": entry["size"], "xxh3_128": entry["xxh3_128"],
                             "path": str(out / "rank0" / entry["name"]), "reused": False}]
    assert files_under(out) == ["manifest.json", f"rank0/{entry['name']}"]

    got = (out / "rank0" / entry["name"]).read_bytes()
    assert got == rest_bytes(service, f"/api/v1/checkpoints/{cid}/ranks/0/files/{entry['name']}")
    assert got == shard_blob(service, cid, 0).read_bytes()
    assert hash_bytes(got) == entry["xxh3_128"] and len(got) == entry["size"]
    assert (out / "manifest.json").read_bytes() == rest_bytes(service, f"/api/v1/checkpoints/{cid}/manifest")

    from safetensors import safe_open  # the file is a plain safetensors file
    with safe_open(str(out / "rank0" / entry["name"]), "np") as f:
        assert "model.weight" in set(f.keys())

    # a rerun keeps what is already there and verified; text output and the progress bar
    again = lastgood("download", str(cid), str(out), "--progress", url=service.url)
    assert f"downloaded #{cid} (run {run}, step 3): 1 file(s)" in again.out and "kept" in again.out
    assert f"checkpoint {cid}" in again.err  # the progress bar's last frame (stderr is no terminal here)


def test_download_of_ranks(service, tree, tmp_path):
    both = lastgood("--json", "download", str(tree.a), str(tmp_path / "all"), url=service.url).json()
    assert [(f["rank"], f["name"]) for f in both["files"]] == [(0, "rank00000.safetensors"),
                                                               (1, "rank00001.safetensors")]
    for rank in (0, 1):
        assert (tmp_path / "all" / f"rank{rank}" / f"rank{rank:05d}.safetensors").read_bytes() == \
            tree.shards[tree.a][rank]
    one = lastgood("--json", "download", str(tree.a), str(tmp_path / "one"), "--rank", "1", url=service.url).json()
    assert [f["rank"] for f in one["files"]] == [1]
    assert files_under(tmp_path / "one") == ["manifest.json", "rank1/rank00001.safetensors"]
    res = lastgood("download", str(tree.a), str(tmp_path / "bad"), "--rank", "2", url=service.url, code=4)
    assert "rank 2 is outside world size 2" in error_line(res)
    # an ABANDONED checkpoint has nothing to download (no read lease for it)
    res = lastgood("download", str(tree.p), str(tmp_path / "abandoned"), url=service.url, code=4)
    assert (f"checkpoint {tree.p} is ABANDONED: its save never completed" in error_line(res)
            and "only COMMITTED checkpoints can be read" in error_line(res))


@pytest.mark.slow
def test_corrupt_blob_fails_verification(service, tmp_path):
    run = unique_run("corrupt")
    c = Client(service.grpc_target)
    try:
        good, _ = c.save(run, 1)
        cid, shards = c.save(run, 2, parent_id=good)
    finally:
        c.close()
    control = tmp_path / "control"
    lastgood("download", str(cid), str(control), url=service.url)
    assert (control / "rank0" / "rank00000.safetensors").read_bytes() == shards[0]

    blob = shard_blob(service, cid, 0)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    blob.write_bytes(bytes(data))

    out = tmp_path / "corrupt"
    res = lastgood("download", str(cid), str(out), url=service.url, code=5)
    line = error_line(res)
    assert f"checkpoint {cid} rank 0 file rank00000.safetensors" in line and "xxh3-128" in line
    assert "the partial file was deleted" in line and res.out == ""
    assert files_under(out) == []  # no partial file, no manifest.json

    verify = lastgood("--json", "verify", str(cid), url=service.url, code=5)
    assert verify.json()["ok"] is False and verify.json()["status"] == "CORRUPT"
    assert "failed verification" in error_line(verify)
    # CORRUPT now: last-good went back, and there is no read lease and no download for it
    assert lastgood("--json", "show", f"{run}@last-good", url=service.url).json()["id"] == good
    res = lastgood("download", str(cid), str(tmp_path / "after"), url=service.url, code=4)
    assert f"checkpoint {cid} is CORRUPT" in error_line(res)
    ok = lastgood("verify", str(good), url=service.url)
    assert f"#{good}  ok: the manifest and 1 file re-hash" in ok.out


@pytest.mark.slow
def test_unreachable_silent_and_local_errors(service, tree, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for argv in (["runs"], ["show", "1"], ["download", "1", str(tmp_path / "x")]):
        res = lastgood(*argv, url=closed, code=6)
        assert error_line(res).startswith(f"lastgood: error: cannot reach the lastgood service at {closed}")
    assert not (tmp_path / "x").exists()
    res = lastgood("runs", env={"LASTGOOD_URL": closed}, code=6)  # the URL from the environment
    assert closed in error_line(res)

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        res = lastgood("--timeout", "0.5", "runs", url=url, code=6, timeout=30)
        assert "no answer from the lastgood service" in error_line(res)

    # a local failure: exit 1, one line
    (tmp_path / "file").write_text("not a directory")
    res = lastgood("download", str(tree.f), str(tmp_path / "file" / "sub"), url=service.url, code=1)
    assert "Not a directory" in error_line(res)


BLOCK_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now fails
from lastgood.cli import main
sys.argv = ["lastgood", *sys.argv[1:]]
try:
    main()
finally:
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules if sys.modules[m] is not None)
"""


def test_works_without_torch(service, tree, tmp_path):
    for argv in (["--json", "download", str(tree.b), str(tmp_path / "dl")], ["lineage", tree.run],
                 ["show", str(tree.b)]):
        proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "--url", service.url, *argv],
                              capture_output=True, text=True, env=ENV, timeout=60)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "dl" / "rank1" / "rank00001.safetensors").read_bytes() == tree.shards[tree.b][1]
