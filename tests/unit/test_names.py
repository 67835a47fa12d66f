from __future__ import annotations

import pytest

from lastgood.wire import names


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "..", "a..b", ".hidden", "x" * 201, "a\x00b", "a b", None, 3])
def test_bad_file_names_are_refused(bad):
    with pytest.raises(names.InvalidName):
        names.check_file_name(bad)


@pytest.mark.parametrize("good", ["rank00000.safetensors", "a", "x_1-2.bin"])
def test_good_file_names_pass(good):
    assert names.check_file_name(good) == good


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 129, "-lead"])
def test_bad_run_names_are_refused(bad):
    with pytest.raises(names.InvalidName):
        names.check_run_name(bad)


# issue 10 (5): `re.match(...$)` accepted a trailing newline; every rule is a full match now
@pytest.mark.parametrize("check, good", [
    (names.check_run_name, "run-1"),
    (names.check_file_name, "nl.bin"),
    (names.check_attempt, "a:1"),
])
@pytest.mark.parametrize("tail", ["\n", "\r\n", "\n\n"])
def test_a_trailing_newline_is_refused_for_every_kind(check, good, tail):
    assert check(good) == good  # control: the name without the newline passes
    with pytest.raises(names.InvalidName):
        check(good + tail)


@pytest.mark.parametrize("tail", ["\n", "\r\n"])
def test_spool_names_refuse_a_trailing_newline(tail):
    hand_over, lent = "0123456789abcdef0123456789abcdef.part", ".out/0123456789abcdef0123456789abcdef.part"
    assert names.is_spool_name(hand_over) and names.is_lent_name(lent)  # control
    assert not names.is_spool_name(hand_over + tail)
    assert not names.is_lent_name(lent + tail)


@pytest.mark.parametrize("value", [-1, names.MAX_ID + 1, 10**20, True, 1.0, "1", None])
def test_integers_out_of_bounds_are_refused(value):
    assert names.check_int("id", 5) == 5
    with pytest.raises(names.InvalidValue):
        names.check_int("id", value)
