"""Two torchrun ranks whose states are split into several files each (state/split.py): one
commit names every file of both ranks, and the checkpoint restores bit for bit at the same
world size and at another (every file of every old rank read)."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.launch import torchrun, why

HERE = Path(__file__).parent
SPLIT = {"LASTGOOD_FILE_BYTES": "64"}  # a Linear(8, 8)'s state: a few files per rank


def test_two_ranks_split_into_files_restore(make_service, run_name, tmp_path):
    svc = make_service()
    saved = torchrun(HERE / "save_two.py", [svc.url, run_name], env=SPLIT)
    assert saved.returncode == 0, why(saved)
    lg = svc.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["step"] == 2
    for r in lg["manifest"]["ranks"]:
        names = sorted(f["name"] for f in r["files"])
        main = f"rank{r['rank']:05d}.safetensors"
        assert main in names and f"rank{r['rank']:05d}-001.safetensors" in names, names

    res = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], env=SPLIT, timeout=120)
    assert res.returncode == 0, why(res)
    assert "[rank 0] restored step 2 weight 10.0" in res.stdout and "[rank 1] restored step 2 weight 11.0" in res.stdout
    one = torchrun(HERE / "restore_counted.py", [svc.url, run_name, str(tmp_path)], nproc=1, timeout=120)
    assert one.returncode == 0, why(one)
    assert "[rank 0] restored step 2 weight 10.0" in one.stdout  # another world size: whole files, every rank's
