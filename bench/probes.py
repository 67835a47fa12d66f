"""What a bench reads of a process and of the catalog while it runs: CPU seconds, threads
and bytes written from /proc, a thread-count sampler, and the catalog's transactions and
checkpoint rows (bench/control_plane.py, bench/cluster.py, bench/dataplane.py)."""

from __future__ import annotations

import datetime as dt
import os
import threading

import httpx

from bench.common import median, percentile

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def wchar(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class ThreadSampler:
    """Peak thread count of a process, sampled every 20 ms."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while self.pid and not self._stop.is_set():
            try:
                self.peak = max(self.peak, threads(self.pid))
            except OSError:
                return
            self._stop.wait(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def catalog_transactions(url: str) -> dict[str, int]:
    """The service's catalog transactions so far by label (begin, put, vote, ...), from
    /metrics (`lastgood_catalog_transactions_total`); {} from a service without them."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("lastgood_catalog_transactions_total{"):
            out[line.split('label="', 1)[1].split('"', 1)[0]] = int(float(line.split()[-1]))
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _epoch(t: dt.datetime) -> float:
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


class Catalog:
    """Read-only look at the service's catalog: the vote and commit times, rows, and on
    PostgreSQL the database's transaction and WAL counters."""

    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine

        self.url = url
        self.pg = url.startswith("postgresql")
        self.engine = create_engine(url)

    def times(self, cid: int) -> tuple[float, float]:
        from sqlalchemy import text

        with self.engine.connect() as c:
            last_vote = c.execute(text("SELECT max(created_at) FROM votes WHERE checkpoint_id = :c"), {"c": cid}).scalar()
            committed = c.execute(text("SELECT committed_at FROM checkpoints WHERE id = :c"), {"c": cid}).scalar()
        parse = lambda v: _epoch(v if isinstance(v, dt.datetime) else dt.datetime.fromisoformat(v))  # noqa: E731
        return parse(last_vote), parse(committed)

    def rows(self, cid: int) -> dict:
        from sqlalchemy import text

        with self.engine.connect() as c:
            return {t: c.execute(text(f"SELECT count(*) FROM {t} WHERE checkpoint_id = :c"), {"c": cid}).scalar()
                    for t in ("shards", "votes", "events")} | {"checkpoints": 1}

    def counters(self) -> dict:
        """PostgreSQL: transactions committed in this database, tuples written, WAL position."""
        if not self.pg:
            return {}
        from sqlalchemy import text

        with self.engine.connect() as c:
            c.execute(text("SELECT pg_stat_clear_snapshot()"))
            row = c.execute(text("SELECT xact_commit, tup_inserted, tup_updated, tup_deleted FROM pg_stat_database "
                                 "WHERE datname = current_database()")).one()
            lsn = c.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar()
        return {"xact_commit": row[0], "tup_written": row[1] + row[2] + row[3], "wal_bytes": int(lsn)}

    def close(self) -> None:
        self.engine.dispose()


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {"n": len(xs), "p50": round(median(xs), 4), "p99": round(percentile(xs, 0.99), 4), "max": round(xs[-1], 4)}
