"""DCP's StorageWriter goes through the Checkpointer's save session (lastgood/commit/): a
lost CommitRank reply is checked with the service instead of failing a save that
committed; an unanswerable check says "outcome unknown", not a false failure; on the
service's host the files are handed over through the spool; a save whose commit spans a
service restart finishes once the service is back. One process, no process group (DCP's
single-rank mode): the session is the same code for every rank."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import lastgood
from lastgood import dcp as lgdcp
from tests.service.helpers import ckpt_dir
from tests.conftest import through_its_data_path


def state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 32), "b": torch.randn(32), "meta": {"epoch": 3, "name": "x"}}


def save(url: str, run: str, step: int = 5, sd: dict | None = None) -> None:
    dcp.save(sd or state(), storage_writer=lgdcp.StorageWriter(url, run=run), checkpoint_id=str(step),
             planner=lgdcp.SavePlanner())


def assert_loads_back(url: str, run: str, step: int = 5) -> dict:
    """The run's last-good is the DCP save of `step`, and it loads back exactly."""
    lg = httpx_json(url, f"/api/v1/runs/{run}/last-good")
    assert lg["step"] == step and lg["status"] == "COMMITTED"
    got = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "meta": {"epoch": 0, "name": ""}}
    dcp.load(got, storage_reader=lgdcp.StorageReader(url, run=run), planner=lgdcp.LoadPlanner())
    want = state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["meta"] == want["meta"]
    return lg


def httpx_json(url: str, path: str):
    import httpx

    r = httpx.get(url + path, timeout=30)
    r.raise_for_status()
    return r.json()


def failures(e: CheckpointException) -> list[BaseException]:
    """The exceptions DCP gathered from its ranks (each kept with its traceback)."""
    return [exc for exc, _trace in e.failures.values()]


@pytest.mark.slow  # a service of its own, armed with a failpoint
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group: single rank" warning
def test_a_lost_commit_reply_of_a_dcp_save_is_not_a_failed_save(make_service, run_name):
    """The service commits, then the coordinator's vote reply is lost (a non-retryable
    INTERNAL): the writer asks, finds its own files committed, and dcp.save returns.
    Before the session, dcp.save raised although the checkpoint had committed."""
    svc = make_service(LASTGOOD_FAILPOINT="lose_commit_reply")
    save(svc.url, run_name)
    assert "lose_commit_reply" in svc.log.read_text()  # control: the reply really was lost
    assert_loads_back(svc.url, run_name)


@pytest.mark.slow  # a service of its own, armed with a failpoint
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_lost_reply_with_the_manifest_unreadable_is_unknown_not_failed(make_service, run_name, monkeypatch):
    """The reply is lost and the check cannot read the manifest (a proxy answers 503): the
    save reports that its outcome is unknown - it did commit - instead of a plain failure,
    and leaves the checkpoint alone (an abort of a committed checkpoint is refused anyway)."""
    from .proxy import proxy

    monkeypatch.setenv("LASTGOOD_RETRY_DEADLINE", "2")
    svc = make_service(LASTGOOD_FAILPOINT="lose_commit_reply")
    with proxy(svc.url, "/api/v1/checkpoints/1/manifest", 503) as (url, _handler):
        with pytest.raises(CheckpointException) as raised:
            save(url, run_name)
    [err] = failures(raised.value)
    assert isinstance(err, lastgood.SaveFailed) and "outcome unknown" in str(err), repr(err)
    assert httpx_json(svc.url, "/api/v1/checkpoints/1")["status"] == "COMMITTED"  # the true outcome


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("follow", [True, False], ids=["followed", "written-whole"])
def test_a_dcp_save_hands_its_files_over_through_the_spool(service, run_name, spool_inodes, follow):
    """On the service's host the shard and DCP's metadata are written into the spool and
    adopted as the blobs (the very inodes), not streamed: followed by the service as they
    are written, or handed over once written."""
    writer = lgdcp.StorageWriter(service.url, run=run_name)
    assert writer.transport.spool is not None and writer.transport.spool["follow"]
    writer.transport.spool["follow"] = follow
    through_its_data_path(writer.transport)
    dcp.save(state(), storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
    lg = assert_loads_back(service.url, run_name)
    blobs = {p.stat().st_ino for p in (ckpt_dir(service, lg["id"]) / "r0").iterdir()
             if p.is_file() and not p.name.endswith(".index")}
    assert len(spool_inodes) == 2 and spool_inodes == blobs, (spool_inodes, blobs)  # the shard and the metadata


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dcp_save_whose_commit_spans_a_service_restart_commits(make_service, run_name):
    """The service dies between writing the manifest and its commit transaction (the
    coordinator's vote unanswered) and comes back on the same data: the writer retries
    with backoff meanwhile, hears COMMITTED (rolled forward at start-up) and returns."""
    svc = make_service(LASTGOOD_FAILPOINT="crash_after_manifest", LASTGOOD_LEASE_SECONDS="60")
    outcome: list = []

    def run() -> None:
        try:
            save(svc.url, run_name)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert svc.wait_exit(60) == 77  # the failpoint: died between the manifest and the commit
    time.sleep(3)  # down for a while: the writer's calls fail and back off
    svc.env.pop("LASTGOOD_FAILPOINT")
    svc.restart()
    t.join(120)
    assert outcome == [None], outcome
    assert_loads_back(svc.url, run_name)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.slow
def test_a_dcp_file_written_longer_than_the_lease_still_commits(make_service, run_name, monkeypatch):
    """A rank writes its file before it begins the checkpoint (as the Checkpointer does), so
    a long write (a big shard into the spool, telling the service nothing meanwhile) cannot
    run into the checkpoint's lease. Control: the same slow write after begin, which is what
    the writer did when the coordinator began in prepare_global_plan, lets the lease lapse."""
    svc = make_service()  # the test lease: 3 s
    writer = lgdcp.StorageWriter(svc.url, run=run_name)
    assert writer.transport.spool is not None
    # files handed over once written (a followed file renews the lease with every piece the
    # service reads: tests/service/test_spool_follow.py)
    writer.transport.spool["follow"] = False
    through_its_data_path(writer.transport)  # the small shard through the spool, not with the vote
    real = writer.transport.spool_write

    def slow(data, hasher=None):  # a shard takes 5 s to write, longer than the lease (DCP's metadata not)
        if memoryview(data).nbytes > 4096:
            time.sleep(5)
        return real(data, hasher)

    monkeypatch.setattr(writer.transport, "spool_write", slow)
    dcp.save(state(), storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
    assert_loads_back(svc.url, run_name)

    # control: begun first, then written as slowly: the checkpoint is ABANDONED under the write
    from lastgood.commit.session import SaveSession

    up = SaveSession(writer.transport, run_name, 0, commit_timeout=30).checkpoint(6, rank=0)
    cid = up.begin(1, "control")
    up.add("rank00000.safetensors", memoryview(bytes(8192)))
    with pytest.raises(lastgood.SaveFailed, match="ABANDONED"):
        up.commit()
    assert httpx_json(svc.url, f"/api/v1/checkpoints/{cid}")["status"] == "ABANDONED"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_writer_holds_no_copy_of_its_shard_after_the_save(service, run_name):
    """A writer kept for the next save (as with dcp.async_save) must not keep the last
    save's host copy of the shard: its handles drop the bytes once the service has them."""
    writer = lgdcp.StorageWriter(service.url, run=run_name)
    dcp.save(state(), storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
    assert writer._upload.files and all(h.data.nbytes == 0 for h in writer._upload.files)
    assert_loads_back(service.url, run_name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_reused_writer_continues_from_its_own_commit_without_asking_for_last_good(service, run_name):
    """A writer that saves again takes its previous commit as the parent (as the
    Checkpointer does): the run's last-good is asked for once, at the first save only, and
    the second checkpoint's parent is the first. A small coordinator shard is sent with
    DCP's metadata in finish(), and both load back."""
    writer = lgdcp.StorageWriter(service.url, run=run_name)
    asked = []
    real = writer.transport.last_good
    writer.transport.last_good = lambda run, **kw: asked.append(run) or real(run, **kw)  # counts, then asks
    dcp.save(state(), storage_writer=writer, checkpoint_id="4", planner=lgdcp.SavePlanner())
    first = writer.checkpoint_id
    dcp.save(state(), storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
    assert asked == [run_name]  # the first save only
    lg = assert_loads_back(service.url, run_name)
    assert lg["id"] == writer.checkpoint_id and lg["parent_id"] == first
