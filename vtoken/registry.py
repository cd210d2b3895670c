"""Registries of methods and model adapters, filled by decorators when their modules are imported.

The lookups below import `vtoken.methods` or `vtoken.adapters` first (`load_methods`, `load_adapters`), so they
answer the same whether or not anything else imported those packages yet (`import vtoken` alone imports neither).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
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


def load_methods() -> None:
    """Import the method package, whose decorators fill `METHODS` (once; cheap after)."""
    import vtoken.methods  # noqa: F401


def load_adapters() -> None:
    """Import the adapter package, whose decorators fill `ADAPTERS` (once; cheap after; imports transformers)."""
    import vtoken.adapters  # noqa: F401


def available_methods() -> list[str]:
    """Names accepted by `vtoken.patch(model, name, ...)`."""
    load_methods()
    return sorted(METHODS)


def supported_models() -> dict[str, list[str]]:
    """Adapter family -> the transformers model classes it patches."""
    load_adapters()
    return {a.family: list(a.model_classes) for a in ADAPTERS}


def adapters() -> list[type[Adapter]]:
    """Every registered adapter class, in registration order."""
    load_adapters()
    return list(ADAPTERS)


def method_class(name: str) -> type[Method] | None:
    """The registered method class of `name` (case, '-' and '_' ignored), or None."""
    if not isinstance(name, str):
        return None
    load_methods()
    key = name.lower().replace("-", "").replace("_", "")
    return next((cls for known, cls in METHODS.items() if known.replace("_", "") == key), None)


def describe_method(method: Method) -> str:
    """What a method object applies, as rows and summaries show it: 'fastervlm(budget=25%)',
    'fastv(layer=2, keep=50%)': its budget/keep (with their unit: % of tokens or a token count) and layer always,
    every other parameter where it differs from the method's default."""
    from .budget import describe

    always = ("budget", "keep", "layer")
    names = [f.name for f in fields(method) if f.init]
    try:  # the method built from its shown knobs alone: fields derived from them (HiRED's `rate`) match it
        reference = type(method)(**{k: getattr(method, k) for k in always if k in names})
    except (VTokenError, TypeError, ValueError):
        reference = None
    shown = []
    for f in fields(method):
        if not f.init:
            continue
        value = getattr(method, f.name)
        if reference is not None:
            default = getattr(reference, f.name)
        else:
            default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        if f.name in always or not _same(value, default):
            text = describe(value) if f.name in ("budget", "keep") else _short(value)
            shown.append(f"{f.name}={text}")
    return f"{method.name}({', '.join(shown)})" if shown else method.name


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors and other values without a plain truth value
        return a is b


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ",".join(map(str, value)) + ")"
    if not isinstance(value, (str, int, type(None))) and hasattr(value, "__dict__"):
        return type(value).__name__  # an object (a loaded CLIPModel, a tokenizer): its class, not its whole repr
    return str(value)


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
