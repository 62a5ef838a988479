"""converters/report.py's measure: the error of a converted tensor against its source, never NaN or inf."""

from __future__ import annotations

import pytest
import torch

from qconvert.converters.records import Dense
from qconvert.converters.report import NotFinite, measure


def test_finite_values_measure_as_before():
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert measure(Dense(src), src + 0.5) == (0.5, 0.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_source_value_that_is_not_finite_is_named_as_the_source(bad):
    src = torch.zeros(6, 4)
    src[4, 1] = bad
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), src.clone())  # a copy: nan - nan and inf - inf are both NaN
    e = info.value
    assert (e.in_source, e.what, e.row) == (True, "NaN" if bad != bad else "inf", 4)


def test_converted_values_that_are_not_finite_are_named_as_the_target():
    src = torch.ones(5, 3)
    decoded = src.clone()
    decoded[2, 0] = float("nan")  # Python's max(0.0, nan) is 0.0: this once measured as max error 0
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), decoded)
    assert (info.value.in_source, info.value.what, info.value.row) == (False, "NaN", 2)


def test_a_one_dimensional_tensor_names_no_row():
    src = torch.ones(8)
    src[3] = float("-inf")
    with pytest.raises(NotFinite) as info:
        measure(Dense(src), torch.ones(8))
    assert (info.value.in_source, info.value.what, info.value.row, str(info.value)) == (
        True, "inf", None, "source values hold inf")
