"""An error that is not the service's own answer (a proxy's or load balancer's bare 404 or
409, with no lastgood error code) says nothing about the checkpoint: restore must not take
it for damage and fall back to an older checkpoint (the job would silently lose the newer
progress and fork the run). It fails clearly instead; the next launch restores the newest.
Control: the same restore without the proxy's error restores the newest checkpoint."""

from __future__ import annotations

import pytest
from torch import nn

import lastgood
from lastgood.errors import ServiceError

from .proxy import proxy


@pytest.mark.parametrize("status", [404, 409])
def test_a_proxys_bare_error_is_not_damage(service, run_name, status):
    state = lastgood.TrainState(model=nn.Linear(8, 8), extra={})
    with lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        ckpt.save(2, state)
        ckpt.wait()
        newest = ckpt.last_saved.checkpoint_id

    with proxy(service.url, f"/api/v1/checkpoints/{newest}/manifest", status) as (url, handler):
        with lastgood.Checkpointer(url, run=run_name, heartbeat_seconds=0) as ckpt, pytest.raises(ServiceError) as failed:
            ckpt.restore(lastgood.TrainState(model=nn.Linear(8, 8), extra={}))
        assert not failed.value.coded
        handler.fail_path = ""  # control: the same proxy, answering
        with lastgood.Checkpointer(url, run=run_name, heartbeat_seconds=0) as ckpt:
            assert ckpt.restore(lastgood.TrainState(model=nn.Linear(8, 8), extra={})) == 2
    assert service.get(f"/api/v1/checkpoints/{newest}").json()["status"] == "COMMITTED"

