"""A run's own retention policy: read it, set it, clear it (back to the service default).

The spec is the service default's syntax (domain/runs/retention.py) and is checked the same
way: a bad one is refused and changes nothing. Setting it records a `retention` event, so
the next GC pass plans the run again (domain/gc/ also sees the policy it applied differ).
"""

from __future__ import annotations

import datetime as dt
from typing import Callable

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lastgood.wire import names

from ...catalog.models import Run, utcnow
from ..events import add_event
from ..errors import Conflict, InvalidArgument, NotFound
from ..gate import CatalogGate
from .retention import Retention, effective


class RunRetention:
    def __init__(self, sessions: sessionmaker[Session], default: Retention, gate: CatalogGate | None = None,
                 clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.sessions = sessions
        self.default = default
        self.gate = gate or CatalogGate()
        self.clock = clock

    @staticmethod
    def _run(s: Session, name: str, lock: bool = False) -> Run | None:
        try:
            names.check_run_name(name)
        except names.InvalidName as e:
            raise InvalidArgument(str(e)) from None
        q = select(Run).where(Run.name == name)
        return s.scalar(q.with_for_update() if lock else q)

    @classmethod
    def _existing(cls, s: Session, name: str) -> Run:
        run = cls._run(s, name)
        if run is None:
            raise NotFound(f"run {name!r} does not exist")
        return run

    def _view(self, run: Run) -> dict:
        return {"run": run.name, "retention": effective(run.retention, self.default).describe(),
                "own": run.retention, "default": self.default.describe()}

    def get(self, name: str) -> dict:
        """The policy GC applies to the run; `own` is None when that is the service default."""
        with self.sessions() as s, s.begin():
            return self._view(self._existing(s, name))

    def set(self, name: str, spec: str | None) -> dict:
        """Give the run its own policy (normalized, e.g. `latest:5,every:1000,...`), or
        None / "" to fall back to the service default. A run that has no checkpoint yet is
        created with it, so a policy can be set before the first save."""
        self.gate.check()
        own = None
        if spec is not None and spec.strip():
            try:
                own = Retention.parse(spec).describe()
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
        for _ in range(3):
            try:
                return self._set_once(name, own)
            except IntegrityError:  # the run's first save (or another setter) created it: again
                continue
        raise Conflict(f"concurrent creations of run {name!r} did not settle")

    def _set_once(self, name: str, own: str | None) -> dict:
        with self.sessions() as s, s.begin():
            run = self._run(s, name, lock=True)
            if run is None:  # a policy set before the first save: the run starts with it
                run = Run(name=name, created_at=self.clock(), generation=0)
                s.add(run)
                s.flush()
            if run.retention != own:
                add_event(s, "retention", run.id, None, retention=own, was=run.retention)
                run.retention = own
            return self._view(run)
