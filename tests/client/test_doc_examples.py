"""The complete programs in docs/ run as they are printed there, against a real service.

A block is marked by the HTML comment `<!-- the test runs the block below as it is -->`
on the line before its opening fence; this test takes it from the page, writes it to a
file unchanged and runs it in a fresh interpreter with LASTGOOD_URL set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

MARK = "<!-- the test runs the block below as it is -->"


def marked_blocks(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    return re.findall(re.escape(MARK) + r"\n```python\n(.*?)\n```", text, flags=re.S)


@pytest.mark.slow  # a Python process with torch: ~4 s of CPU
def test_the_spikeguard_example_runs_as_shown_and_rolls_back(service, tmp_path):
    blocks = marked_blocks("docs/training.md")
    assert len(blocks) == 1, "docs/training.md should mark exactly its SpikeGuard program"
    script = tmp_path / "spike_example.py"
    script.write_text(blocks[0] + "\n")
    env = {**os.environ, "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
    env.pop("LASTGOOD_RUN", None)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "trained to step 150; rollbacks: 1" in res.stdout, res.stdout + res.stderr
    assert "spike at step 20" in res.stderr and "rolled back to step 10" in res.stderr, res.stderr

    events = service.get("/api/v1/runs/spike-demo/events", params={"limit": 1000}).json()["items"]
    spike = next(e for e in events if e["kind"] == "spike")
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert spike["data"]["step"] == 20 and spike["data"]["value"] > 1000
    assert rollback["data"]["target_step"] == 10 and 194 in rollback["data"]["skipped"]["samples"]
    last_good = service.get("/api/v1/runs/spike-demo/last-good").json()
    assert last_good["step"] == 140  # the run went on after the rollback, to the end


@pytest.mark.slow  # two Python processes with torch: ~8 s of CPU
def test_the_spikeguard_example_trains_the_same_model_every_time(service, tmp_path):
    """The example's outcome ("rollbacks: 1") holds only if its run is the same every time:
    two runs of it (as printed, under two run names) end with bit-identical weights."""
    block = marked_blocks("docs/training.md")[0]
    assert 'run="spike-demo"' in block
    weights = []
    for i in range(2):
        script = tmp_path / f"spike_example_{i}.py"
        script.write_text(block.replace('run="spike-demo"', f'run="spike-repeat-{os.getpid()}-{i}"')
                          + "\nprint('weights', model.weight.flatten().tolist(), model.bias.tolist())\n")
        env = {**os.environ, "LASTGOOD_URL": service.url, "OMP_NUM_THREADS": "1"}
        env.pop("LASTGOOD_RUN", None)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        weights.append(next(line for line in res.stdout.splitlines() if line.startswith("weights ")))
    assert weights[0] == weights[1]
