"""LastgoodAccelerator's refusals (#37): a folder, a value that is not JSON, a pre-hook,
automatic folder naming; each is a clear error that changes nothing, and the same
Accelerator then saves and loads. A real service, an in-process Accelerator."""

from __future__ import annotations

import pytest

import accelerate  # noqa: F401  (pinned in requirements-dev.txt: a missing install fails, never skips)

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from lastgood.errors import LastgoodError  # noqa: E402
from lastgood.integrations.accelerate import LastgoodAccelerator  # noqa: E402


class Holder:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@pytest.fixture
def accelerator(service, run_name):
    acc = LastgoodAccelerator(cpu=True, lastgood_url=service.url, lastgood_run=run_name)
    yield acc
    acc.close_checkpointer()
    AcceleratorState._reset_state(True)  # the next test's Accelerator starts afresh


def test_folders_non_json_values_and_hooks_are_refused_and_change_nothing(service, run_name, accelerator, tmp_path):
    acc = accelerator
    model = acc.prepare(torch.nn.Linear(2, 2))
    holder = Holder(tmp_path)  # a Path: not a JSON value, never pickled
    acc.register_for_checkpointing(holder)
    with pytest.raises(LastgoodError, match="not to a folder: call save_state"):
        acc.save_state(str(tmp_path / "ckpt"))
    with pytest.raises(LastgoodError, match=r"cannot save the Accelerator's state: .*custom_0\.value"):
        acc.save_state(step=1)
    handle = acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(LastgoodError, match="pre-hooks read or write a folder"):
        acc.save_state(step=1)
    handle.remove()
    (tmp_path / "old").mkdir()
    with pytest.raises(LastgoodError, match="reads no folder of Accelerate's"):
        acc.load_state(str(tmp_path / "old"))
    with pytest.raises(LastgoodError, match="has no checkpoint to load"):
        acc.load_state("last-good")
    assert acc.resume() is None and acc.save_iteration == 0
    assert service.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]

    holder.value = 7  # the refusals left nothing open: the same Accelerator saves and loads
    assert acc.save_state() == 0 and acc.save_iteration == 1
    acc.checkpointer.wait()
    want = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    holder.value, acc.project_configuration.iteration = 0, 5
    assert acc.load_state(acc.resume()) == 0
    assert model.weight.equal(want) and holder.value == 7 and acc.save_iteration == 1


def test_automatic_checkpoint_naming_is_refused_at_construction(service, run_name, tmp_path):
    try:
        with pytest.raises(LastgoodError, match="automatic_checkpoint_naming names folders"):
            LastgoodAccelerator(cpu=True, lastgood_url=service.url, lastgood_run=run_name,
                                project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    finally:
        AcceleratorState._reset_state(True)
    assert not any(tmp_path.iterdir())
