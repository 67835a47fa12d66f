"""The memory tier's protocol rules, one place (docs/memory-tier.md): the tier words, the
node agents' placement ring, the agent's secret header, the defaults both sides assume.

A memory checkpoint is a catalog checkpoint with `tier = memory`: its files live in the
shared memory of node agents, not in the store. It commits by the same vote as a durable
one; a memory file counts as present when its own node's agent and `replicas` partner
agents (each on another host) have each reported the file's declared xxh3-128 from their own
hash of the bytes they hold. Torch-free: the service, the agent and the client all import it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from .vocab import _Word


class Tier(_Word):
    """A checkpoint's tier (the catalog's `checkpoints.tier`, `Checkpoint.tier` on the wire)."""
    DURABLE = "durable"
    MEMORY = "memory"


DEFAULT_REPLICAS = 1          # partner copies besides the node's own
MAX_REPLICAS = 3
DEFAULT_MEMORY_KEEP = 2       # memory:latest:N when a run's retention names no memory rule
LAST_GOOD_DURABLE_TAG = "last-good-durable"  # system tag: the run's newest committed durable checkpoint

AGENT_KEY_HEADER = "X-Lastgood-Agent-Key"  # an agent's secret; the service keeps its SHA-256
AGENT_KEY_HEX = 64
SHM_ROOT = "/dev/shm/lastgood"  # <root>/<run>/<checkpoint id>/<rank>/<file> on every node
# How long a connection to an agent may take to open. On a cluster's network a live agent
# answers in well under a millisecond; a node that is gone may drop the SYN (a blackhole, or
# an address nobody holds any more), which would otherwise hold a restore's copy, or a
# partner's replication, for the whole read timeout before the next copy is tried.
AGENT_CONNECT_TIMEOUT = 2.0

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_label(what: str, value: str) -> str:
    """A host, rack or switch label as an agent declares it: bounded, path- and shell-safe."""
    if not isinstance(value, str) or not _LABEL.fullmatch(value):
        raise ValueError(f"{what} must match {_LABEL.pattern}, got {value!r}")
    return value


def key_digest(key: str) -> str:
    """What the service stores for an agent's secret."""
    return hashlib.sha256(key.encode("ascii")).hexdigest()


def key_matches(key: str | None, digest: str) -> bool:
    return bool(key) and hmac.compare_digest(key_digest(key), digest)


@dataclass(frozen=True, order=True)
class AgentPlace:
    """Where an agent runs: the ring orders agents by (rack, switch, host, agent id)."""
    rack: str = ""
    switch: str = ""
    host: str = ""
    agent_id: int = field(default=0, compare=True)


def partners(agents: list[AgentPlace], own: AgentPlace, replicas: int = DEFAULT_REPLICAS) -> list[AgentPlace]:
    """The agents that hold copies of `own`'s memory checkpoints, in order: walking the ring
    of agents sorted by (rack, switch, host, id) forward from `own`, the first `replicas` whose
    host differs from own's and from every partner already chosen; with rack labels given, a
    partner in another rack is preferred over one in the same rack. Fewer than `replicas` when
    the ring has too few other hosts: the caller refuses the memory save (it cannot commit)."""
    if not 0 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be 0..{MAX_REPLICAS}, got {replicas}")
    ring = sorted(set(agents) | {own})
    start = ring.index(own)
    walk = ring[start + 1:] + ring[:start]
    chosen: list[AgentPlace] = []
    hosts = {own.host}
    for prefer_other_rack in (True, False):
        for place in walk:
            if len(chosen) == replicas:
                return chosen
            if place.host in hosts or (prefer_other_rack and own.rack and place.rack == own.rack):
                continue
            chosen.append(place)
            hosts.add(place.host)
    return chosen


def holders_needed(replicas: int) -> int:
    """How many distinct hosts must report a memory file's digest before it counts."""
    return 1 + replicas


# The node agent's own HTTP protocol (lastgood.agent serves it, lastgood.datapath.agents calls it).
AGENT_READY_PATH = "/v1/ready"            # POST: a rank's files are in its segment directory
AGENT_RESERVE_PATH = "/v1/reserve"        # POST: room for a rank's bytes under the node's budget
AGENT_SEGMENTS_PATH = "/v1/segments"      # /<run>/<checkpoint id>/<rank>/<file>: GET (ranged), PUT (a partner's copy)
AGENT_STATUS_PATH = "/v1/status"          # GET: what the agent holds, its budget and events
AGENT_LOCAL_PATH = "/v1/local"            # GET /<run>/<checkpoint id>/<rank>/<file>: where a held file lies on
                                          # the agent's host ({path, size, xxh3_128}): a rank there reads it itself
AGENT_REPLICATION_PATH = "/v1/replication"  # GET /<run>/<checkpoint id>/<rank>: how that rank's replication stands
AGENT_DIGEST_HEADER = "X-Lastgood-Xxh3-128"  # the holder's own xxh3-128 of the whole file

MAX_ADDRESS = 255
_PORT = r"(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_ADDRESS = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.-]{0,200}|\[[0-9A-Fa-f:.]{2,45}\]):" + _PORT)
# the same rules in an OpenAPI document (the service's agent routes)
SCHEMA = {"label": {"pattern": "^" + _LABEL.pattern + "$"},
          "optional_label": {"pattern": "^(?:" + _LABEL.pattern + ")?$"},
          "address": {"pattern": "^" + _ADDRESS.pattern + "$"}}


def check_address(value: str) -> str:
    """An agent's address as it declares it ("host:port", "[v6]:port"): where partners and
    restoring ranks reach it. Bounded, no scheme, no path."""
    if not isinstance(value, str) or len(value) > MAX_ADDRESS or not _ADDRESS.fullmatch(value):
        raise ValueError(f"address must be host:port (port 1..65535, at most {MAX_ADDRESS} characters), "
                         f"got {value[:80] if isinstance(value, str) else value!r}")
    return value
