"""Parameter checks shared by the methods' constructors.

Each check returns the value (normalised: a numpy integer becomes an `int`, a tuple stays a tuple) or raises
`VTokenError` naming the method, the parameter, the value and its type, and what is accepted. Bools are never
numbers here (`True` is not a layer index or a weight), and NaN or infinite reals are refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from .errors import VTokenError


def _refuse(owner: str, name: str, value: object, expected: str) -> VTokenError:
    return VTokenError(f"{owner}: {name}={value!r} ({type(value).__name__}); expected {expected}")


def integer(owner: str, name: str, value: object, minimum: int | None = None, maximum: int | None = None,
            hint: str = "") -> int:  # fmt: skip
    """An int (not a bool, not a float such as 1.5 or 2.0) in [minimum, maximum]. `hint` follows the accepted
    range in the message (e.g. "an LLM layer index")."""
    bounds = [f">= {minimum}"] * (minimum is not None) + [f"<= {maximum}"] * (maximum is not None)
    expected = " and ".join(["an int", *bounds]).replace("int and", "int", 1) + (f" ({hint})" if hint else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _refuse(owner, name, value, expected)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _refuse(owner, name, value, expected)
    return int(value)


def real(owner: str, name: str, value: object, interval: str = "(-inf, inf)", hint: str = "") -> float:
    """A finite real number (an int or float, not a bool, NaN or inf) in `interval`, written as in mathematics:
    "(0, 1]", "[0, inf)", ... `hint` follows the accepted range in the message (e.g. "a temperature")."""
    left, right = interval[0], interval[-1]
    low, high = (float(x) for x in interval[1:-1].split(","))
    if math.isinf(low) and math.isinf(high):
        expected = "a finite number"
    elif math.isinf(high):
        expected = f"a number {'>' if left == '(' else '>='} {low:g}"
    else:
        expected = f"a number in {interval}"
    expected += f" ({hint})" if hint else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(owner, name, value, expected)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise _refuse(owner, name, value, expected)
    if number < low or number > high or (left == "(" and number == low) or (right == ")" and number == high):
        raise _refuse(owner, name, value, expected)
    return number


def choice(owner: str, name: str, value: object, accepted: Sequence[str]) -> str:
    """One of the strings in `accepted`."""
    if not isinstance(value, str) or value not in accepted:
        raise VTokenError(f"{owner}: {name}={value!r}; accepted: {', '.join(accepted)}")
    return value


def layer_indices(owner: str, name: str, value: object, example: str) -> tuple[int, ...]:
    """A non-empty, strictly ascending sequence of layer indices >= 0 (a tuple or list of ints)."""
    expected = f"a non-empty, strictly ascending tuple of LLM layer indices >= 0, e.g. {example}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _refuse(owner, name, value, expected)
    if any(isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0 for k in value):
        raise _refuse(owner, name, value, expected)
    layers = tuple(int(k) for k in value)
    if list(layers) != sorted(set(layers)):
        raise _refuse(owner, name, value, expected)
    return layers


def texts(owner: str, name: str, value: object) -> str | list[str]:
    """A non-empty string, or a non-empty list/tuple of non-empty strings (one per batch row)."""
    expected = "a non-empty string, or a non-empty list of them (one per prompt), or None"
    if isinstance(value, str):
        if not value.strip():
            raise _refuse(owner, name, value, expected)
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise _refuse(owner, name, value, expected)
    if any(not isinstance(v, str) or not v.strip() for v in value):
        raise _refuse(owner, name, value, expected)
    return list(value)
