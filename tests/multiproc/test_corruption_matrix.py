"""The corruption matrix: every way a committed last-good can be damaged in the store ends,
on a relaunch of a 2-rank job, in a restore of the newest good ancestor, bit for bit, on
every rank alike; the damaged checkpoint is CORRUPT and last-good has moved back to it.

One torchrun job saves steps 1..3 in one run per case; the test damages each run's
checkpoints as its case says; one relaunch restores every run (lineage_restore.py) and
the cases check its lines. Shard damage hits one rank's file only, so the other rank must
fall back although its own file is intact. Shards are read as links in the service's
spool by default and as gRPC streams in the `-stream` cases.

Controls: `intact` restores step 3; `fresh` (a run that never saved) answers None; when
every checkpoint is damaged, the answer is a refusal on every rank, never None.
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import pytest

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import ckpt_dir, shard_blob

HERE = Path(__file__).parent
SEED = int(os.environ.get("LASTGOOD_MATRIX_SEED") or random.SystemRandom().randrange(2**32))


def shard(svc, cid: int, rank: int) -> Path:
    return shard_blob(svc, cid, rank)


def manifest(svc, cid: int, rank: int = 0) -> Path:
    return ckpt_dir(svc, cid) / "manifest.json"


def flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"bit flipped at byte {at} of {len(data)}"


def truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    keep = rng.randrange(size)
    os.truncate(path, keep)
    return f"truncated to {keep} of {size} bytes"


def extend(path: Path, rng: random.Random) -> str:
    extra = rng.randrange(1, 4096)
    with open(path, "ab") as f:
        f.write(rng.randbytes(extra))
    return f"extended by {extra} bytes"


def delete(path: Path, rng: random.Random) -> str:
    path.unlink()
    return "deleted"


# case -> (damage per step: (where, what, rank)), the step every rank must restore
# (None: no checkpoint; "refused": a refusal), read as a stream?
CASES = {
    "intact": ({}, 3, False),
    "shard-flip": ({3: (shard, flip, "random")}, 2, False),
    "shard-truncate": ({3: (shard, truncate, 1)}, 2, False),
    "shard-extend": ({3: (shard, extend, 0)}, 2, False),
    "shard-delete": ({3: (shard, delete, 1)}, 2, False),
    "shard-flip-stream": ({3: (shard, flip, "random")}, 2, True),
    "shard-truncate-stream": ({3: (shard, truncate, 0)}, 2, True),
    "shard-extend-stream": ({3: (shard, extend, 1)}, 2, True),
    "manifest-flip": ({3: (manifest, flip, 0)}, 2, False),
    "manifest-delete": ({3: (manifest, delete, 0)}, 2, False),
    # the first fallback is damaged too (its manifest): the walk goes on to step 1
    "chain": ({3: (shard, truncate, 1), 2: (manifest, flip, 0)}, 1, False),
    "all-damaged": ({3: (shard, flip, 0), 2: (manifest, delete, 0), 1: (shard, extend, 1)}, "refused", False),
    "fresh": (None, None, False),
}


@pytest.fixture(scope="module")
def matrix(service, tmp_path_factory):
    tag = uuid.uuid4().hex[:6]
    runs = {case: f"matrix-{case}-{tag}" for case in CASES}
    saved = torchrun(HERE / "lineage_save.py",
                     [service.url, *(runs[c] for c, (damage, _, _) in CASES.items() if damage is not None)])
    assert saved.returncode == 0, why(saved)

    rng = random.Random(SEED)
    ids, notes = {}, {}
    for case, (damage, _, _) in CASES.items():
        if damage is None:
            continue
        items = service.get(f"/api/v1/runs/{runs[case]}/checkpoints").json()["items"]
        ids[case] = {c["step"]: c["id"] for c in items if c["status"] == "COMMITTED"}
        assert sorted(ids[case]) == [1, 2, 3], items
        for step, (where, what, rank) in damage.items():
            rank = rng.randrange(2) if rank == "random" else rank
            path = where(service, ids[case][step], rank)
            notes[(case, step)] = f"{path.relative_to(service.blob_root)}: {what(path, rng)}"

    out = tmp_path_factory.mktemp("matrix")
    relaunch = torchrun(HERE / "lineage_restore.py",
                        [service.url, str(out), *(runs[c] + (":stream" if s else "") for c, (_, _, s) in CASES.items()),
                         runs["all-damaged"] + ":again"],  # now the service itself answers "none usable"
                        timeout=240)
    assert relaunch.returncode == 0, why(relaunch)
    results: dict[str, dict[int, tuple[str, str]]] = {}
    for rank in (0, 1):
        for line in (out / f"results-rank{rank}.txt").read_text().splitlines():
            spec, got, exact = line.split()
            results.setdefault(spec.removesuffix(":stream"), {})[rank] = (got, exact)
    return {"runs": runs, "ids": ids, "notes": notes, "results": results, "output": relaunch}


def status(service, cid: int) -> str:
    return service.get(f"/api/v1/checkpoints/{cid}").json()["status"]


@pytest.mark.parametrize("case", list(CASES))
def test_damage_falls_back_to_the_newest_good_ancestor(service, matrix, case):
    damage, want, _ = CASES[case]
    run = matrix["runs"][case]
    got = matrix["results"].get(run, {})
    context = (f"seed {SEED}; damage: {[n for (c, _), n in matrix['notes'].items() if c == case]}; restored: {got}\n"
               + "\n".join(line for line in matrix["output"].stdout.splitlines() if run in line))

    if want is None:  # a run that never saved: no checkpoint, and that is not an error
        assert got == {0: ("None", "-"), 1: ("None", "-")}, context
        return
    ids = matrix["ids"][case]
    for step in damage:
        assert status(service, ids[step]) == "CORRUPT", f"step {step} is not CORRUPT; {context}"
    lg = service.get(f"/api/v1/runs/{run}/last-good")
    if want == "refused":
        # every rank refuses alike; the service says why there is no last-good (not 'no checkpoint')
        refused = {0: ("refused:NoUsableCheckpoint", "-"), 1: ("refused:NoUsableCheckpoint", "-")}
        assert got == refused, context
        assert lg.status_code == 409 and lg.json()["error"]["code"] == "no_usable_checkpoint", lg.text
        assert matrix["results"].get(run + ":again") == refused, context  # and so does the next relaunch
        return
    assert got == {0: (str(want), "bitwise"), 1: (str(want), "bitwise")}, context
    assert lg.status_code == 200 and lg.json()["id"] == ids[want], lg.text
    for step in set(ids) - set(damage):
        assert status(service, ids[step]) == "COMMITTED", f"step {step} lost its status; {context}"
