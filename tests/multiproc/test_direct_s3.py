"""Direct S3 uploads with real torchrun ranks (gloo on CPU): two ranks save straight to
LocalStack's S3 through their grants, then restore through presigned GETs, at the same
world size and at another one (docs/direct-s3.md; tests/service/test_direct_s3.py has the
single-rank and fault cases)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.launch import torchrun, why
from tests.service.test_direct_s3 import DIRECT, metric

HERE = Path(__file__).parent


def test_two_ranks_save_and_restore_directly(make_service, localstack, ls_bucket, run_name, tmp_path):
    svc = make_service(data_dir=tmp_path / "svc", **localstack.env(ls_bucket), **DIRECT)
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name])
    assert saved.returncode == 0, why(saved)
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["step"] == 2 and len(lg["manifest"]["ranks"]) == 2
    events = svc.get(f"/api/v1/runs/{run_name}/events", params={"limit": 200}).json()["items"]
    uploaded = sorted(e["data"]["rank"] for e in events if e["kind"] == "direct_upload" and e["checkpoint_id"] == lg["id"])
    assert uploaded == [0, 1]

    res = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 2 weight 10.0" in res.stdout and "[rank 1] restored step 2 weight 11.0" in res.stdout
    one = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], nproc=1, timeout=120)
    assert one.returncode == 0, why(one)
    assert "[rank 0] restored step 2 weight 10.0" in one.stdout  # another world size: every old file read
    assert metric(svc, "lastgood_bytes_ingested_total") == metric(svc, "lastgood_bytes_served_total") == 0
    assert localstack.uploads(ls_bucket) == []


def test_two_ranks_check_each_others_objects_in_peer_mode(make_service, s3_server, s3_bucket, run_name, tmp_path):
    """`peer` verification over direct uploads, on moto (which checks no part checksum):
    rank 0 reads rank 1's object back through a presigned GET and rank 1 reads rank 0's,
    before each checkpoint commits; the restore round-trips (docs/direct-s3.md)."""
    svc = make_service(data_dir=tmp_path / "svc", **s3_server.env(s3_bucket),
                       **{**DIRECT, "LASTGOOD_VERIFICATION": "peer"})
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name])
    assert saved.returncode == 0, why(saved)
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 2
    events = svc.get(f"/api/v1/runs/{run_name}/events", params={"limit": 200}).json()["items"]
    checked = sorted((e["data"]["rank"], e["data"]["checked_by"]) for e in events
                     if e["kind"] == "peer_verified" and e["checkpoint_id"] == lg["id"])
    assert checked == [(0, 1), (1, 0)]  # the ring: rank r checks rank r + 1
    res = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 2 weight 10.0" in res.stdout and "[rank 1] restored step 2 weight 11.0" in res.stdout
    assert metric(svc, "lastgood_bytes_ingested_total") == metric(svc, "lastgood_bytes_served_total") == 0
