"""Heartbeats on both catalogs (SQLite, PostgreSQL), through the domain with a movable clock:
concurrent first beats of one rank make one row; two replicas sweeping the same hang record
it once; a commit without fsync (durable=False) is still read back."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from lastgood_service.catalog.db import make_engine, make_sessionmaker
from lastgood_service.catalog.models import Event, Heartbeat
from lastgood_service.domain.runs.fencing import Launches
from lastgood_service.domain.health.heartbeats import Health
from lastgood_service.domain.health.verdicts import Limits


def beat(rank: int, step: int) -> dict:
    return {"rank": rank, "world_size": 4, "step": step, "step_seconds": 0.5, "phase": "train", "attempt": "a",
            "generation": 1, "max_step_seconds": 0.5, "period_s": 1.0}


def test_concurrent_beats_keep_one_row_per_rank_and_a_hang_is_recorded_once(catalog_url, clock):
    engine = make_engine(catalog_url, durable=False)
    try:
        sessions = make_sessionmaker(engine)
        Launches(sessions).register("hb", "a", 4)
        replicas = [Health(sessions, Limits(floor_s=10.0), 3600.0, 0.0, clock=clock) for _ in range(2)]
        errors = []

        def beats(h: Health) -> None:
            try:
                for step in range(10):
                    for rank in range(4):
                        h.beat("hb", beat(rank, step))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=beats, args=(replicas[i % 2],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(Heartbeat)) == 4
            assert sorted(s.scalars(select(Heartbeat.beats))) == [40, 40, 40, 40]
        assert replicas[0].view("hb")["hung"] == []

        for rank in (0, 1, 2):  # ranks 0-2 go on; rank 3 stops
            replicas[0].beat("hb", beat(rank, 10))
        clock.advance(11.0)
        for rank in (0, 1, 2):
            replicas[1].beat("hb", beat(rank, 11))
        assert replicas[0].view("hb")["hung"] == [3]
        sweeps = [threading.Thread(target=r.sweep) for r in replicas for _ in range(2)]
        for t in sweeps:
            t.start()
        for t in sweeps:
            t.join(60)
        with sessions() as s:
            hung = s.scalars(select(Event).where(Event.kind == "hung")).all()
        assert len(hung) == 1 and '"rank": 3' in hung[0].data_json  # four sweeps, two replicas: one event
    finally:
        engine.dispose()
