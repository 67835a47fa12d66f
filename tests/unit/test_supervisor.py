"""The supervisor's reading of a torchrun command line, its usage errors, and /proc parsing
(the multi-process behaviour is in tests/multiproc/test_supervise.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lastgood.supervise import proctree
from lastgood.supervise.proctree import RankWatch
from lastgood.supervise.supervisor import Supervisor, UsageError, nproc, one_node, run_of, with_nproc

TORCHRUN = ["torchrun", "--nnodes=1", "--rdzv-id", "job-7", "train.py", "--lr", "3"]


@pytest.mark.parametrize("spelling", [["--nproc-per-node=4"], ["--nproc_per_node", "4"], ["--nproc-per-node", "4"]])
def test_nproc_is_read_and_rewritten_in_every_spelling(spelling):
    cmd = TORCHRUN[:1] + spelling + TORCHRUN[1:]
    assert nproc(cmd) == 4
    smaller = with_nproc(cmd, 3)
    assert nproc(smaller) == 3 and len(smaller) == len(cmd)
    assert [a for a in smaller if "4" in a] == [] and smaller[-3:] == ["train.py", "--lr", "3"]


def test_torchruns_defaults_and_the_run_name():
    assert nproc(TORCHRUN) == 1  # torchrun's own default
    assert nproc(["python", "train.py"]) is None
    assert nproc(["torchrun", "--nproc-per-node=gpu", "t.py"]) is None
    assert one_node(TORCHRUN) and not one_node(["torchrun", "--nnodes", "2", "t.py"])
    assert run_of(TORCHRUN) == "job-7"
    with pytest.raises(UsageError, match="no --nproc-per-node"):
        with_nproc(TORCHRUN, 2)


@pytest.mark.parametrize("cmd, drain, message", [
    (["torchrun", "--nproc-per-node=2", "t.py"], {2}, "local ranks 0..1"),
    (["torchrun", "--nproc-per-node=2", "t.py"], {0, 1}, "no rank to run"),
    (["torchrun", "--nnodes=2", "--nproc-per-node=2", "t.py"], {1}, "one node"),
    (["python", "t.py"], {0}, "one node"),
    ([], set(), "no command"),
])
def test_a_drain_that_cannot_be_done_is_refused_up_front(cmd, drain, message):
    with pytest.raises(UsageError, match=message):
        Supervisor(cmd, "run-1", rest=None, drain=drain)


@pytest.mark.slow
def test_usage_errors_exit_2_and_start_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LASTGOOD_RUN", "LASTGOOD_URL")}
    marker = tmp_path / "ran"
    job = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for argv in (["supervise"], ["supervise", "--", *job], ["supervise", "--run", "a/b", "--", *job],
                 ["supervise", "--run", "r", "--drain", "x", "--", *job],
                 ["supervise", "--run", "r", "--", str(tmp_path / "no-such-command")]):
        res = subprocess.run([sys.executable, "-m", "lastgood.cli", *argv], capture_output=True, text=True, env=env,
                             timeout=60)
        assert res.returncode == 2, (argv, res.stderr)
        assert "Error" in res.stderr or "error" in res.stderr
    assert not marker.exists()


def test_proc_stat_is_read_even_when_the_name_holds_parentheses_and_spaces(tmp_path):
    exe = tmp_path / "a) b ("
    os.symlink(sys.executable, exe)
    child = subprocess.Popen([str(exe), "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # past its exec
        p = proctree.read(child.pid)
        assert p is not None and p.ppid == os.getpid() and p.state in "RS" and not p.dead
        assert proctree.environ(child.pid).get("PATH") == os.environ.get("PATH")
        assert [q.pid for q in proctree.descendants(os.getpid(), proctree.table())].count(child.pid) == 1
    finally:
        child.kill()
        child.wait()
    assert proctree.read(child.pid) is None


KILL, TERM, EXIT1 = 9, 15, 1 << 8  # wait statuses: killed by SIGKILL / SIGTERM, exited with 1


@pytest.mark.parametrize("deaths, blamed", [
    ([(5, 3, KILL), (9, 0, TERM), (9, 1, TERM)], 3),         # torchrun ended the others later
    ([(5, 3, None), (5, 0, TERM), (5, 1, TERM)], 3),         # one look (a starved watch): 3 was not SIGTERMed
    ([(5, 3, None), (5, 0, TERM), (5, 1, None)], None),      # two reaped unseen: either may be first
    ([(5, 3, KILL), (5, 0, TERM), (5, 1, None)], 3),         # the same look, but 3 is seen dying otherwise
    ([(5, 3, KILL), (5, 0, EXIT1), (5, 1, EXIT1)], 3),       # its peers' error exits follow a crash
    ([(5, 2, EXIT1), (5, 1, EXIT1)], None),                  # two errors at once: nobody to blame
    ([(4, 0, 0), (5, 1, EXIT1)], 1),                         # a rank that finished is no failure
    ([], None),
])
def test_the_first_rank_to_fail_is_blamed_only_when_it_is_clear(deaths, blamed):
    watch = RankWatch()
    watch.deaths = deaths
    first = watch.first_failure()
    assert (first[0] if first else None) == blamed


LAUNCHER = """
import os, sys, time
pid = os.fork()
if pid == 0:  # a rank between fork and exec: its environment is still the launcher's
    time.sleep(0.6)
    os.execve(sys.executable, [sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.exit(1)"],
              dict(os.environ, LOCAL_RANK="3"))
os.waitpid(pid, 0)
"""


def test_a_rank_first_seen_before_its_exec_is_still_watched():
    """torchrun forks each rank and then execs it with LOCAL_RANK set: a look that falls in
    between sees the launcher's environment. That look must not settle that the process is
    no rank, or its death goes unseen and a peer that fails after it is blamed instead."""
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    watch = RankWatch()
    watch.start()  # with no rank known yet it looks every tick: it sees the fork before the exec
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env)
    try:
        assert launcher.wait(timeout=60) == 0
        time.sleep(10 * watch.interval)
    finally:
        watch.stop()
    first = watch.first_failure()
    assert first is not None and first[0] == 3, watch.summary()


def test_a_process_that_is_no_rank_is_read_only_until_its_exec_has_surely_happened(monkeypatch):
    """An absent LOCAL_RANK is read again at later looks (above), but not forever: a job
    with no rank would have every process's environment read fifty times a second."""
    monkeypatch.setattr(proctree, "EXEC_SETTLE_S", 0.3)
    reads = []
    real = proctree.environ
    monkeypatch.setattr(proctree, "environ", lambda pid: reads.append(pid) or real(pid))
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        watch = RankWatch()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            watch._scan()
            time.sleep(0.02)
        settled = reads.count(child.pid)
        for _ in range(20):
            watch._scan()
    finally:
        child.kill()
        child.wait()
    assert 1 <= settled < 40 and reads.count(child.pid) == settled, (settled, reads.count(child.pid))


ORPHANED_WORKER = """
import json, os, signal, subprocess, sys, time
from lastgood.supervise import proctree
assert proctree.set_subreaper()
watch = proctree.RankWatch()
watch.start()
rank = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
if os.fork() == 0:  # a data-loader worker: inherits LOCAL_RANK, stays in the rank's session
    time.sleep(5)
    sys.exit(0)
time.sleep(60)
'''], env=dict(os.environ, LOCAL_RANK="2"), start_new_session=True)
time.sleep(2.5)  # the rank is found (a look every tick until then, then every second)
os.kill(rank.pid, signal.SIGKILL)
rank.wait()
time.sleep(2.5)  # looks after the worker was re-parented to this process
ranks = sorted(watch._ranks.values())
watch.stop()
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
print(json.dumps({"ranks_left": ranks, "deaths": [[r, s] for _, r, s in watch.deaths]}))
"""


@pytest.mark.slow  # waits for a real process tree to settle
def test_a_dead_ranks_data_loader_worker_is_not_taken_for_a_rank():
    """When a rank dies its forked workers are re-parented to the supervisor (a subreaper),
    which has no LOCAL_RANK: a worker of the rank's session must not then count as a rank
    (its death, or its exit, would be blamed). Run in a process of its own: it becomes a
    subreaper, which pytest's must not."""
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    out = subprocess.run([sys.executable, "-c", ORPHANED_WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ranks_left"] == [] and [r for r, _ in got["deaths"]] == [2], got
