"""`--model_args` of the lmms-eval model `vtoken`: which methods, with which parameters, validated up front.

`method=hired+fastv` composes stages. A method's parameter is written `name.param=value` (`fastv.keep=0.25`);
unprefixed it goes to the one listed method that accepts it (`budget=0.2,keep=0.5` with hired+fastv), and a
parameter two listed methods accept must be prefixed. lmms-eval turns `1` into the int 1 (one token): write
`budget=1.0` to keep every token. Lists are written in brackets: `mustdrop.layers=[2,6,10,14]`.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from typing import Any

from ..errors import UnknownMethodError, VTokenError
from ..methods.base import Method
from ..registry import available_methods, make_method, method_class


def _accepted(cls: type[Method]) -> list[str]:
    return [f.name for f in fields(cls) if f.init]


def _value(value: Any) -> Any:
    """lmms-eval already made numbers and booleans of numeric/true/false strings; this adds None and lists."""
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


def method_names(method: str | None) -> list[str]:
    """`"hired+fastv"` -> ["hired", "fastv"] (registered names), [] for no method; unknown names fail here."""
    if method is None or method == "" or (isinstance(method, str) and method.lower() == "none"):
        return []
    if not isinstance(method, str):
        raise VTokenError(f"method={method!r}; expected a method name or names joined by '+' (e.g. hired+fastv)")
    names = []
    for part in method.split("+"):
        cls = method_class(part.strip())
        if cls is None:
            raise UnknownMethodError(
                f"model_args method={method!r}: unknown method {part.strip()!r}; available: "
                f"{', '.join(available_methods())} (join several with '+')"
            )
        names.append(cls.name)
    if len(set(names)) != len(names):
        raise VTokenError(f"model_args method={method!r} lists a method twice")
    return names


def build_methods(method: str | None, params: dict[str, Any], model_keys: list[str]) -> list[Method]:
    """The method objects of `method` with `params` routed to them (see the module docstring).

    model_keys: the model's own `--model_args` keys, named in the error for an unknown key.
    """
    names = method_names(method)
    classes = {name: method_class(name) for name in names}
    per_method: dict[str, dict[str, Any]] = {name: {} for name in names}

    def accepted_text() -> str:
        own = f"the model's keys {', '.join(model_keys)}"
        if not names:
            return own + " (method parameters need method=...)"
        prefixed = "; ".join(f"{name}: {', '.join(_accepted(cls))}" for name, cls in classes.items())
        return f"{own}, and the parameters of {prefixed}"

    for key, value in params.items():
        prefix, dot, param = key.partition(".")
        if dot:
            cls = method_class(prefix)
            if cls is None or cls.name not in per_method:
                raise VTokenError(
                    f"model_args entry {key!r}: {prefix!r} is not one of the methods in method={method!r}; "
                    f"accepted: {accepted_text()}"
                )
            if param not in _accepted(cls):
                raise VTokenError(
                    f"model_args entry {key!r}: {cls.name} has no parameter {param!r}; "
                    f"it accepts {', '.join(_accepted(cls))}"
                )
            target = cls.name
        else:
            owners = [name for name, cls in classes.items() if key in _accepted(cls)]
            if not owners:
                raise VTokenError(f"unknown model_args entry {key!r}; accepted: {accepted_text()}")
            if len(owners) > 1:
                raise VTokenError(
                    f"model_args entry {key!r} is a parameter of {' and '.join(owners)}; "
                    f"name one: {', '.join(f'{o}.{key}=...' for o in owners)}"
                )
            target, param = owners[0], key
        if param in per_method[target]:
            raise VTokenError(f"model_args sets {target}.{param} twice")
        per_method[target][param] = _value(value)
    return [make_method(name, **per_method[name]) for name in names]
