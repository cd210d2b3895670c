"""How a method declares its parameters: what each accepts (its type, range or choices), checked when the method
is built, and read by the tools that show or set it (the CLI's `--param` and `--budget`, the demo's controls, the
`vtoken eval` sweep, `applicable_methods`' fitting of LLM layers, the docs).

    params = {"layer": Layer(reads=1), "keep": Kept(), "alpha": Real("[0, 1]", hint="the base view's share")}

Every check returns the value (normalised: a numpy int becomes an `int`) or raises `VTokenError` (`BudgetError`
for a budget) naming the method, the parameter, the value and what is accepted (`vtoken.validation`'s messages).
Checks that relate parameters (PyramidDrop's one ratio per layer) stay in the method's `__post_init__`.

Light to import (no torch): the CLI reads declarations before anything heavy loads.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .budget import check_budget
from .errors import BudgetError, VTokenError
from .validation import integer, layer_indices, real, texts


@dataclass(frozen=True)
class Param:
    """A parameter's declaration. `hint` says what it means (it follows the accepted range in error messages).

    control: how the demo shows it ("budget", "int", "count", "float", "choice", "layers", "fractions", "counts",
    "optional_int", "optional_float"; "" for none: set it in code or with `--param`)."""

    hint: str = field(default="", kw_only=True)

    control: ClassVar[str] = ""

    def check(self, method: Any, name: str, value: Any) -> Any:
        """`value` checked for parameter `name` of `method` (a method instance; its `name` starts the message)."""
        return value

    def accepts(self, value: Any) -> bool:
        """Whether a number given for every method's budget at once (`vtoken run --budget`) is meant for this
        parameter: a budget takes any (and says why one is wrong), official settings only counts."""
        return True

    def text(self) -> str:
        """What it accepts, in words (the CLI's `vtoken list` and the docs)."""
        return self.hint


@dataclass(frozen=True)
class Kept(Param):
    """A fraction of the tokens kept in (0, 1] or a token count >= 1 (`counts=False`: a rate, fractions only)."""

    counts: bool = True

    control: ClassVar[str] = "budget"

    def check(self, method: Any, name: str, value: Any) -> Any:
        value = check_budget(value, f"{method.name}: {name}")
        if not self.counts and isinstance(value, int):
            raise BudgetError(f"{method.name}: the {name} is a rate, a fraction in (0, 1]; got the count {value!r}")
        return value

    def text(self) -> str:
        what = "a fraction kept in (0, 1]" + (" or a token count >= 1" if self.counts else "")
        return what + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Int(Param):
    """An int (not a bool, not 2.0) in [minimum, maximum]."""

    minimum: int | None = None
    maximum: int | None = None

    control: ClassVar[str] = "count"

    def check(self, method: Any, name: str, value: Any) -> Any:
        return integer(method.name, name, value, self.minimum, self.maximum, hint=self.hint)

    def text(self) -> str:
        bounds = [f">= {self.minimum}"] * (self.minimum is not None) + [f"<= {self.maximum}"] * (
            self.maximum is not None
        )
        return " ".join(["an int", " and ".join(bounds)]).strip() + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Layer(Int):
    """An LLM layer index (>= `minimum`). `reads`: how many layers before it the method reads (DART scores at the
    input of layer K with layer K - 1: 1). On an LLM too shallow for the default, `applicable_methods` and the
    demo move it to the deepest softmax-attention layer that fits (see `Method.fit`)."""

    minimum: int | None = 0
    reads: int = 0
    hint: str = field(default="an LLM layer index", kw_only=True)

    control: ClassVar[str] = "int"


@dataclass(frozen=True)
class Real(Param):
    """A finite real number in `interval`, written as in mathematics: "(0, 1]", "[0, inf)", ..."""

    interval: str = "(-inf, inf)"

    control: ClassVar[str] = "float"

    def check(self, method: Any, name: str, value: Any) -> Any:
        return real(method.name, name, value, self.interval, hint=self.hint)

    @property
    def bounds(self) -> tuple[float, float]:
        low, high = (float(x) for x in self.interval[1:-1].split(","))
        return low, high

    def text(self) -> str:
        return f"a number in {self.interval}" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Choice(Param):
    """One of `options` (strings, or ints such as a tile size; never a bool)."""

    options: tuple = ()

    control: ClassVar[str] = "choice"

    def choices(self, method: Any) -> tuple:
        """The accepted values for `method` (a class or an instance)."""
        return tuple(self.options)

    def check(self, method: Any, name: str, value: Any) -> Any:
        options = self.choices(method)
        if not any(_same_kind(value, o) and value == o for o in options):
            hint = f" ({self.hint})" if self.hint else ""
            raise VTokenError(f"{method.name}: {name}={value!r}; accepted: {', '.join(map(str, options))}{hint}")
        return int(value) if isinstance(value, numbers.Integral) else value

    def accepts(self, value: Any) -> bool:
        return any(_same_kind(value, o) for o in self.options)

    def text(self) -> str:
        return "one of " + ", ".join(map(repr, self.options)) + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Flag(Choice):
    """True or False (not 0 or 1)."""

    options: tuple = (True, False)

    def check(self, method: Any, name: str, value: Any) -> Any:
        return bool(super().check(method, name, value))  # not Choice's int(): a bool is an Integral

    def text(self) -> str:
        return "True or False" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class MergeSchedule(Param):
    """Tokens merged per layer (ToMe's `r`): an int >= 0 (every merging layer), a list of ints >= 0 (layer 0, 1, ...;
    missing layers merge none) or a tuple (r, inflection) with an int r >= 0 and a real inflection (ToMe's
    `parse_r`: a schedule from r * (1 - inflection) to r * (1 + inflection)). Returned as an int, a list of ints
    or a (int, float) tuple."""

    control: ClassVar[str] = ""  # set it in code or with `--param` (an int, a list or a tuple)

    def check(self, method: Any, name: str, value: Any) -> Any:
        expected = (
            "an int >= 0 (every merging layer), a list of ints >= 0 (one per layer from 0) or a tuple "
            "(r, inflection) as ToMe's parse_r (e.g. (16, -1.0): 32 merged in layer 0 down to 0)"
        )

        def count(item: Any) -> bool:
            return isinstance(item, numbers.Integral) and not isinstance(item, bool) and item >= 0

        if isinstance(value, list) and all(count(v) for v in value):
            return [int(v) for v in value]
        if isinstance(value, tuple) and len(value) == 2 and count(value[0]):
            return int(value[0]), real(method.name, f"{name}[1]", value[1], hint="the (r, inflection) schedule's")
        if count(value):
            return int(value)
        raise VTokenError(f"{method.name}: {name}={value!r}; expected {expected}")

    def accepts(self, value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    def text(self) -> str:
        return "an int >= 0, a list of ints >= 0 (per layer) or (r, inflection)" + (
            f" ({self.hint})" if self.hint else ""
        )


@dataclass(frozen=True)
class Scope(Choice):
    """What an encoder method's budget counts over: one of the method class's `scopes` ("crop": every crop or
    video frame keeps its budget; "image": an image or video keeps its budget over all its crops or frames;
    "split": an image's budget shared equally by its crops)."""

    def choices(self, method: Any) -> tuple:
        return tuple(method.scopes)

    def text(self) -> str:
        return "what the budget counts over: one of the method's `scopes` ('crop', 'image', 'split')"


@dataclass(frozen=True)
class Layers(Param):
    """A non-empty, strictly ascending tuple of LLM layer indices >= 0; `example` shows one (the official)."""

    example: str = ""

    control: ClassVar[str] = "layers"

    def check(self, method: Any, name: str, value: Any) -> Any:
        return layer_indices(method.name, name, value, self.example)

    def text(self) -> str:
        return f"ascending LLM layer indices, e.g. {self.example}" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Fractions(Param):
    """A tuple of fractions, one per layer of the method's `layers` (the method checks them against its layers)."""

    control: ClassVar[str] = "fractions"

    def text(self) -> str:
        return "fractions, one per layer" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Counts(Param):
    """A tuple of token counts, one per layer of the method's `layers` (the method checks them against its layers)."""

    control: ClassVar[str] = "counts"

    def text(self) -> str:
        return "token counts, one per layer" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class Texts(Param):
    """A non-empty string, or a non-empty list of them (one per prompt)."""

    def check(self, method: Any, name: str, value: Any) -> Any:
        return texts(method.name, name, value)

    def text(self) -> str:
        return "a string, or one per prompt" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class OrNone(Param):
    """None (the method's default behaviour), or what `param` accepts."""

    param: Param = Param()

    @property
    def control(self) -> str:  # type: ignore[override]
        inner = self.param.control
        return {"count": "optional_int", "int": "optional_int", "float": "optional_float"}.get(inner, inner)

    def check(self, method: Any, name: str, value: Any) -> Any:
        return None if value is None else self.param.check(method, name, value)

    def accepts(self, value: Any) -> bool:
        return self.param.accepts(value)

    def text(self) -> str:
        return f"None or {self.param.text()}"


def _same_kind(value: Any, option: Any) -> bool:
    if isinstance(value, bool) or isinstance(option, bool):
        return isinstance(value, bool) and isinstance(option, bool)
    if isinstance(option, numbers.Integral):
        return isinstance(value, numbers.Integral)
    if isinstance(option, numbers.Real):
        return isinstance(value, numbers.Real) and not (isinstance(value, float) and math.isnan(value))
    return isinstance(value, type(option))


def own(spec: Param) -> Param:
    """The declaration a parameter's value follows: `OrNone(X)` -> X."""
    return spec.param if isinstance(spec, OrNone) else spec


__all__ = [
    "Param",
    "Kept",
    "Int",
    "Layer",
    "Real",
    "Choice",
    "Scope",
    "Flag",
    "MergeSchedule",
    "Layers",
    "Fractions",
    "Counts",
    "Texts",
    "OrNone",
    "own",
]
