"""Node agents of the memory tier: registration, the placement list, the key check.

An agent registers with its host label (and rack and switch labels, if given) and the
address it serves on; it gets an id and a key (64 hex digits), shown once: the catalog
keeps only lastgood.wire.tiers.key_digest(key). A registration again of the same host and
address (the agent restarted, its memory empty) retires the older rows: their copies stop
counting toward a commit and their keys stop opening (`authenticate`). Every later call of
an agent names its id and sends its key (tiers.AGENT_KEY_HEADER), and marks it seen: the
placement list leaves out an agent not seen for the settings' agent_ttl_seconds, so a dead
node (its agent asks for its live list every few seconds while it runs) is no rank's partner.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable

from sqlalchemy import select, update

from lastgood.wire import tiers

from ...catalog.models import Agent, utcnow
from ..errors import InvalidArgument, PermissionDenied
from ..events import add_event

log = logging.getLogger("lastgood")

MAX_AGENTS_LISTED = 10_000  # the placement list's bound (a job of 10,000 nodes)


def check_place(host: str, rack: str, switch: str, address: str) -> None:
    """The labels and address an agent declares (lastgood.wire.tiers' rules)."""
    try:
        tiers.check_label("host", host)
        for what, value in (("rack", rack), ("switch", switch)):
            if value:
                tiers.check_label(what, value)
        tiers.check_address(address)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def view(a: Agent) -> dict:
    return {"agent_id": a.id, "host": a.host, "rack": a.rack, "switch": a.switch, "address": a.address}


class Agents:
    def __init__(self, sessions, ttl_seconds: float, clock: Callable[[], dt.datetime] = utcnow) -> None:
        self.sessions, self.ttl, self.clock = sessions, dt.timedelta(seconds=ttl_seconds), clock

    def register(self, host: str, rack: str, switch: str, address: str) -> dict:
        check_place(host, rack, switch, address)
        key = secrets.token_hex(tiers.AGENT_KEY_HEX // 2)
        now = self.clock()
        with self.sessions() as s, s.begin():
            retired = list(s.scalars(select(Agent.id).where(Agent.host == host, Agent.address == address,
                                                            Agent.retired_at.is_(None))))
            if retired:
                s.execute(update(Agent).where(Agent.id.in_(retired)).values(retired_at=now))
            a = Agent(host=host, rack=rack, switch=switch, address=address, key_digest=tiers.key_digest(key),
                      registered_at=now, seen_at=now)
            s.add(a)
            s.flush()
            add_event(s, "agent_registered", None, None, agent_id=a.id, host=host, address=address,
                      retired=retired)
            agent_id = a.id
        log.info("agent %s registered: %s at %s (retired %s)", agent_id, host, address, retired or "none")
        return {"agent_id": agent_id, "key": key}

    def list(self) -> dict:
        """The agents that count (not retired, seen within the TTL), in the placement ring's
        order's input: by id."""
        seen_since = self.clock() - self.ttl
        with self.sessions() as s, s.begin():
            rows = s.scalars(select(Agent).where(Agent.retired_at.is_(None), Agent.seen_at >= seen_since)
                             .order_by(Agent.id).limit(MAX_AGENTS_LISTED))
            return {"agents": [view(a) for a in rows]}


def authenticate(s, agent_id: int, key: str | None, now: dt.datetime, ttl_seconds: float) -> Agent:
    """The agent `agent_id`, if `key` is its key and it is not retired, marked seen at `now`
    (with the caller's transaction) once a quarter of the TTL has passed since it last was,
    so an agent's live poll (every few seconds) is mostly a read, not a catalog write;
    PermissionDenied otherwise (the caller records the refusal in a transaction of its own)."""
    well_formed = isinstance(key, str) and len(key) == tiers.AGENT_KEY_HEX and key.isascii() and key.isalnum()
    a = s.get(Agent, agent_id) if 0 < agent_id <= 2**62 else None
    if a is None or not well_formed or not tiers.key_matches(key, a.key_digest):
        raise PermissionDenied(f"agent {agent_id}: the {tiers.AGENT_KEY_HEADER} is not this agent's key")
    if a.retired_at is not None:
        raise PermissionDenied(f"agent {agent_id} was retired by a later registration of {a.host} at "
                               f"{a.address}: register again")
    if a.seen_at is None or now - a.seen_at >= dt.timedelta(seconds=ttl_seconds / 4):
        a.seen_at = now
    return a
