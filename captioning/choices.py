"""One check for the settings that take one of a few named values, each a `Literal` type."""

from __future__ import annotations

from typing import Any, get_args


def check_choice(name: str, value: object, kind: Any) -> None:
    """Refuse `value` unless it is one of the `Literal` type `kind`'s values, in one line:
    "NAME must be 'a', 'b' or 'c', got 'x'"."""
    choices = get_args(kind)
    if value not in choices:
        names = [repr(c) for c in choices]
        listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise ValueError(f"{name} must be {listed}, got {value!r}")
