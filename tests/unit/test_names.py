from __future__ import annotations

import pytest

from lastgood import names


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
