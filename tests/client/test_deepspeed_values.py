"""The non-tensor values of DeepSpeed's state_dicts through lastgood.integrations.deepspeed
and the codec (#37): its loss scalers and fragment addresses come back as such, from an
allow-list of classes; any other object is refused with its key named; a stored name
outside the allow-list is refused on load (nothing is imported or unpickled)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from lastgood.errors import LastgoodError
from lastgood.state.codec import Encoder, UnsupportedValue, decode

pytestmark = pytest.mark.slow  # importing DeepSpeed takes seconds of CPU: not at collection


@pytest.fixture(autouse=True)
def _deepspeed():
    import deepspeed  # noqa: F401  (pinned in requirements-dev.txt: a missing install fails, never skips)


def _round_trip(value):
    from lastgood.integrations.deepspeed import revived, storable

    enc = Encoder()
    stored = enc.encode(storable(value), ["deepspeed"])
    return revived(decode(stored, lambda name, device: enc.tensors[name], lambda name: enc.tensors[name]))


def test_deepspeeds_objects_come_back_as_such():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    dynamic = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=50, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False, dtype=torch.float16)
    dynamic.cur_iter, dynamic.last_overflow_iter = 7, 3
    sd = {"optimizer_state_dict": {
        "loss_scaler": LossScaler(4.0), "dynamic": dynamic,
        "param_slice_mappings": [OrderedDict([("0.weight", fragment_address(numel=64, start=0))])],
        "single_partition_of_fp32_groups": [torch.arange(4.0)]},
        "param_shapes": [OrderedDict([("0.weight", torch.Size([16, 4]))])], "ds_version": "0.19.8"}
    back = _round_trip(sd)["optimizer_state_dict"]
    assert type(back["loss_scaler"]) is LossScaler and back["loss_scaler"].cur_scale == 4.0
    d = back["dynamic"]
    assert type(d) is DynamicLossScaler and vars(d) == vars(dynamic) and d.dtype is torch.float16
    assert back["param_slice_mappings"][0]["0.weight"] == fragment_address(numel=64, start=0)
    assert back["single_partition_of_fp32_groups"][0].equal(torch.arange(4.0))


def test_another_object_is_refused_with_its_key_named():
    class Custom:
        pass

    with pytest.raises(UnsupportedValue, match=r"at 'deepspeed\.optimizer_state_dict\.extra'.*never pickles"):
        _round_trip({"optimizer_state_dict": {"extra": Custom()}})
    # a look-alike class of the same name is not DeepSpeed's: refused too
    LookAlike = type("LossScaler", (), {})
    with pytest.raises(UnsupportedValue, match="LossScaler"):
        _round_trip({"s": LookAlike()})


def test_a_stored_name_outside_the_allow_list_is_refused():
    from lastgood.integrations.deepspeed import revived

    with pytest.raises(LastgoodError, match="unknown DeepSpeed object 'os.system'"):
        revived({"__deepspeed__": "os.system", "state": {}})
