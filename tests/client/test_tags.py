"""Tags, aliases and pins from the trainer's side (Checkpointer.tag / untag / pin)."""

from __future__ import annotations

import pytest
from torch import nn

import lastgood


def tag_names(svc, cid):
    return {t["name"] for t in svc.get(f"/api/v1/checkpoints/{cid}").json()["tags"]}


def test_checkpointer_tags_pins_and_aliases(service, run_name):
    state = lastgood.TrainState(model=nn.Linear(2, 2))
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, state)
        first = ckpt._target(None)
        ckpt.tag("pre-lr-change")                 # the last save, by default
        ckpt.tag("best", alias=True)
        ckpt.pin()
        ckpt.save(2, state)
        second = ckpt._target(None)
        assert ckpt.tag("best", alias=True)["moved_from"] == first
        ckpt.untag("pre-lr-change", checkpoint_id=first)
        ckpt.pin(first, pinned=False)
        with pytest.raises(lastgood.ServiceError, match="system tag"):
            ckpt.tag("suspect")
    assert tag_names(service, first) == set()
    assert tag_names(service, second) == {"best", "last-good"}


def test_tag_before_any_save_is_a_clear_error(service, run_name):
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        with pytest.raises(lastgood.LastgoodError, match="nothing saved yet"):
            ckpt.tag("x")
