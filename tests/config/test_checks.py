"""The field checks every config runs: errors name the owner, the field, the value and the
allowed range; valid values pass silently."""

from __future__ import annotations

import pytest

from xlm.config.checks import _invalid, _positive_int, _require


def test_invalid_names_owner_field_value_and_range():
    e = _invalid("SchedulerConfig", "max_num_seqs", "8", "a positive integer")
    assert isinstance(e, ValueError)
    assert str(e) == "SchedulerConfig.max_num_seqs='8' is invalid: allowed a positive integer"


def test_require_raises_only_when_the_condition_fails():
    _require(True, "C", "x", 3, "anything")
    with pytest.raises(ValueError, match=r"^C\.x=3 is invalid: allowed 0 to 2$"):
        _require(False, "C", "x", 3, "0 to 2")


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_integers_pass(value):
    _positive_int("C", "n", value)
    _positive_int("C", "n", value, optional=True)


@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, True, "3", None])
def test_anything_else_is_refused_naming_the_value(value):
    with pytest.raises(ValueError) as e:
        _positive_int("C", "n", value)
    assert str(e.value) == f"C.n={value!r} is invalid: allowed a positive integer"


def test_optional_takes_none_and_says_so_when_refusing():
    _positive_int("C", "n", None, optional=True)
    with pytest.raises(ValueError, match=r"C\.n=0 is invalid: allowed a positive integer or None"):
        _positive_int("C", "n", 0, optional=True)
