"""The memory tier's placement ring (lastgood.wire.tiers.partners)."""

import pytest

from lastgood.wire import tiers
from lastgood.wire.tiers import AgentPlace


def _ring(*hosts, racks=None):
    return [AgentPlace(rack=(racks or {}).get(h, ""), host=h, agent_id=i + 1) for i, h in enumerate(hosts)]


def test_partners_walk_the_ring_forward_and_skip_the_own_host():
    a, b, b2, c = _ring("a", "b", "b", "c")
    assert tiers.partners([a, b, b2, c], a, 1) == [b]
    assert tiers.partners([a, b, b2, c], b, 2) == [c, a]  # b2 shares b's host
    assert tiers.partners([a, b, b2, c], c, 1) == [a]


def test_a_partner_in_another_rack_is_preferred():
    ring = _ring("a", "b", "c", "d", racks={"a": "r1", "b": "r1", "c": "r2", "d": "r2"})
    assert tiers.partners(ring, ring[0], 1) == [ring[2]]
    assert tiers.partners(ring, ring[0], 3) == [ring[2], ring[3], ring[1]]


def test_too_few_hosts_give_fewer_partners_and_bad_counts_are_refused():
    a, a2 = _ring("a", "a")
    assert tiers.partners([a, a2], a, 1) == []
    with pytest.raises(ValueError, match="replicas"):
        tiers.partners([a], a, tiers.MAX_REPLICAS + 1)


def test_labels_and_keys():
    assert tiers.check_label("host", "node-1.rack2") == "node-1.rack2"
    for bad in ("", "../x", "a b", "x" * 65):
        with pytest.raises(ValueError):
            tiers.check_label("host", bad)
    key = "ab" * 32
    assert tiers.key_matches(key, tiers.key_digest(key)) and not tiers.key_matches("cd" * 32, tiers.key_digest(key))
    assert not tiers.key_matches(None, tiers.key_digest(key))
