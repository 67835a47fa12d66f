"""Direct-FS with two torchrun ranks (DDP, gloo): each rank writes its file in place through a
mount of the store's directory under another path (a symlink, as another host would see
it; the same-host spool off), hands over the name, and - in `peer` mode - reads back the
other rank's file before the commit. A second launch restores every tensor bit for bit."""

from __future__ import annotations

from pathlib import Path

from tests.multiproc.launch import torchrun, why
from tests.service.helpers import events

HERE = Path(__file__).parent


def test_two_ranks_save_through_direct_fs_with_peer_checks_and_restore_bitwise(make_service, run_name, tmp_path):
    svc = make_service(LASTGOOD_VERIFICATION="peer", LASTGOOD_LEASE_SECONDS="60")
    mount = tmp_path / "mnt" / "store"
    mount.parent.mkdir()
    mount.symlink_to(svc.blob_root)
    env = {"LASTGOOD_USE_SPOOL": "0", "LASTGOOD_DIRECT_FS_MOUNT": str(mount)}
    saved = torchrun(HERE / "directfs_ranks.py", [svc.url, run_name, "save", str(tmp_path)], env=env)
    assert saved.returncode == 0, why(saved)

    lg = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 3
    checks = [e.get("data", e) for e in events(svc, run_name) if e["kind"] == "peer_verified"]
    assert sorted((c["rank"], c["checked_by"]) for c in checks) == [(0, 1), (1, 0)], checks  # the ring
    assert [p.name for p in (svc.blob_root / "direct").iterdir() if not p.name.startswith(".")] == []

    restored = torchrun(HERE / "directfs_ranks.py", [svc.url, run_name, "restore", str(tmp_path)], env=env)
    assert restored.returncode == 0, why(restored)
    assert "[rank 0] restored bitwise" in restored.stdout and "[rank 1] restored bitwise" in restored.stdout
