"""LastgoodTrainer's refusals (#37): each says what to do, before anything trains or is
written; a real service, an in-process Trainer on a tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from lastgood.errors import LastgoodError, NotFound  # noqa: E402
from lastgood.integrations.hf import LastgoodTrainer  # noqa: E402


def _trainer(service, run_name, tmp_path, eval_dataset=None, **args) -> LastgoodTrainer:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16, n_positions=4,
                                       bos_token_id=0, eos_token_id=0))
    rows = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                              report_to=[], use_cpu=True, disable_tqdm=True, **args)
    data = [{"input_ids": r, "labels": r} for r in rows]
    return LastgoodTrainer(model=model, args=targs, train_dataset=data, eval_dataset=data if eval_dataset else None,
                           lastgood_url=service.url, lastgood_run=run_name)


def _untouched(service, run_name, trainer, tmp_path) -> None:
    assert trainer.state.global_step == 0
    assert service.get(f"/api/v1/runs/{run_name}/last-good").status_code == 404
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


def test_a_trainer_folder_is_refused_it_holds_pickles(service, run_name, tmp_path):
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / "optimizer.pt").write_bytes(b"\x80\x04not read")  # the Trainer's own: a pickle, never loaded
    t = _trainer(service, run_name, tmp_path)
    with pytest.raises(LastgoodError, match="reads no Trainer checkpoint folder.*pickles"):
        t.train(resume_from_checkpoint=str(folder))
    _untouched(service, run_name, t, tmp_path)


def test_an_unknown_tag_and_an_empty_run_are_refused_before_training(service, run_name, tmp_path):
    t = _trainer(service, run_name, tmp_path)
    assert t.resume() is None  # a new run: start it
    with pytest.raises(LastgoodError, match="has no checkpoint to resume from"):
        t.train(resume_from_checkpoint="last-good")
    with pytest.raises(NotFound, match="no-such-tag"):
        t.train(resume_from_checkpoint="no-such-tag")
    _untouched(service, run_name, t, tmp_path)
    t.train()  # the refusals left nothing open: the same trainer trains, saves at the end and resumes
    assert t.resume() == "last-good"
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 2


def test_what_needs_the_trainers_folders_is_refused_at_construction(service, run_name, tmp_path):
    with pytest.raises(LastgoodError, match="load_best_model_at_end"):
        _trainer(service, run_name, tmp_path, eval_dataset=True, load_best_model_at_end=True,
                 eval_strategy="steps", save_strategy="steps")
    with pytest.raises(TypeError, match="solo"):
        LastgoodTrainer(model=torch.nn.Linear(1, 1), lastgood_url=service.url, lastgood_run=run_name,
                        lastgood_options={"solo": False})
