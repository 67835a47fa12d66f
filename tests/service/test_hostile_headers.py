"""Shard headers are bounded before they are parsed or multiplied out (lastgood/wire/format.py).

The hostile headers are the benchmark's (bench/headers.py measures the service's memory
under them): each is refused with INVALID_ARGUMENT and a bounded message naming the limit
it broke, or - the worst the limits allow - accepted; the service answers normally after.
"""

from __future__ import annotations

import grpc
import pytest

from bench.headers import hostile, zero_tensors

from .helpers import Client, make_shard, shard_name

CASES = {**hostile(), "the largest valid header": (zero_tensors(), None)}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_shard_headers_get_invalid_argument(svc, cl, run_name, name):
    data, word = CASES[name]
    cid = cl.begin(run_name).checkpoint_id
    if word is None:
        assert cl.put(cid, 0, shard_name(0), data, chunk=4 * 1024 * 1024).size == len(data)
    else:
        with pytest.raises(grpc.RpcError) as info:
            cl.put(cid, 0, shard_name(0), data, chunk=4 * 1024 * 1024)
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert word in err.details() and len(err.details()) <= 1200, err.details()[:300]
    with Client(svc.grpc_target) as other:  # the service goes on as before
        ok = other.begin(run_name, step=2).checkpoint_id
        other.put(ok, 0, shard_name(0), make_shard(0))
        assert other.vote(ok, 0, [shard_name(0)], wait=2).status == "COMMITTED"


def test_a_shard_header_over_the_limit_is_refused_by_the_client_before_upload():
    """One owner: the trainer's writer and the service share the limits of format.py."""
    from lastgood.errors import FormatError
    from lastgood.wire.format import MAX_HEADER_BYTES, TensorSpec, plan_layout

    with pytest.raises(FormatError, match="over the"):
        plan_layout([TensorSpec("t", "U8", (1,))], {"lastgood.state": "x" * MAX_HEADER_BYTES})
    with pytest.raises(FormatError, match="bad shape"):
        plan_layout([TensorSpec("t", "U8", (1,) * 65)], {})
