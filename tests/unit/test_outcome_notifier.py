"""The outcome notifier (domain/commit/outcomes.py): a commit made in this process answers every
waiter of its checkpoint without a catalog read, with one answer made once; a poke that
does not say what was decided (an abort, an expiry) reads the statuses, as before.

The notifier's one seam to the catalog is `read(ids) -> {id: status}`; here it reads a dict
and counts the reads (the service tests run the same code against a real catalog:
tests/service/test_outcome_wait.py, tests/catalog/test_outcome_replicas.py)."""

from __future__ import annotations

import asyncio
import threading

from lastgood_service.domain.commit.outcomes import OutcomeNotifier

CID = 7
WAITERS = 50


def run(coro):
    """asyncio.run(coro) on a thread of its own: in the whole suite the browser tests' sync
    Playwright keeps an event loop running on the main thread, where asyncio.run refuses."""
    out: dict = {}

    def main() -> None:
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=main)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class Catalog:
    def __init__(self) -> None:
        self.status = {CID: "PENDING"}
        self.reads = 0

    def read(self, ids) -> dict[int, str]:
        self.reads += 1
        return {i: self.status[i] for i in ids if i in self.status}


async def _storm(decided: bool) -> tuple[list, int, list, int]:
    """WAITERS ranks wait, the checkpoint commits, then 3 ranks ask: (the waiters' answers,
    the reads so far, the late askers' answers, the reads in all)."""
    catalog = Catalog()
    notifier = OutcomeNotifier(sessions=None, interval=3600, read=catalog.read)  # no periodic poll in this test
    waiters = [asyncio.create_task(notifier.wait(CID, 600)) for _ in range(WAITERS)]
    while catalog.reads < 1:  # the first look at a newly watched checkpoint: still PENDING
        await asyncio.sleep(0.01)
    catalog.status[CID] = "COMMITTED"  # the commit's transaction has committed ...
    # ... and then the committing thread (a gRPC worker, not the loop's) pokes the notifier
    poke = threading.Thread(target=notifier.poke, args=({CID: "COMMITTED"},) if decided else ())
    poke.start()
    poke.join()
    answers = await asyncio.wait_for(asyncio.gather(*waiters), 120)  # a bound on a hang, not a timing assert
    reads = catalog.reads
    again = [await asyncio.wait_for(notifier.wait(CID, 600), 120) for _ in range(3)]  # ranks asking right after
    return answers, reads, again, catalog.reads


def test_a_commit_answers_every_waiter_without_a_catalog_read_and_with_one_answer():
    answers, reads, again, reads_in_all = run(_storm(decided=True))
    assert {(a.checkpoint_id, a.status, tuple(a.missing_ranks)) for a in answers + again} == {(CID, "COMMITTED", ())}
    assert reads == 1  # the first look only: the commit's poke did not read
    assert reads_in_all == 1  # nor did the ranks that asked after it
    assert len({id(a.body) for a in answers + again}) == 1  # the JSON made once, sent to all
    assert answers[0].body == b'{"checkpoint_id":7,"status":"COMMITTED","missing_ranks":[]}'


def test_control_a_poke_that_does_not_say_what_was_decided_reads_the_catalog():
    answers, reads, again, _ = run(_storm(decided=False))
    assert {a.status for a in answers + again} == {"COMMITTED"}
    assert reads == 2  # the first look, then one read for the poke, shared by every waiter


async def _one_waiter():
    """A notifier with one rank waiting on CID, after its first look (still PENDING)."""
    catalog = Catalog()
    notifier = OutcomeNotifier(sessions=None, interval=3600, read=catalog.read)  # no periodic poll
    waiter = asyncio.create_task(notifier.wait(CID, 600))
    while catalog.reads < 1:
        await asyncio.sleep(0.01)
    return catalog, notifier, waiter


async def _committed_then(change: str) -> tuple[str, str]:
    """A commit answered from memory, then the status changes in the catalog (a scrub
    marks it CORRUPT) and the changer pokes without saying what it decided: (the answer
    right after the commit, the answer right after the change)."""
    catalog, notifier, waiter = await _one_waiter()
    catalog.status[CID] = "COMMITTED"
    notifier.poke({CID: "COMMITTED"})
    first = (await asyncio.wait_for(waiter, 120)).status
    catalog.status[CID] = change
    notifier.poke()
    await asyncio.sleep(0.05)  # the poke runs on the loop
    return first, (await asyncio.wait_for(notifier.wait(CID, 600), 120)).status


def test_a_status_changed_after_the_commit_is_not_answered_from_memory():
    """The decided outcome kept for late askers (DECIDED_KEPT_S) must not outlive a later
    change: a checkpoint found CORRUPT right after its commit was answered COMMITTED for
    up to two more seconds."""
    assert run(_committed_then("CORRUPT")) == ("COMMITTED", "CORRUPT")


def test_an_outcome_found_by_a_read_is_not_kept():
    """Only a commit's own poke (made after its transaction) is kept; a read may have raced
    a later change, so what it found answers its waiters and is not remembered."""
    async def look() -> int:
        catalog, notifier, waiter = await _one_waiter()
        catalog.status[CID] = "ABANDONED"
        notifier.poke()
        assert (await asyncio.wait_for(waiter, 120)).status == "ABANDONED"
        before = catalog.reads
        assert (await asyncio.wait_for(notifier.wait(CID, 600), 120)).status == "ABANDONED"
        return catalog.reads - before
    assert run(look()) == 1
