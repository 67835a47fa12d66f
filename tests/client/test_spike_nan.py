"""SpikeGuard on the most common spike, a NaN loss (issue 10, item 3): the rollback is
recorded with the non-finite loss and gradient norm as strings JSON can carry, and the
run's events and lineage stay readable."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lastgood
from lastgood.wire import jsonvalues


@pytest.mark.parametrize("loss, grad, text", [(math.nan, math.nan, "nan"), (math.inf, -math.inf, "inf")])
def test_a_non_finite_spike_is_recorded_and_the_history_stays_readable(service, run_name, loss, grad, text):
    model = nn.Linear(2, 2)
    state = lastgood.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        guard = lastgood.SpikeGuard(ckpt, state, min_history=2)
        for step in range(1, 4):
            assert not guard.observe(step, 1.0, grad_norm=0.5)
            ckpt.save(step, state)
        assert guard.observe(4, loss, grad_norm=grad)  # rolled back
        assert guard.next_step == 4
    r = service.get(f"/api/v1/runs/{run_name}/events")
    assert r.status_code == 200, r.text[:300]
    spike = next(e for e in r.json()["items"] if e["kind"] == "spike")["data"]
    assert spike["loss"] == text and spike["value"] == text and spike["grad_norm"] == jsonvalues.carry(grad)
    assert service.get(f"/api/v1/runs/{run_name}/lineage").status_code == 200
