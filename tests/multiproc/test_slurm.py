"""docs/deploy-slurm.md's sbatch script, run for real on a one-node Slurm cluster (tests/slurm.py):
the script as printed, with only the machine's sizes, the service's address and the training
command put in. Rank 1 of the first launch hangs inside step 10; the node's supervisor finds it
through the service, relaunches, and the Slurm job COMPLETES with weights bit-identical to a
run that never hung."""

from __future__ import annotations

import os
import re
import sys

from lastgood_service.launcher import free_port
from tests.conftest import ROOT
from tests.multiproc.launch import TRAIN, Background
from tests.multiproc.test_supervise import events

sys.path.insert(0, str(ROOT / "examples/gpt"))
from compare import compare  # noqa: E402

DOC = ROOT / "docs" / "deploy-slurm.md"


def the_script(url: str, out, nproc: int) -> str:
    """The doc's script, fitted to this machine. Each substitution must match exactly once, so a
    script that drifts from what this test runs fails here."""
    text = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S).group(1)
    py = sys.executable
    swaps = [
        (r"#SBATCH --nodes=\d+", "#SBATCH --nodes=1"),
        (r"#SBATCH --gpus-per-node=\d+.*\n", ""),
        (r"#SBATCH --cpus-per-task=\d+", f"#SBATCH --cpus-per-task={os.cpu_count()}"),
        (r"export LASTGOOD_URL=\S+", f"export LASTGOOD_URL={url}"),
        (r"export LASTGOOD_TOKEN=.*\n", ""),  # the test's service runs without tokens
        (r"lastgood supervise --max-restarts 5 --",
         f"{py} -m lastgood.cli supervise --max-restarts 5 --hang-timeout 10 --poll 0.5 --grace 5 --"),
        (r"torchrun --nnodes", f"{py} -m torch.distributed.run --nnodes"),
        (r"--nproc-per-node=\d+", f"--nproc-per-node={nproc}"),
        (r":29400", f":{free_port()}"),
        (r"train\.py --config 7b\.yaml", f"{TRAIN} --url {url} --out {out} --steps 12 --every 3"),
    ]
    for pattern, new in swaps:
        text, n = re.subn(pattern, new.replace("\\", "\\\\"), text)
        assert n == 1, f"docs/deploy-slurm.md no longer has {pattern!r} once"
    return text


def test_the_slurm_recipe_runs_and_its_supervisor_relaunches_a_hung_rank_bit_identically(
        slurm, service, run_name, tmp_path):
    out, trigger, log = tmp_path / "supervised", tmp_path / "hang", tmp_path / "job.log"
    trigger.touch()
    beats = {"LASTGOOD_HEARTBEAT_SECONDS": "0.1"}  # times these short steps (see test_supervise.py)
    ref = Background(service.url, f"{run_name}-ref", tmp_path / "reference", "--steps", "12", "--every", "3",
                     env=beats)
    script = tmp_path / "train.sbatch"
    script.write_text(the_script(service.url, out, 2))
    env = {**os.environ, **beats, "LASTGOOD_EXAMPLE_HANG": f"1:10:{trigger}", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR"}
    job = slurm.sbatch(script, f"--job-name={run_name}", f"--output={log}", cwd=ROOT, env=env)
    info = slurm.wait(job, timeout=300)
    output = log.read_text() if log.exists() else ""
    assert info["JobState"] == "COMPLETED", f"{info}\n{output[-4000:]}"
    assert "fault injection: hanging in step 10" in output and not trigger.exists(), output[-4000:]
    restarts = events(service, run_name)  # the run is the job's name (LASTGOOD_RUN=$SLURM_JOB_NAME)
    assert [e["kind"] for e in restarts] == ["supervisor_restart"], restarts
    assert restarts[0]["data"]["reason"] == "hung", restarts
    assert output.count("starting at step 9 (restored: 8)") == 2, output[-4000:]
    assert ref.finish().returncode == 0
    diffs = compare(tmp_path / "reference", out, world=2)
    assert diffs == [], "\n".join(diffs[:20])
