"""Checkpoint metadata at scale (docs/architecture.md, "Checkpoint metadata"): a restoring
rank fetches the small root manifest and nothing of the other ranks' tensor indexes, and a
checkpoint committed with the old monolithic manifest (format 1) still restores and shows."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import Manifest

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import ckpt_dir, index_blob

HERE = Path(__file__).parent


def fetched(out: Path, rank: int) -> dict:
    return json.loads((out / f"fetched-rank{rank}.json").read_text())


def test_each_rank_fetches_the_root_and_no_other_ranks_index(make_service, run_name, tmp_path):
    svc = make_service()
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name])
    assert saved.returncode == 0, why(saved)
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    cid = lg["id"]
    assert lg["step"] == 2 and "manifest" not in lg  # last-good answers without the manifest
    full = svc.get(f"/api/v1/checkpoints/{cid}").json()["manifest"]
    root = svc.get(f"/api/v1/checkpoints/{cid}/manifest").content
    assert json.loads(root)["format"] == "lastgood.manifest/2" and len(root) < len(json.dumps(full))

    res = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 2 weight 10.0" in res.stdout and "[rank 1] restored step 2 weight 11.0" in res.stdout
    for rank in (0, 1):
        paths = fetched(tmp_path, rank)["paths"]
        # counted at the client's REST transport: the root once, no other rank's index
        assert paths.get(f"/api/v1/checkpoints/{cid}/manifest") == 1, paths
        others = [p for p in paths if "/index/" in p and f"/ranks/{rank}/" not in p]
        assert others == [], paths
        assert set(paths) <= {f"/api/v1/checkpoints/{cid}/manifest", f"/api/v1/runs/{run_name}/last-good",
                              *(p for p in paths if f"/ranks/{rank}/index/" in p)}, paths
        assert fetched(tmp_path, rank)["bytes"] < len(root) + 4096  # the root and a last-good view, no more


def test_a_format_1_checkpoint_still_restores_and_shows(make_service, run_name, tmp_path):
    """The state an older service left: a monolithic manifest, the index in the catalog's
    rows, no index objects. Written here from the same checkpoint's full view."""
    svc = make_service()
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name])
    assert saved.returncode == 0, why(saved)
    cid = svc.get(f"/api/v1/runs/{run_name}/last-good").json()["id"]
    full = svc.get(f"/api/v1/checkpoints/{cid}").json()["manifest"]
    old = Manifest.from_dict(full).as_monolithic()
    body = old.to_bytes()
    assert json.loads(body)["format"] == "lastgood.manifest/1" and b'"tensors"' in body
    (ckpt_dir(svc, cid) / "manifest.json").write_bytes(body)
    for rank in (0, 1):
        index_blob(svc, cid, rank).unlink()
    with sqlite3.connect(svc.data_dir / "catalog.db") as db:
        db.execute("UPDATE checkpoints SET manifest_hash = ? WHERE id = ?", (hash_bytes(body), cid))
        for rank, files in old.ranks.items():
            for f in files:
                db.execute("UPDATE shards SET index_json = ? WHERE checkpoint_id = ? AND rank = ? AND file_name = ?",
                           (json.dumps({"data_start": f.data_start, "tensors": f.tensors}), cid, rank, f.name))

    assert svc.get(f"/api/v1/checkpoints/{cid}/manifest").content == body
    view = svc.get(f"/api/v1/checkpoints/{cid}").json()
    assert view["status"] == "COMMITTED" and view["manifest"] == json.loads(body)  # shown as it was
    res = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 2 weight 10.0" in res.stdout and "[rank 1] restored step 2 weight 11.0" in res.stdout
    assert svc.get(f"/api/v1/checkpoints/{cid}").json()["status"] == "COMMITTED"
