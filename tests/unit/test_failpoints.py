"""LASTGOOD_FAILPOINT names one of failpoints.Failpoint, and any other name is refused when
the settings are built, at start: a misspelt failpoint would arm nothing, and the test that
meant it would pass without testing anything."""

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import lastgood_service
from lastgood_service.failpoints import Failpoint
from lastgood_service.settings import Settings

SERVICE = Path(lastgood_service.__file__).resolve().parent


@pytest.mark.parametrize("name", ["crash_befor_manifest", "CRASH_BEFORE_MANIFEST", "blob_eio ", "vote_fails_on_checkpoint_",
                                  "vote_fails_on_checkpoint_x", "vote_fails_on_checkpoint_<id>"])
def test_an_unknown_failpoint_is_refused_with_the_valid_names(name):
    with pytest.raises(ValidationError, match=f"unknown failpoint {re.escape(repr(name))}") as refused:
        Settings(failpoint=name)
    assert all(p.value in str(refused.value) for p in Failpoint), "the refusal lists every valid name"


def test_an_unknown_failpoint_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("LASTGOOD_FAILPOINT", "lose_commit_replies")  # as the service reads it
    with pytest.raises(ValidationError, match="unknown failpoint 'lose_commit_replies'"):
        Settings()


@pytest.mark.parametrize("name", [p.value for p in Failpoint if p is not Failpoint.VOTE_FAILS_ON_CHECKPOINT]
                         + ["vote_fails_on_checkpoint_17"])
def test_every_known_failpoint_is_accepted(name):
    """The control: every point the code has is accepted as it is spelt, and none is the default."""
    assert Settings(failpoint=name).failpoint == name
    assert Settings().failpoint is None


def test_the_checkpoint_failpoint_carries_its_checkpoint():
    assert Failpoint.parse("vote_fails_on_checkpoint_17") == (Failpoint.VOTE_FAILS_ON_CHECKPOINT, 17)
    assert Failpoint.parse("vote_batch_fails_once") == (Failpoint.VOTE_BATCH_FAILS_ONCE, None)


def test_every_failpoint_is_somewhere_in_the_code():
    """The enum lists the points the code has: each member is named by a module that acts on
    it, and no module compares the setting with a string of its own."""
    code = {p: p.read_text() for p in SERVICE.rglob("*.py") if p.name != "failpoints.py"}
    unused = [p.name for p in Failpoint if not any(f"Failpoint.{p.name}" in text for text in code.values())]
    assert not unused, f"failpoints nothing arms: {unused}"
    spelled = [f"{path.relative_to(SERVICE)}: {line.strip()}" for path, text in code.items()
               for line in text.splitlines() if re.search(r"failpoint\)? *[!=]= *[\"']", line)]
    assert not spelled, f"compare with a Failpoint member: {spelled}"
