"""`check_choice`: the one check of a setting that names one of a `Literal`'s values."""

from __future__ import annotations

from typing import Literal

import pytest

from captioning.choices import check_choice
from captioning.models.fast_path import FastPathSetting


def test_a_value_outside_the_literal_is_one_line_listing_the_choices() -> None:
    check_choice("fast_path", "graphs", FastPathSetting)  # allowed: nothing raised
    with pytest.raises(ValueError) as info:
        check_choice("fast_path", "fast", FastPathSetting)
    assert str(info.value) == ("fast_path must be 'auto', 'off', 'native', 'compile' or 'graphs', "
                               "got 'fast'")
    with pytest.raises(ValueError, match=r"^x must be 'a' or 'b', got 3$"):
        check_choice("x", 3, Literal["a", "b"])
    with pytest.raises(ValueError, match=r"^x must be 'a', got None$"):
        check_choice("x", None, Literal["a"])
