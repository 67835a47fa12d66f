"""The production configuration end to end: a real service process with its catalog on
PostgreSQL (tests/pg.py) and its blobs in S3 (moto's S3 server, tests/s3.py), used the way
a trainer and an operator use it: lastgood.Checkpointer saves and restores, curl-style REST
downloads a shard."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

import lastgood
from lastgood.wire.hashing import hash_bytes
from lastgood_service.domain import keys


def make_training(seed: int):
    torch.manual_seed(seed)
    # big enough that a rank's shard (weights + two Adam moments) spans several 5 MiB S3 parts
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


@pytest.mark.slow  # a PostgreSQL server, an S3 server and a service of its own
def test_save_restore_and_download_on_s3_and_postgres(make_service, pg_server, pg_url, s3_server, s3_bucket,
                                                      run_name, tmp_path):
    svc = make_service(data_dir=tmp_path / "svc", LASTGOOD_CATALOG_URL=pg_url, **s3_server.env(s3_bucket))
    assert svc.get("/healthz").status_code == 200

    model, opt = make_training(0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
    progress = {"epoch": 3}
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        ckpt.save(5, lastgood.TrainState(model=model, optimizer=opt, extra=progress))
        ckpt.wait()

    model2, opt2 = make_training(1)
    progress2: dict = {}
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2, extra=progress2)) == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, opt2.state_dict()["state"][i][k]), (i, k)
    assert progress2 == progress

    # an operator's view over REST
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"})
    assert lg.status_code == 200
    view = lg.json()
    cid = view["id"]
    entry = view["manifest"]["ranks"][0]["files"][0]
    url = f"{svc.url}/api/v1/checkpoints/{cid}/ranks/0/files/{entry['name']}"
    with httpx.stream("GET", url, timeout=60) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_bytes())
    assert len(body) == entry["size"] > 10 * 1024 * 1024
    assert hash_bytes(body) == entry["xxh3_128"] == r.headers["x-lastgood-xxh3-128"]
    part = httpx.get(url, headers={"Range": "bytes=5242870-5242889"}, timeout=60)  # across the first part boundary
    assert part.status_code == 206 and part.content == body[5242870:5242890]

    # where the bytes and the rows really are: S3 and PostgreSQL, nothing on local disk
    client = s3_server.client()
    names = sorted(o.object_name for o in client.list_objects(bucket_name=s3_bucket, recursive=True))
    prefix = keys.prefix(cid, run_name, view["step"], view["attempt"])
    assert keys.manifest_key(prefix) in names
    assert keys.shard_key(prefix, 0, entry["xxh3_128"]) in names
    assert client._list_multipart_uploads(bucket_name=s3_bucket).uploads == []
    stat = client.stat_object(bucket_name=s3_bucket, object_name=keys.shard_key(prefix, 0, entry["xxh3_128"]))
    assert "-" in stat.etag, "a shard this size is uploaded in parts"
    with pg_server.connect(pg_url.rsplit("/", 1)[1]) as c:
        assert c.execute("SELECT status FROM checkpoints WHERE id = %s", (cid,)).fetchone() == ("COMMITTED",)
        assert c.execute("SELECT r.last_good_id FROM runs r WHERE r.name = %s", (run_name,)).fetchone() == (cid,)
    assert not (tmp_path / "svc" / "catalog.db").exists() and not (tmp_path / "svc" / "blobs").exists()
