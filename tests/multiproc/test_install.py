"""The client and the service installed as a user installs them: built into a wheel (as
`make dist` builds it), put into a fresh virtual environment with pip, and used from there
alone. Without the torch extra `import lastgood` and the `lastgood` command work and a
torch-needing name says which extra is missing; with it, the README's training snippet as
printed (its placeholders filled) runs on two torchrun ranks against the service installed
from its own wheel, and a second launch resumes from last-good."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
import venv

import pytest

from lastgood_service.launcher import free_port
from tests.conftest import ROOT
from tests.multiproc.launch import inherited_env
from tests.multiproc.readme import readme_snippet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two wheels built, a venv, torch installed

# fills the snippet's placeholders: a model, a dataset, one step, the number of steps
PRELUDE = '''
import torch
torch.manual_seed(0)
class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def forward(self, x):
        return self.net(x)
dataset = [(torch.randn(8), torch.randn(1)) for _ in range(256)]
total_steps = int(__import__("os").environ["STEPS"])
def train_one_step(batch):
    x, y = batch
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()
'''


def snippet(url: str) -> str:
    # the result in one write(2) of under PIPE_BUF bytes: the two ranks share torchrun's stdout
    # pipe, and a line print() sent in pieces was seen interleaved with the other rank's
    # ("RESULT RESULT {...}")
    report = ('__import__("os").write(1, ("RESULT " + __import__("json").dumps('
              '{"start": start, "rank": dist.get_rank()}) + "\\n").encode())\n')
    return readme_snippet(PRELUDE, {r'"http://127\.0\.0\.1:8000"': repr(url)}) + report


def pip(env_dir, *args: str) -> None:
    out = subprocess.run([str(env_dir / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *args],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_wheels_install_into_a_fresh_environment_and_run_the_readme_snippet(tmp_path):
    dist = tmp_path / "dist"
    for package in ("client", "service"):
        built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(dist),
                                str(ROOT / package)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    client = next(dist.glob("lastgood-*.whl"))
    service = next(dist.glob("lastgood_service-*.whl"))
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    bin_ = env_dir / "bin"
    clean = {k: v for k, v in inherited_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd, **kw):
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                              env={**clean, **kw.pop("env", {})}, **kw)

    # the client alone, without torch
    pip(env_dir, str(client))
    probe = run(bin_ / "python", "-c", "import lastgood, lastgood.wire, lastgood.remote; print(lastgood.__version__)\n"
                "try:\n    lastgood.Checkpointer\nexcept ImportError as e:\n    print('HINT', e)")
    assert probe.returncode == 0, probe.stderr
    assert "HINT" in probe.stdout and "lastgood[torch]" in probe.stdout, probe.stdout
    assert run(bin_ / "lastgood", "--version").returncode == 0

    # the service from its wheel, on embedded defaults
    pip(env_dir, str(service))
    migrated = run(bin_ / "lastgood-service", "migrate", env={"LASTGOOD_DATA_DIR": str(tmp_path / "data")})
    assert migrated.returncode == 0 and "catalog at head" in migrated.stdout, migrated.stdout + migrated.stderr
    port = free_port()
    svc = subprocess.Popen([str(bin_ / "lastgood-service")], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT,
                           env={**clean, "LASTGOOD_PORT": str(port), "LASTGOOD_GRPC_PORT": "0",
                                "LASTGOOD_DATA_DIR": str(tmp_path / "data")})
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2)
                break
            except OSError:
                assert svc.poll() is None and time.monotonic() < end, "the installed service did not start"
                time.sleep(0.5)

        # the torch extra, torch held at the CPU wheel this machine has (users pin theirs alike)
        constraints = tmp_path / "constraints.txt"
        constraints.write_text("torch==2.13.0\ntorchdata==0.11.0\n")
        pip(env_dir, f"{client}[torch,data]", "-c", str(constraints))
        script = tmp_path / "train.py"
        script.write_text(snippet(url))
        results = []
        for steps in ("120", "230"):  # the second launch resumes from last-good (step 100) and goes on
            job = run(bin_ / "torchrun", "--nproc-per-node=2", f"--master-port={free_port()}", script,
                      env={"STEPS": steps, "OMP_NUM_THREADS": "1"})
            assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
            results.append(sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", job.stdout)),
                                  key=lambda r: r["rank"]))
        assert [r["start"] for r in results[0]] == [None, None]
        assert [r["start"] for r in results[1]] == [100, 100]
        listing = run(bin_ / "lastgood", "--url", url, "--json", "ls", "gpt-small")
        assert listing.returncode == 0, listing.stderr
        steps = sorted(c["step"] for c in json.loads(listing.stdout)["items"])
        assert steps == [0, 100, 200], steps
    finally:
        svc.terminate()
        svc.wait(30)
