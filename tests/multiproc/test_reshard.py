"""FSDP2 with AdamW restored at another world size (docs/resharding.md): every full tensor
(weights, Adam moments, steps) identical, no sample of the epoch repeated or skipped, and
each rank reads only its ranges: at most its new shards, the replicated state, the old
files' headers and the segment rounding (counted at its transport). A flipped byte in a
range one rank reads makes the checkpoint CORRUPT and every rank falls back; a checkpoint
without range digests (written before them) is read whole, as before, and still restores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lastgood.wire.format import header_length, parse_header, parse_state
from lastgood.wire.ranges import MIN_BLOCK

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import ckpt_dir, shard_blob, wait_status
from lastgood_service.domain import keys

SCRIPT = Path(__file__).with_name("fsdp_reshard.py")
BLOCK = MIN_BLOCK  # the smallest the service accepts: ranges cut through the stored shards of layer 0


def full(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save(svc, run: str, out: Path, nproc: int, env: dict | None = None) -> dict:
    saved = torchrun(SCRIPT, ["save", svc.url, run, str(out)], nproc=nproc, env=env)
    assert saved.returncode == 0, why(saved)
    lg = svc.get(f"/api/v1/runs/{run}/last-good").json()
    assert lg["world_size"] == nproc and lg["step"] == 2
    return svc.get(f"/api/v1/checkpoints/{lg['id']}").json()  # the full view, with tensors


def restore(svc, run: str, out: Path, nproc: int, step: int = 2, spool: str = "1"):
    res = torchrun(SCRIPT, ["restore", svc.url, run, str(out), str(step)], nproc=nproc, env={"LASTGOOD_USE_SPOOL": spool})
    assert res.returncode == 0, why(res)
    return res


def assert_round_trip(saved: Path, restored: Path, before: int, after: int) -> None:
    a, b = full(saved / "full-save.safetensors"), full(restored / "full-restore.safetensors")
    assert sorted(a) == sorted(b) and any(k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    seen = [i for r in range(before) for i in json.loads((saved / f"ids-save-rank{r}.json").read_text())]
    rest = [i for r in range(after) for i in json.loads((restored / f"ids-restore-rank{r}.json").read_text())]
    assert sorted(seen + rest) == list(range(48))  # each sample of the epoch exactly once


def read(out: Path, rank: int) -> dict:
    return json.loads((out / f"read-rank{rank}.json").read_text())


def stored(svc, ckpt: dict, r: int) -> tuple[dict, dict]:
    """Old rank r's tensors (its first file's) and its DTensor shards, wherever its files
    hold them (state/split.py): name -> (global rows, first row, rows)."""
    files = ckpt["manifest"]["ranks"][r]["files"]
    f = next(f for f in files if f["name"] == f"rank{r:05d}.safetensors")
    shapes = {n: t["shape"] for g in files for n, t in g["tensors"].items()}
    body = svc.get(f"/api/v1/checkpoints/{ckpt['id']}/ranks/{r}/files/{f['name']}").content
    tensors, meta = parse_header(body[:header_length(body)])
    shards = {}
    todo = [parse_state(meta, tensors)]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if "__dtensor__" in node:
                name = node["__dtensor__"]
                shards[name] = (node["shape"][0], node["offset"][0], shapes[name][0])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return tensors, shards


def needed_files(svc, ckpt: dict, rank: int, after: int) -> list[int]:
    """The old ranks whose files new rank `rank` of `after` must read: its source (old rank
    min(rank, old world - 1): the replicated state) and every one holding rows of its new
    shards (FSDP2 cuts n rows into chunks of ceil(n / world), the last ones shorter)."""
    old = len(ckpt["manifest"]["ranks"])
    out = {min(rank, old - 1)}
    for r in range(old):
        for n, first, rows in stored(svc, ckpt, r)[1].values():
            per = -(-n // after)
            lo, hi = min(rank * per, n), min((rank + 1) * per, n)
            if rows and first < hi and lo < first + rows:
                out.add(r)
    return sorted(out)


def bound(svc, ckpt: dict, rank: int, counted: dict, after: int) -> int:
    """What a rank may read: its new shards, the replicated state of its source file (every
    tensor that is not a DTensor shard, found in the stored state), the headers of the old
    files it needs (needed_files), and up to one block of rounding at each end of each
    request."""
    files = [r["files"][0] for r in ckpt["manifest"]["ranks"]]
    tensors, shards = stored(svc, ckpt, min(rank, len(files) - 1))
    assert shards, "the model's shards are DTensors"
    replicated = sum(b - a for n, t in tensors.items() if n not in shards for a, b in [t["data_offsets"]])
    headers = sum(files[r]["data_start"] for r in needed_files(svc, ckpt, rank, after))
    return counted["new_shard_bytes"] + replicated + headers + 2 * BLOCK * counted["requests"]


@pytest.mark.parametrize("before,afters,spool", [(4, (2, 3, 8), "1"), (2, (4,), "0")])
def test_fsdp2_restores_at_another_world_size_reading_only_its_ranges(make_service, run_name, tmp_path,
                                                                       before, afters, spool):
    """Ranges read from the service's spool (pread of a link, same host), and streamed."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(BLOCK))
    ckpt = save(svc, run_name, tmp_path / "save", before)
    total = sum(r["files"][0]["size"] for r in ckpt["manifest"]["ranks"])
    assert all("digests" in r["files"][0] for r in ckpt["manifest"]["ranks"])
    for after in afters:
        out = tmp_path / f"on{after}"
        restore(svc, run_name, out, after, spool=spool)
        assert_round_trip(tmp_path / "save", out, before, after)
        for rank in range(after):
            counted = read(out, rank)
            assert 0 < counted["shard_bytes"] <= bound(svc, ckpt, rank, counted, after) < total, (after, rank, counted)
            # only the old files it needs: their headers, and their index objects (the root says which)
            need = needed_files(svc, ckpt, rank, after)
            assert counted["reads"]["header_bytes"] == sum(
                r["files"][0]["data_start"] for r in [ckpt["manifest"]["ranks"][i] for i in need]), (after, rank, need)
            assert counted["reads"]["index_bytes"] == sum(
                r["files"][0]["index"]["size"] for r in [ckpt["manifest"]["ranks"][i] for i in need])
            assert (counted["lent"] == counted["requests"]) if spool == "1" else counted["lent"] == 0, counted


def test_without_range_digests_files_are_read_whole_and_restore(make_service, run_name, tmp_path):
    """A checkpoint as the service wrote it before range digests (LASTGOOD_RANGE_BLOCK_BYTES=0
    writes none): each rank reads every old file whole, which is over the bound above (the
    control of the bound), and the restore is still exact."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES="0")
    ckpt = save(svc, run_name, tmp_path / "save", 4)
    assert not any("digests" in r["files"][0] for r in ckpt["manifest"]["ranks"])
    total = sum(r["files"][0]["size"] for r in ckpt["manifest"]["ranks"])
    restore(svc, run_name, tmp_path / "on3", 3)
    assert_round_trip(tmp_path / "save", tmp_path / "on3", 4, 3)
    for rank in range(3):
        counted = read(tmp_path / "on3", rank)
        assert counted["shard_bytes"] == total and counted["requests"] == 0
        assert counted["shard_bytes"] > bound(svc, ckpt, rank, counted, 3)


def test_a_damaged_range_one_rank_reads_falls_back_on_every_rank(make_service, run_name, tmp_path):
    """Old rank 3 of 4 holds rows 24..29 of layer 0's weight; restored on 2 ranks, only new
    rank 1 (rows 15..29) reads them. One flipped byte there: rank 1's range does not verify,
    the checkpoint turns CORRUPT, and both ranks restore its parent, step 1."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(BLOCK))
    ckpt = save(svc, run_name, tmp_path / "save", 4)
    f = ckpt["manifest"]["ranks"][3]["files"][0]
    start, end = f["tensors"]["model.0.weight"]["offsets"]
    blob = shard_blob(svc, ckpt["id"], 3)
    data = bytearray(blob.read_bytes())
    data[f["data_start"] + end - 1] ^= 0x01
    blob.write_bytes(bytes(data))

    res = restore(svc, run_name, tmp_path / "on2", 2, step=1)
    assert "[rank 0] restored step 1" in res.stdout and "[rank 1] restored step 1" in res.stdout
    assert "(tensor 'model.0.weight') hash to" in res.stdout + res.stderr
    assert wait_status(svc, ckpt["id"], "CORRUPT")["status"] == "CORRUPT"
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 1


def test_a_restore_that_finds_nothing_usable_leaves_the_optimizer_untouched(make_service, run_name, tmp_path):
    """Both checkpoints damaged in a range new rank 1 reads: the restore ends in
    NoUsableCheckpoint on both ranks, and neither rank's fresh optimizer took a step (its
    state is still empty: planning the reads must not give it moments before the ranks agree)."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(BLOCK))
    ckpt = save(svc, run_name, tmp_path / "save", 4)
    for cid in (ckpt["id"], ckpt["manifest"]["parent_id"]):
        f = svc.get(f"/api/v1/checkpoints/{cid}").json()["manifest"]["ranks"][3]["files"][0]
        blob = shard_blob(svc, cid, 3)
        data = bytearray(blob.read_bytes())
        data[f["data_start"] + f["tensors"]["model.0.weight"]["offsets"][1] - 1] ^= 0x01
        blob.write_bytes(bytes(data))
    res = restore(svc, run_name, tmp_path / "on2", 2, step=0)
    for rank in range(2):
        assert f"[rank {rank}] no usable checkpoint; optimizer state: 0" in res.stdout, why(res)


def test_control_each_rank_stores_only_its_own_shard(service, run_name, tmp_path):
    saved = torchrun(SCRIPT, ["save", service.url, run_name, str(tmp_path)], nproc=2)
    assert saved.returncode == 0, why(saved)
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    manifest = service.get(f"/api/v1/checkpoints/{lg['id']}").json()["manifest"]  # the full view, with tensors
    shapes = [{name: t["shape"] for name, t in r["files"][0]["tensors"].items()} for r in manifest["ranks"]]
    # layer 0's weight is 30x1024 in full: each rank holds 15 rows, not all 30
    assert shapes[0]["model.0.weight"] == [15, 1024] and shapes[1]["model.0.weight"] == [15, 1024]
    assert shapes[0]["optimizer.state.0.weight.exp_avg"] == [15, 1024]


def save_split(svc, run: str, out: Path) -> dict:
    """4 ranks, each state split into several files (state/split.py); the full view."""
    ckpt = save(svc, run, out, 4, env={"LASTGOOD_FILE_BYTES": "16K"})
    assert all(len(r["files"]) >= 2 for r in ckpt["manifest"]["ranks"]), ckpt["manifest"]["ranks"]
    return ckpt


def test_ranks_split_into_files_restore_at_another_world_size_reading_only_their_ranges(make_service, run_name,
                                                                                         tmp_path):
    """Each of 4 ranks' states split into several files (LASTGOOD_FILE_BYTES, state/split.py),
    restored on 2: each rank reads by verified ranges from whichever file holds each tensor,
    at most its new shards, its source rank's replicated state, every old file's header and
    the rounding; never every file whole (as it did before: the control is the first assert
    on `reads`). Bit-exact, each sample of the epoch once."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(BLOCK))
    ckpt = save_split(svc, run_name, tmp_path / "save")
    ranks = ckpt["manifest"]["ranks"]
    assert all("digests" in f for r in ranks for f in r["files"])
    files = [f for r in ranks for f in r["files"]]
    total = sum(f["size"] for f in files)
    headers = sum(f["data_start"] for f in files)
    out = tmp_path / "on2"
    restore(svc, run_name, out, 2)
    assert_round_trip(tmp_path / "save", out, 4, 2)
    assert all(f["index"].get("chunks") is not None for r in ranks for f in r["files"]
               if f["name"] == f"rank{r['rank']:05d}.safetensors")
    for rank in range(2):
        counted = read(out, rank)
        assert counted["reads"] is not None, counted  # read by ranges, not whole
        src = min(rank, len(ranks) - 1)
        shards = stored(svc, ckpt, src)[1]
        replicated = sum(b - a for f in ranks[src]["files"] for n, t in f["tensors"].items() if n not in shards
                         for a, b in [t["offsets"]])
        limit = counted["new_shard_bytes"] + replicated + headers + 2 * BLOCK * counted["requests"]
        assert 0 < counted["shard_bytes"] <= limit, (rank, counted, limit)
        assert counted["shard_bytes"] < 0.6 * total, (rank, counted, total)  # about half: its half of the model
        # only the old ranks it needs are opened: the first file's summary covers the rank's
        # further files too (format.META_FILE_SHAPES); rank 0 of 2 needs old ranks 0 and 1
        assert counted["reads"]["old_files_read"] == len(needed_files(svc, ckpt, rank, 2)) < 4, counted


def test_a_damaged_range_in_a_further_file_falls_back_on_every_rank(make_service, run_name, tmp_path):
    """Split as above; one flipped byte in a DTensor shard that old rank 3 holds in one of
    its further files, which new rank 1 of 2 reads (it takes the last rows of every
    tensor): the range does not verify, the checkpoint turns CORRUPT, both ranks restore
    step 1."""
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(BLOCK))
    ckpt = save_split(svc, run_name, tmp_path / "save")
    shards = stored(svc, ckpt, 3)[1]
    f, name = next((f, n) for f in ckpt["manifest"]["ranks"][3]["files"] if f["name"] != "rank00003.safetensors"
                   for n in f["tensors"] if n in shards)
    blob = ckpt_dir(svc, ckpt["id"]) / "r3" / keys.shard_name(f["xxh3_128"])  # the service's key rule
    data = bytearray(blob.read_bytes())
    data[f["data_start"] + f["tensors"][name]["offsets"][1] - 1] ^= 0x01
    blob.write_bytes(bytes(data))

    res = restore(svc, run_name, tmp_path / "on2", 2, step=1)
    assert "[rank 0] restored step 1" in res.stdout and "[rank 1] restored step 1" in res.stdout
    assert f"(tensor {name!r}) hash to" in res.stdout + res.stderr
    assert wait_status(svc, ckpt["id"], "CORRUPT")["status"] == "CORRUPT"
