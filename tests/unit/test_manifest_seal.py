"""The manifest's seal and bounds (lastgood.wire.sealing, Manifest.from_dict) and the keys
that seal it (lastgood_service.domain.sealing) (#36)."""

from __future__ import annotations

import json
import stat

import pytest

from lastgood.wire import sealing
from lastgood.wire.manifest import FileEntry, Manifest, ManifestError
from lastgood_service.domain.sealing import ManifestKeyError, ManifestKeys, new_entry
from lastgood_service.settings import Settings

M = Manifest(7, "run-a", 12, "a1", 2, 6, {0: [FileEntry("rank00000.safetensors", 416, "c" * 32)], 1: []},
             generation=3, version=2)


def test_a_sealed_manifest_unseals_to_its_bytes_and_any_change_breaks_the_seal():
    keys = ManifestKeys.generate()
    body = keys.seal(M.to_bytes())
    assert keys.unseal(body) == (M.to_bytes(), keys.sealing_id)
    assert Manifest.from_bytes(body) == M  # readers that do not check seals ignore "auth"
    d = json.loads(body)
    for member, value in (("step", 13), ("generation", 4), ("run", "run-b")):
        forged = dict(d, **{member: value})
        with pytest.raises(sealing.Unauthenticated, match="MAC does not match"):
            keys.unseal(json.dumps(forged).encode())
    with pytest.raises(sealing.Unauthenticated, match="not among"):
        ManifestKeys.generate().unseal(body)  # another service's key
    with pytest.raises(sealing.Unsealed):
        keys.unseal(M.to_bytes())
    moved = dict(d, auth=dict(d["auth"], key_id="other"))  # the key id is inside the MAC
    with pytest.raises(sealing.Unauthenticated):
        ManifestKeys.from_text(f"{keys.sealing_id}:{keys.entries[0][1].hex()},other:{keys.entries[0][1].hex()}",
                               "t").unseal(json.dumps(moved).encode())


def test_unseal_refuses_oversized_and_deeply_nested_bodies_unread(monkeypatch):
    keys = ManifestKeys.generate()
    with pytest.raises(sealing.Unauthenticated, match="nested"):
        keys.unseal(b"[" * 100_000 + b"]" * 100_000)
    monkeypatch.setattr(sealing, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(sealing.Unauthenticated, match="over the 100-byte limit"):
        keys.unseal(keys.seal(M.to_bytes()))


def test_rotation_the_first_key_seals_every_listed_key_verifies():
    old, new = new_entry(), new_entry()
    before = ManifestKeys.from_text(old, "t")
    after = ManifestKeys.from_text(f"{new},{old}", "t")
    sealed_before = before.seal(M.to_bytes())
    assert after.unseal(sealed_before)[1] == before.sealing_id
    assert after.unseal(after.seal(M.to_bytes()))[1] == after.sealing_id != before.sealing_id
    with pytest.raises(sealing.Unauthenticated):  # dropped from the list: no longer trusted
        ManifestKeys.from_text(new, "t").unseal(sealed_before)


@pytest.mark.parametrize("text, why", [("k1:" + "ab" * 31, "fewer than 32"), ("k1" + "ab" * 32, "not <id>:<hex>"),
                                       ("k/1:" + "ab" * 32, "not <id>:<hex>"), ("k1:" + "zz" * 32, "not hex"),
                                       (f"k1:{'ab' * 32},k1:{'cd' * 32}", "twice"), (" , ", "no key")])
def test_unusable_keys_are_refused_without_echoing_them(text, why):
    with pytest.raises(ManifestKeyError, match=why) as e:
        ManifestKeys.from_text(text, "LASTGOOD_MANIFEST_KEYS")
    assert "abab" not in str(e.value) and "cdcd" not in str(e.value)


def test_the_key_file_is_generated_once_private_and_never_inside_the_store(tmp_path):
    settings = Settings(data_dir=tmp_path)
    first = ManifestKeys.from_settings(settings)
    path = tmp_path / "manifest.keys"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ManifestKeys.from_settings(settings) == first  # the next start reads the same key
    assert ManifestKeys.from_settings(Settings(data_dir=tmp_path, manifest_keys=new_entry())) != first  # the setting wins
    with pytest.raises(ManifestKeyError, match="inside the blob store"):
        ManifestKeys.from_settings(Settings(data_dir=tmp_path, manifest_key_file=tmp_path / "blobs" / "k"))


@pytest.mark.parametrize("member, value", [("generation", 2**63 - 1), ("generation", -1), ("step", 2**62 + 1),
                                           ("checkpoint_id", 0), ("world_size", True), ("parent_id", "6"),
                                           ("run", "../x"), ("attempt", ""), ("ranks", {})])
def test_from_dict_bounds_every_member(member, value):
    d = json.loads(M.to_bytes())
    assert Manifest.from_dict(dict(d)) == M  # control
    d[member] = value
    with pytest.raises(ManifestError):
        Manifest.from_dict(d)


@pytest.mark.parametrize("change", [
    lambda r: r[0].update(rank=2),                                          # not below the world size
    lambda r: r.append(dict(r[0])),                                         # a rank twice
    lambda r: r[0]["files"].append(dict(r[0]["files"][0])),                 # a file twice
    lambda r: r[0]["files"][0].update(size=2**63 - 1),
    lambda r: r[0]["files"][0].update(xxh3_128="C" * 32),
    lambda r: r[0]["files"][0].update(name="a/b"),
    lambda r: r[0]["files"][0].update(index={"xxh3_128": "a" * 32, "size": -1, "tensors": 1}),
    lambda r: r[0]["files"][0].update(index="x"),
])
def test_from_dict_bounds_every_rank_and_file(change):
    d = json.loads(M.to_bytes())
    change(d["ranks"])
    with pytest.raises(ManifestError):
        Manifest.from_dict(d)
