"""Registries of methods and model adapters, filled by decorators when their modules are imported."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .errors import UnknownMethodError, VTokenError

if TYPE_CHECKING:
    from vtoken.adapters.base import Adapter

    from .methods.base import Method

METHODS: dict[str, type[Method]] = {}
ADAPTERS: list[type[Adapter]] = []


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: make `cls` available as `vtoken.patch(model, cls.name, ...)`."""
    METHODS[cls.name] = cls
    return cls


def register_adapter(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: let `vtoken.patch` use `cls` for the models it matches."""
    ADAPTERS.append(cls)
    return cls


def available_methods() -> list[str]:
    """Names accepted by `vtoken.patch(model, name, ...)`."""
    return sorted(METHODS)


def supported_models() -> dict[str, list[str]]:
    """Adapter family -> the transformers model classes it patches."""
    return {a.family: list(a.model_classes) for a in ADAPTERS}


def method_class(name: str) -> type[Method] | None:
    """The registered method class of `name` (case, '-' and '_' ignored), or None."""
    if not isinstance(name, str):
        return None
    key = name.lower().replace("-", "").replace("_", "")
    return next((cls for known, cls in METHODS.items() if known.replace("_", "") == key), None)


def make_method(name: str, **params: Any) -> Method:
    """Instantiate a registered method by name."""
    cls = method_class(name)
    if cls is None:
        raise UnknownMethodError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    accepted = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise VTokenError(f"method {name!r} got unknown parameter(s) {unknown}; it accepts {accepted}")
    return cls(**params)
