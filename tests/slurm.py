"""A real one-node Slurm cluster for the tests: Debian's slurm-wlm (slurmctld and slurmd on
this machine, as root, on free ports) with munge for authentication, its configuration and
state in a temporary directory. Started per test that asks for `slurm`, shut down after.

When the binaries are missing the fixture fails under CI=true (.ci/run installs them) and
skips elsewhere, as tests/pg.py does for PostgreSQL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lastgood_service.launcher import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "munge")


@dataclass
class Slurm:
    conf: Path
    env: dict

    def sbatch(self, script: Path, *args: str, cwd: Path, env: dict) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True, text=True,
                             cwd=cwd, env={**env, **self.env}, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             env={**os.environ, **self.env}, timeout=30).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        end = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            if time.monotonic() > end:
                subprocess.run(["scancel", str(job_id)], env={**os.environ, **self.env}, timeout=30)
                return {**info, "JobState": "TIMED_OUT_IN_TEST"}
            time.sleep(1)


def _munge_up(env: dict) -> bool:
    probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, env=env, timeout=10)
    return probe.returncode == 0


@pytest.fixture
def slurm(tmp_path_factory):
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing or os.geteuid() != 0:
        why = f"Slurm is not usable here ({', '.join(missing) or 'not root'}): apt-get install slurm-wlm munge (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    base = tmp_path_factory.mktemp("slurm")
    host, cpus = socket.gethostname(), os.cpu_count() or 1
    mem = int(open("/proc/meminfo").read().split()[1]) // 1024 - 1024
    conf = base / "slurm.conf"
    (base / "state").mkdir()
    (base / "spool").mkdir()
    conf.write_text(f"""ClusterName=lastgood-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MinJobAge=600
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munged = None
    if not _munge_up(env):  # no munge daemon running: start one for the session's lifetime
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(["mungekey", "-c"], check=True, timeout=30)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        munged = subprocess.run(["munged", "--force", "--pid-file", str(base / "munged.pid")], capture_output=True,
                                text=True, timeout=30)
        assert munged.returncode == 0 and _munge_up(env), munged.stderr
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env, timeout=30)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env, timeout=30)
    try:
        end = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                           env=env).stdout:
            assert time.monotonic() < end, (base / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)
        yield Slurm(conf, {"SLURM_CONF": str(conf)})
    finally:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, timeout=30)
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munged.pid" if munged else ""):
            p = base / pidfile
            if pidfile and p.exists():
                try:
                    os.kill(int(p.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass
