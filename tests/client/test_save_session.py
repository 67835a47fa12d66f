"""The save session on its own (lastgood/commit/), against a real service: one rank saves
several files in one checkpoint through either data path, and the vote names them all;
what a path prepared and did not send is removed when begin is refused."""

from __future__ import annotations

import os

import pytest

from lastgood.errors import InvalidArgument
from lastgood.wire.hashing import hash_bytes
from lastgood.commit.session import SaveSession
from lastgood.datapath.paths import SpoolPath, StreamPath
from lastgood.datapath.transport import Transport
from tests.conftest import through_its_data_path


@pytest.fixture
def transport(service):
    t = Transport(service.url)
    yield t
    t.close()


def spool_files(t: Transport) -> list[str]:
    return sorted(n for n in os.listdir(t.spool["dir"]) if not n.startswith("."))


@pytest.mark.parametrize("path, follow, carried", [(StreamPath, False, True), (StreamPath, False, False),
                                                   (SpoolPath, False, False), (SpoolPath, True, False)],
                         ids=["with-the-vote", "stream", "spool-written-whole", "spool-followed"])
def test_a_rank_saves_several_files_in_one_checkpoint(transport, run_name, path, follow, carried):
    files = {f"part{i}.bin": os.urandom(1000 + 7 * i) for i in range(3)}
    transport.spool["follow"] = follow
    if not carried:
        through_its_data_path(transport)
    session = SaveSession(transport, run_name, 0, commit_timeout=60, path=path(transport))
    up = session.checkpoint(1)
    for name, data in files.items():
        up.add(name, data)
    # on the service's host the spool takes the bytes before begin: the store has them
    # already; a followed file is written after begin, and begin checks there is room for it
    assert [h.expected_bytes for h in up.files] == ([0, 0, 0] if path is SpoolPath and not follow else
                                                    [len(d) for d in files.values()])
    cid = up.begin(1, "a1")
    up.commit()
    assert session.parent_id == cid and transport.checkpoint(cid)["status"] == "COMMITTED"
    stored = {f.name: f.xxh3_128 for f in transport.manifest(cid).files(0)}
    assert stored == {name: hash_bytes(data) for name, data in files.items()}
    assert session.committed_with(cid, up.digests)
    assert spool_files(transport) == []


def test_what_a_path_prepared_is_discarded_when_begin_is_refused(transport, run_name):
    transport.spool["follow"] = False  # written into the spool before begin
    through_its_data_path(transport)
    session = SaveSession(transport, run_name, 0, commit_timeout=60, path=SpoolPath(transport))
    up = session.checkpoint(1)
    up.add("a.bin", b"x" * 4096)
    assert len(spool_files(transport)) == 1  # control: prepared means written into the spool
    with pytest.raises(InvalidArgument):
        up.begin(0, "a1")  # world size 0: refused
    assert spool_files(transport) == []
