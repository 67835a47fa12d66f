"""Hang and straggler verdicts with ranks beating through the real client (lastgood.remote.heartbeat:
one Heartbeat thread per simulated rank, each rank a thread stepping at its own pace)
against a real service, and a real Checkpointer's beats, cost and `due()` decisions."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from torch import nn

import lastgood
from lastgood.remote.heartbeat import Heartbeat, SAVING, TRAIN
from lastgood.common.interval import PROBE_STEPS

pytestmark = pytest.mark.slow  # checkpointers beating for seconds to be judged hung, slow or saving

# fast verdicts: a 1 s floor, a 0.3 s sweep; the save allowance is long, so that a test can
# see a saving rank stay ok well past the steady timeout
FAST_HEALTH = {"LASTGOOD_HEALTH_INTERVAL": "0.3", "LASTGOOD_HANG_FLOOR_SECONDS": "1",
               "LASTGOOD_HANG_FIRST_STEP_SECONDS": "60", "LASTGOOD_HANG_SAVE_SECONDS": "60",
               "LASTGOOD_STRAGGLER_WINDOW_SECONDS": "3"}
PERIOD = 0.3


class SimRank(threading.Thread):
    """A training loop that only steps: `step_s` a step, beating through a real Heartbeat."""

    def __init__(self, url: str, run: str, rank: int, world: int, step_s: float, gen: int) -> None:
        super().__init__(daemon=True)
        self.hb = Heartbeat(url, run, rank, world, attempt="sim", generation=gen, period=PERIOD).start()
        self.step_s = step_s
        self.step = 0
        self.frozen = threading.Event()  # the training thread stops making progress
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if not self.frozen.is_set():
                self.hb.step(self.step)
                self.step += 1
            time.sleep(self.step_s)

    def stop(self, final=None) -> None:
        self.done.set()
        self.hb.stop(final)


def start_ranks(svc, run: str, paces: list[float]) -> list[SimRank]:
    r = httpx.post(f"{svc.url}/api/v1/runs/{run}/launches", json={"attempt": "sim", "world_size": len(paces)})
    gen = r.json()["generation"]
    ranks = [SimRank(svc.url, run, i, len(paces), pace, gen) for i, pace in enumerate(paces)]
    for s in ranks:
        s.start()
    return ranks


def health(svc, run: str) -> dict:
    return httpx.get(f"{svc.url}/api/v1/runs/{run}/health", timeout=30).json()


def wait_for(svc, run: str, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(svc, run)
        if pred(h):
            return h
        assert time.monotonic() < deadline, f"health never became what the test waits for: {h}"
        time.sleep(0.2)


def timed(h: dict) -> bool:
    """Every rank has a step time (past its first-step allowance)."""
    return bool(h["ranks"]) and all(r["step_seconds"] for r in h["ranks"])


def events(svc, run: str, kinds: str) -> list[dict]:
    return httpx.get(f"{svc.url}/api/v1/runs/{run}/events", params={"kind": kinds}).json()["items"]


@pytest.fixture
def hsvc(make_service):
    return make_service(**FAST_HEALTH)


def test_a_rank_that_stops_progressing_is_hung_within_its_timeout(hsvc, run_name):
    ranks = start_ranks(hsvc, run_name, [0.05, 0.05])
    try:
        h = wait_for(hsvc, run_name, timed)
        assert h["hung"] == [] and h["timeout_s"] >= 1.0
        ranks[1].frozen.set()  # stuck inside its step: its heartbeat thread goes on beating
        h = wait_for(hsvc, run_name, lambda h: h["hung"])
        assert h["hung"] == [1] and h["lost"] == []
        stuck = h["ranks"][1]
        assert stuck["state"] == "hung" and stuck["progress_age_s"] > stuck["timeout_s"]
        assert stuck["age_s"] < stuck["timeout_s"]  # it beats, it just makes no progress
        assert h["ranks"][0]["state"] == "ok"
        hung = wait_for_events(hsvc, run_name, "hung")
        assert [e["data"]["rank"] for e in hung] == [1]  # recorded once, however many sweeps saw it
        ranks[1].frozen.clear()  # progress again: ok again
        wait_for(hsvc, run_name, lambda h: h["hung"] == [])
    finally:
        for s in ranks:
            s.stop()


def wait_for_events(svc, run: str, kind: str, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not (found := events(svc, run, kind)):
        assert time.monotonic() < deadline, f"no {kind} event"
        time.sleep(0.2)
    time.sleep(1.0)  # a few more sweeps: still one event
    return events(svc, run, kind)


def test_a_saving_rank_is_not_hung_and_a_silent_one_is(hsvc, run_name):
    ranks = start_ranks(hsvc, run_name, [0.05, 0.05, 0.05])
    try:
        wait_for(hsvc, run_name, timed)
        ranks[1].hb.phase(SAVING)  # a long save: no step for longer than the steady timeout
        ranks[1].frozen.set()
        ranks[2].stop(final=None)  # the process is gone: no beat at all, and no goodbye
        h = wait_for(hsvc, run_name, lambda h: h["ranks"][1]["progress_age_s"] > 2 * h["timeout_s"]
                     and h["ranks"][2]["age_s"] > 2 * h["ranks"][2]["timeout_s"])
        assert h["ranks"][1]["phase"] == "saving" and h["ranks"][1]["state"] == "ok"
        assert h["ranks"][1]["timeout_s"] == 60.0  # the save allowance
        assert h["hung"] == [] and h["lost"] == [2]
        # the control: the same stall in phase train is a hang
        ranks[1].hb.phase(TRAIN)
        h = wait_for(hsvc, run_name, lambda h: h["hung"])
        assert h["hung"] == [1]
        kinds = [e["kind"] for e in events(hsvc, run_name, "hung,lost")]
        assert "lost" in kinds and kinds.count("hung") >= 1
    finally:
        for s in ranks:
            s.stop()


def test_a_rank_three_times_slower_is_a_straggler(hsvc, run_name):
    ranks = start_ranks(hsvc, run_name, [0.1, 0.1, 0.1, 0.3])
    try:
        h = wait_for(hsvc, run_name, lambda h: h["stragglers"])
        assert h["stragglers"] == [3] and h["hung"] == []
        assert h["ranks"][3]["state"] == "straggler"
        ev = wait_for_events(hsvc, run_name, "straggler")
        assert [e["data"]["rank"] for e in ev] == [3]
        metrics = httpx.get(f"{hsvc.url}/metrics").text
        assert 'lastgood_health_verdicts_total{verdict="straggler"} 1.0' in metrics
    finally:
        for s in ranks:
            s.stop()


@pytest.mark.slow
def test_an_even_job_has_no_straggler(hsvc, run_name):
    ranks = start_ranks(hsvc, run_name, [0.1, 0.1, 0.1, 0.1])
    try:
        wait_for(hsvc, run_name, timed)
        seen = []
        end = time.monotonic() + 4 * 3  # four straggler windows
        while time.monotonic() < end:
            h = health(hsvc, run_name)
            seen += h["stragglers"] + h["hung"]
            time.sleep(0.3)
        assert seen == [] and events(hsvc, run_name, "straggler,hung,lost") == []
    finally:
        for s in ranks:
            s.stop()


def test_a_checkpointer_beats_measures_its_cost_and_saves_when_due(hsvc, run_name):
    torch.manual_seed(0)
    state = lastgood.TrainState(model=nn.Linear(8, 8))
    ckpt = lastgood.Checkpointer(hsvc.url, run=run_name, interval="auto", heartbeat_seconds=0.2)
    saved = []
    for step in range(3 * PROBE_STEPS):
        if ckpt.due(step):
            ckpt.save(step, state)
            saved.append(step)
        time.sleep(0.02)
    ckpt.wait()
    # auto with no cost known yet saves once, after the probe steps, to measure it
    assert saved == [PROBE_STEPS]
    h = wait_for(hsvc, run_name, lambda h: h["interval"]["cost_s"])
    assert h["ranks"][0]["step"] is not None and h["ranks"][0]["phase"] == "train"
    iv = h["interval"]
    assert iv["cost_s"] > 0 and iv["mtbf_source"] == "prior" and iv["seconds"] > iv["cost_s"]
    ckpt.close()
    h = wait_for(hsvc, run_name, lambda h: h["ranks"][0]["phase"] == "idle")
    assert h["ranks"][0]["state"] == "ok"


def test_due_every_n_steps_and_at_epoch_ends(service, run_name):
    ckpt = lastgood.Checkpointer(service.url, run=run_name, interval=lastgood.Interval(every_steps=4, epoch_end=True),
                                 heartbeat_seconds=0)
    try:
        assert [s for s in range(13) if ckpt.due(s, epoch_end=(s == 6))] == [4, 6, 8, 12]
    finally:
        ckpt.close()
    plain = lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0)
    try:
        with pytest.raises(lastgood.LastgoodError, match="interval"):
            plain.due(1)
    finally:
        plain.close()


def test_a_rank_waiting_for_its_last_save_reports_saving_not_train(make_service, run_name):
    """wait() (and so close()) may block on an upload far longer than a training step; its
    beats must say `saving`, or the service judges the rank hung and a supervisor kills a job
    that is only finishing its final save. The upload is held by pausing the service."""
    import os
    import signal

    svc = make_service()
    ckpt = lastgood.Checkpointer(svc.url, run=run_name, heartbeat_seconds=0.2)
    state = lastgood.TrainState(model=nn.Linear(64, 64), extra={})
    ckpt.step(1)
    os.kill(svc.pid, signal.SIGSTOP)  # the upload cannot finish while the service is paused
    try:
        ckpt.save(1, state)
        waiter = threading.Thread(target=ckpt.wait, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and waiter.is_alive():
            time.sleep(0.1)
            phase = ckpt.heartbeat.body()["phase"]
            if phase == SAVING:
                break
        assert waiter.is_alive(), "wait() returned while the service was paused"
        assert ckpt.heartbeat.body()["phase"] == SAVING
    finally:
        os.kill(svc.pid, signal.SIGCONT)
    waiter.join(60)
    assert not waiter.is_alive() and ckpt.last_saved is not None
    assert ckpt.heartbeat.body()["phase"] == TRAIN  # training may go on after wait()
    ckpt.close()


@pytest.mark.parametrize("gap", [None, 0.0], ids=["coalesced", "control-every-change"])
def test_a_burst_of_short_saves_is_a_few_beats_and_a_long_save_is_seen_within_the_gap(hsvc, run_name, monkeypatch,
                                                                                     gap):
    """Each save is up to four phase changes (save() and wait() each enter and leave `saving`):
    beaten at once every time, saves every few milliseconds were a beat each. A phase change is
    beaten at once, but no sooner than PHASE_BEAT_GAP after the previous beat, with the phase
    current then. Control: with no gap, every change is a beat."""
    from lastgood.remote import heartbeat

    if gap is not None:
        monkeypatch.setattr(heartbeat, "PHASE_BEAT_GAP", gap)
    gen = httpx.post(f"{hsvc.url}/api/v1/runs/{run_name}/launches", json={"attempt": "burst", "world_size": 1})
    hb = Heartbeat(hsvc.url, run_name, 0, 1, attempt="burst", generation=gen.json()["generation"], period=10.0).start()
    try:
        time.sleep(0.3)  # the first beat is out
        t0 = time.monotonic()
        for i in range(50):  # 50 saves of 10 ms each, over half a second
            hb.phase(SAVING)
            time.sleep(0.005)
            hb.phase(TRAIN)
            time.sleep(0.005)
        burst = time.monotonic() - t0
        hb.phase(SAVING)  # then a long save
        h = wait_for(hsvc, run_name, lambda h: h.get("ranks") and h["ranks"][0]["phase"] == "saving", timeout=10)
        seen = time.monotonic() - t0 - burst
        beats = hb.beats
    finally:
        hb.stop()
    assert h["ranks"][0]["state"] == "ok"
    if gap is None:
        assert beats <= 4, beats  # the first, then one a second at most
        assert seen < heartbeat.PHASE_BEAT_GAP + 1.0, seen  # the long save is reported within the gap
    else:
        assert beats >= 40, beats  # every change its own beat (coalesced only while one is on the wire)
