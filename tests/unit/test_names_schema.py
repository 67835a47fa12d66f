"""The name rules' JSON Schema patterns (lastgood.wire.names.SCHEMA, in the OpenAPI
document) accept only what the checks accept (issue 36, finding 12: schema-valid names
were refused), and the run, file and attempt patterns accept all of it."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from lastgood.wire import names
from lastgood_service.domain.errors import InvalidArgument
from lastgood_service.domain.runs.curation import check_tag_name

CHECKS = {"run": names.check_run_name, "file": names.check_file_name, "attempt": names.check_attempt,
          "tag": check_tag_name}
EXACT = ("run", "file", "attempt")  # the pattern is the rule; a tag's is its portable part


def _schema_ok(kind: str, value: str) -> bool:
    rule = names.SCHEMA[kind]
    # ECMA-262 '$' is the end of the text; Python's also matches before a final newline
    return (rule["minLength"] <= len(value) <= rule["maxLength"]
            and re.fullmatch(rule["pattern"][1:-1], value) is not None)


def _check_ok(kind: str, value: str) -> bool:
    try:
        CHECKS[kind](value)
        return True
    except (names.InvalidName, InvalidArgument):
        return False


SAMPLES = ["a", "a.b", "a..b", ".a", "a.", "-a", "a-b_c.d", "a/b", "a\n", "", "x" * 128, "x" * 129, "x" * 201,
           "a:b", ":a", "..", ".", " a", "a ", "a b", "é", "last-good", "suspect"]


@settings(max_examples=400, database=None, deadline=None)
@given(kind=st.sampled_from(list(CHECKS)),
       value=st.one_of(st.text(alphabet="aZ09._-:/ \n\té", max_size=8), st.sampled_from(SAMPLES)))
def test_a_name_the_schema_allows_is_accepted(kind, value):
    if _schema_ok(kind, value) and value not in ("last-good", "suspect", "rollback-target", "pinned"):
        assert _check_ok(kind, value), (kind, value)
    if kind in EXACT and _check_ok(kind, value):
        assert _schema_ok(kind, value), (kind, value)


def test_controls_the_patterns_tell_names_apart():
    assert _schema_ok("run", "a.b-c") and not _schema_ok("run", "a..b") and not _schema_ok("run", "a\n")
    assert not _schema_ok("run", ".a") and _schema_ok("attempt", ".a") and not _schema_ok("attempt", "a..b")
    assert not _schema_ok("tag", " a") and _schema_ok("tag", "a b")
