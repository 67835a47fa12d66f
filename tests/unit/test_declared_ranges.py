"""Range digests a writer declares (lastgood.wire.ranges: hasher_of, check_declared, FileCheck):
computed by the service's rule, checked for shape against the file's own header, and
recomputed from the stored bytes by a checking peer. Torch-free, no service."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save

from lastgood.errors import FormatError
from lastgood.wire.format import header_length, parse_header, tensor_index
from lastgood.wire.ranges import FileCheck, check_declared, fingerprint, hasher_of

CAP = 64 * 1024


def file() -> tuple[bytes, int, dict, dict]:
    data = save({"a": np.arange(300_000, dtype=np.float32), "b": np.arange(10, dtype=np.int64)})
    n = header_length(data[:8])
    tensors = tensor_index(parse_header(data[:n])[0])
    h = hasher_of(data, CAP)
    h.update(data)
    return data, n, tensors, h.digests()


def test_declared_digests_of_the_right_shape_are_accepted_and_canonical():
    _data, n, tensors, digests = file()
    assert check_declared(n, tensors, {**digests}, CAP) == digests


@pytest.mark.parametrize("bad, match", [
    (lambda d: d["tensors"].update(a=d["tensors"]["a"] * 50), "digests for"),          # too many blocks
    (lambda d: d["tensors"].update(a=d["tensors"]["a"][:-1]), "digests for"),          # other extents
    (lambda d: d["tensors"].update(c=["0" * 32]), "name"),                              # not in the header
    (lambda d: d.update(block=CAP * 2), "rule"),                                        # another rule
    (lambda d: d.update(extra=1), "unknown keys"),
    (lambda d: d["tensors"].update(b=["xyz"]), "hex"),
    (lambda d: d.update(tensors=[]), "tensors"),
])
def test_declared_digests_of_another_shape_are_refused(bad, match):
    _data, n, tensors, digests = file()
    d = {**digests, "tensors": {k: list(v) for k, v in digests["tensors"].items()}}
    bad(d)
    with pytest.raises(FormatError, match=match):
        check_declared(n, tensors, d, CAP)


def test_a_peer_recomputes_the_declared_digests_from_the_bytes_and_notices_a_changed_byte():
    data, _n, _tensors, digests = file()
    rule = {k: digests[k] for k in ("block", "split", "floor")}
    check = FileCheck(rule)
    for i in range(0, len(data), 7777):  # any chunking
        check.update(data[i:i + 7777])
    assert fingerprint(check.digests()) == fingerprint(digests)
    changed = bytearray(data)
    changed[-5] ^= 1
    check = FileCheck(rule)
    check.update(changed)
    assert fingerprint(check.digests()) != fingerprint(digests)
    assert FileCheck(None).digests() is None  # no rule: nothing declared, nothing to recompute


@pytest.mark.parametrize("mib, declared", [(96, False), (64, True)])
def test_a_writer_computes_no_digests_it_could_not_declare(mib, declared):
    """Over ~22,000 segments the digests pass DECLARE_BYTES and are never sent: the writers
    (directs3.prepare, directfs) used to compute them anyway, a second xxh3 pass and a dict
    of hex strings thrown away. The header says how many there would be, so none are
    computed; the control, under the limit, still gets them. (At the smallest cap, 4 KiB,
    96 MiB of tensors is ~24,600 segments, 64 MiB ~16,400.)"""
    from lastgood.datapath import directs3
    from lastgood.wire import ranges

    data = save({f"t{i}": np.zeros(mib * 1024 * 1024 // 4 // 64, dtype=np.float32) for i in range(64)})
    parts = directs3.prepare(data, 64 * 1024 * 1024, ranges.MIN_BLOCK)
    assert (parts.digests is not None) is declared
    if declared:
        assert ranges.declarable(parts.digests)
