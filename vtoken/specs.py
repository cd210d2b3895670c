"""Method specs as text, one syntax for `vtoken run`, `vtoken eval` and lmms-eval's `--model_args`.

`hired+fastv` composes stages. A method's parameter is written `name.param=value` (`fastv.keep=0.25`);
unprefixed it goes to the one listed method that accepts it (`budget=0.2,keep=0.5` with hired+fastv), and a
parameter two listed methods accept must be prefixed. `1` is the int 1 (one token): write `budget=1.0` to keep
every token. Lists are written in brackets: `mustdrop.layers=[2,6,10,14]`; `none` is None.

Light to import (no torch): the CLI parses its options with it before anything heavy loads.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .budget import DEFAULT_BUDGET
from .errors import UnknownMethodError, VTokenError
from .registry import available_methods, make_method, method_class

if TYPE_CHECKING:
    from .methods.base import Method


def _accepted(cls: type[Method]) -> list[str]:
    return [f.name for f in fields(cls) if f.init]


def common_budget(cls, budget: float | int | None) -> str | None:
    """The parameter of method class `cls` that a budget given to every method at once sets (`--budget`, the
    demo's start, `vtoken eval --budgets`), or None: its declared `budget_param` where the value is meant for it
    (SparseVLM's official settings take counts, not fractions). Without a value (None), only an encoder-stage
    budget starts at the common default (`DEFAULT_BUDGET`): an LLM stage's (FastV's `keep`) keeps its own."""
    knob = cls.budget_param
    if knob is None:
        return None
    spec = cls.declared_params()[knob]
    if budget is None:
        return knob if "encoder" in cls.stages and spec.accepts(DEFAULT_BUDGET) else None
    return knob if spec.accepts(budget) else None


def parse_param(text: str, flag: str = "--param") -> tuple[str, Any]:
    """'fastv.keep=0.5' -> ("fastv.keep", 0.5): the value read as an int, float, bool, None or list where it
    is one (as lmms-eval reads `--model_args`), else kept as text."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise VTokenError(f"{flag} {text!r}; write NAME=VALUE, e.g. fastv.keep=0.5 or budget=144")
    return key.strip(), _scalar(value.strip())


def _scalar(value: str) -> Any:
    """A command-line value: numbers, true/false and none become Python values; lists are read by `_value`."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def _value(value: Any) -> Any:
    """Numbers and booleans are already Python values (lmms-eval and `parse_param` read them); this adds None and
    lists."""
    if isinstance(value, str):
        if value.lower() == "none":
            return None
        if value[:1] in "[(":
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise VTokenError(f"cannot read {value!r} as a list; write it like [2,6,10,14]") from None
            return tuple(parsed) if isinstance(parsed, list) else parsed
    return value


def _named(flag: str, value: Any) -> str:
    """How an error quotes an option: `model_args method='x'` (lmms-eval's key=value), `--method 'x'` (a flag)."""
    return f"{flag}={value!r}" if flag.startswith("model_args") else f"{flag} {value!r}"


def method_names(method: str | None, flag: str = "model_args method") -> list[str]:
    """`"hired+fastv"` -> ["hired", "fastv"] (registered names), [] for no method; unknown names fail here.
    `flag` names the option in errors (e.g. "--method")."""
    if method is None or method == "" or (isinstance(method, str) and method.lower() == "none"):
        return []
    if not isinstance(method, str):
        raise VTokenError(f"method={method!r}; expected a method name or names joined by '+' (e.g. hired+fastv)")
    names = []
    for part in method.split("+"):
        cls = method_class(part.strip())
        if cls is None:
            raise UnknownMethodError(
                f"{_named(flag, method)}: unknown method {part.strip()!r}; available: "
                f"{', '.join(available_methods())} (join several with '+')"
            )
        names.append(cls.name)
    if len(set(names)) != len(names):
        raise VTokenError(f"{_named(flag, method)} lists a method twice")
    return names


def build_methods(
    method: str | None, params: dict[str, Any], model_keys: list[str], source: str = "model_args"
) -> list[Method]:
    """The method objects of `method` with `params` routed to them (see the module docstring).

    model_keys: the caller's own keys, named in the error for an unknown key (lmms-eval's `--model_args` keys).
    source: how errors name where a parameter came from ("model_args", "--param").
    """
    names_flag = "model_args method" if source == "model_args" else "--method"
    names = method_names(method, names_flag)
    classes = {name: method_class(name) for name in names}
    per_method: dict[str, dict[str, Any]] = {name: {} for name in names}

    def accepted_text() -> str:
        own = f"the model's keys {', '.join(model_keys)}" if model_keys else ""
        if not names:
            need = "method=..." if source == "model_args" else "--method"
            return (own + " " if own else "") + f"(method parameters need {need})"
        prefixed = "; ".join(f"{name}: {', '.join(_accepted(cls))}" for name, cls in classes.items())
        return f"{own}, and the parameters of {prefixed}" if own else f"the parameters of {prefixed}"

    for key, value in params.items():
        prefix, dot, param = key.partition(".")
        if dot:
            cls = method_class(prefix)
            if cls is None or cls.name not in per_method:
                raise VTokenError(
                    f"{source} entry {key!r}: {prefix!r} is not one of the methods in {_named(names_flag, method)}; "
                    f"accepted: {accepted_text()}"
                )
            if param not in _accepted(cls):
                raise VTokenError(
                    f"{source} entry {key!r}: {cls.name} has no parameter {param!r}; "
                    f"it accepts {', '.join(_accepted(cls))}"
                )
            target = cls.name
        else:
            owners = [name for name, cls in classes.items() if key in _accepted(cls)]
            if not owners:
                raise VTokenError(f"unknown {source} entry {key!r}; accepted: {accepted_text()}")
            if len(owners) > 1:
                raise VTokenError(
                    f"{source} entry {key!r} is a parameter of {' and '.join(owners)}; "
                    f"name one: {', '.join(f'{o}.{key}=...' for o in owners)}"
                )
            target, param = owners[0], key
        if param in per_method[target]:
            raise VTokenError(f"{source} sets {target}.{param} twice")
        per_method[target][param] = _value(value)
    return [make_method(name, **per_method[name]) for name in names]
