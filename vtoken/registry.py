"""Registries of methods and model adapters.

Methods come from three places, all found on the first lookup (`import vtoken` alone loads none of them):
- the built-ins: every method class `vtoken.methods` exports (a method file never imports this module, so the
  dependency is one-way: the registry imports the methods);
- installed packages, through the entry-point group `vtoken.methods` (`mymethod = "mypkg.prune:MyMethod"` in the
  package's pyproject); the class is imported when first used;
- `register_method(cls)` at run time (also a class decorator).
A name (compared without case, '-' and '_') belongs to one method: a clash is an error naming both.

Adapters are the family modules of `vtoken.adapters.families`, found on first use (`load_adapters`); no family
module imports this one.
"""

from __future__ import annotations

import re
import threading
from dataclasses import MISSING, fields, is_dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from .errors import UnknownMethodError, VTokenError

if TYPE_CHECKING:
    from vtoken.adapters.base import Adapter

    from .methods.base import Method

ENTRY_POINT_GROUP = "vtoken.methods"
_adapters: list[type[Adapter]] = []

# name -> class (built-ins, run-time registrations, entry points once imported); name -> entry point not imported
_methods: dict[str, type[Method]] = {}
_pending: dict[str, EntryPoint] = {}
_builtins: set[str] = set()
_loaded = False
_lock = threading.RLock()  # lookups from several threads (the demo's, a served model's) load once

NAME = re.compile(r"^[a-z][a-z0-9_]*$")
STAGES = ("tower", "encoder", "prefill", "decode", "sparse")
LAYOUTS = ("native", "official")
OFFICIAL_PACKING = ("unpad after selection", "unpad before selection", "newline after base-only image")


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _origin(name: str) -> str:
    """How an error names the method registered as `name`."""
    if name in _pending:
        point = _pending[name]
        dist = getattr(point, "dist", None)
        return f"{point.value} (entry point of {dist.name if dist else 'an installed package'})"
    cls = _methods[name]
    return f"vtoken's built-in {_where(cls)}" if name in _builtins else _where(cls)


def _taken(name: str) -> str | None:
    """The registered name that `name` collides with, if any."""
    key = _key(name)
    return next((known for known in (*_methods, *_pending) if _key(known) == key), None)


def load_methods(refresh: bool = False) -> None:
    """Find every method (once; cheap after): the built-ins, then the installed packages' entry points (listed,
    imported when used). `refresh=True` looks for entry points again (a package installed since, or a folder added
    to `sys.path`). Raises `VTokenError` naming both sides of a name clash."""
    global _loaded
    if _loaded and not refresh:
        return
    with _lock:
        if not _loaded:
            _load_builtins()
        _load_entry_points()
        _loaded = True


def _load_entry_points() -> None:
    """List the entry points not known yet (pending: imported when used); a name clash raises, naming both."""
    found: dict[str, EntryPoint] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in _pending or (point.name in _methods and _where(_methods[point.name]) == _target(point)):
            continue  # listed (or imported) before this refresh
        clash = _taken(point.name) or next((n for n in found if _key(n) == _key(point.name)), None)
        if clash is not None:
            other = _origin(clash) if clash in _methods else f"{found[clash].value} (another entry point)"
            raise VTokenError(
                f"method name {point.name!r} of {point.value} (entry point group {ENTRY_POINT_GROUP!r}) is taken by "
                f"{other}; rename one of them"
            )
        found[point.name] = point
    _pending.update(found)


def _load_builtins() -> None:
    """Every method class `vtoken.methods` exports, its declaration checked."""
    import vtoken.methods as builtin
    from vtoken.methods.base import Method

    for export in builtin.__all__:
        cls = getattr(builtin, export)
        if isinstance(cls, type) and issubclass(cls, Method) and cls.name:
            check_declaration(cls)
            _methods[cls.name] = cls
            _builtins.add(cls.name)


def _target(point: EntryPoint) -> str:
    """'module.Class' of an entry point's 'module:Class'."""
    module, _, attr = point.value.partition(":")
    return f"{module.strip()}.{attr.strip()}"


def _load_pending(name: str) -> type[Method]:
    """Import the class of entry point `name` and register it (once, whatever the threads)."""
    with _lock:
        return _methods[name] if name in _methods else _import_pending(name)


def _import_pending(name: str) -> type[Method]:
    from vtoken.methods.base import Method

    point = _pending[name]
    try:
        cls = point.load()  # its module may register the class itself (`@register_method`): then it is known
    except Exception as err:  # noqa: BLE001 - any import failure of a third-party package, reported with its source
        raise VTokenError(f"method {name!r} from {_origin(name)} failed to load: {type(err).__name__}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise VTokenError(f"method {name!r} from {_origin(name)} is {cls!r}, not a subclass of vtoken.Method")
    if cls.name != name:
        raise VTokenError(
            f"method {name!r} from {_origin(name)}: its class's name is {cls.name!r}; the entry point's name and "
            "the class's `name` must be the same"
        )
    check_declaration(cls)
    _pending.pop(name, None)
    _methods[name] = cls
    return cls


def register_method(cls: type[Method]) -> type[Method]:
    """Make `cls` available by its `name` to `vtoken.patch`, `applicable_methods`, the CLI, the demo, `vtoken
    eval` and the vLLM plugin. A class decorator (`@vtoken.register_method`) or a call
    (`vtoken.register_method(MyMethod)`); returns `cls`. Its declaration is checked now (`check_declaration`).
    A name taken by another method is refused, naming both; registering the same class again (or a class of the
    same module and name: a re-run notebook cell, a reloaded module) replaces it."""
    from vtoken.methods.base import Method

    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise VTokenError(
            f"register_method({cls!r}): expected a subclass of vtoken.Method (e.g. of vtoken.ScoreMethod)"
        )
    load_methods()
    check_declaration(cls)
    with _lock:
        _add(cls)
    return cls


def _add(cls: type[Method]) -> None:
    clash = _taken(cls.name)
    if clash is not None:
        same = _target(_pending[clash]) if clash in _pending else _where(_methods[clash])
        if same != _where(cls) or clash in _builtins:
            raise VTokenError(f"method name {cls.name!r} of {_where(cls)} is taken by {_origin(clash)}; choose "
                              "another name")  # fmt: skip
        _methods.pop(clash, None)
        _pending.pop(clash, None)
    _methods[cls.name] = cls


def unregister_method(name: str) -> None:
    """Forget a method registered at run time or by an entry point (built-ins stay)."""
    load_methods()
    with _lock:
        known = _taken(name) if isinstance(name, str) else None
        if known is None:
            raise UnknownMethodError(f"no method {name!r} is registered")
        if known in _builtins:
            raise VTokenError(f"{known!r} is one of vtoken's built-in methods, which cannot be unregistered")
        _methods.pop(known, None)
        _pending.pop(known, None)


def check_declaration(cls: type[Method]) -> None:
    """Raise `VTokenError` naming what is wrong with a method class's declaration (see `vtoken.methods.base.Method`):
    a dataclass with a valid name, known stages, modalities, layouts and packing notes, and parameter declarations,
    budget parameter, controls and demo values that name its own parameters."""
    from .params import Param

    where = f"method class {_where(cls)}"
    if not is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:  # not one inherited from its base
        raise VTokenError(f"{where} is not a dataclass: decorate it with @dataclass (its fields are its parameters)")
    if not isinstance(cls.name, str) or not NAME.match(cls.name):
        raise VTokenError(f"{where}: name={cls.name!r}; expected lowercase letters, digits and '_', e.g. 'mymethod'")
    init = {f.name for f in fields(cls) if f.init}
    checks = [
        ("stages", cls.stages, STAGES),
        ("layouts", cls.layouts, LAYOUTS),
        ("official_packing", cls.official_packing, OFFICIAL_PACKING),
    ]
    if isinstance(cls.modalities, tuple):
        checks.append(("modalities", cls.modalities, ("image", "video")))
    for attribute, value, accepted in checks:
        if not isinstance(value, tuple) or any(v not in accepted for v in value):
            raise VTokenError(f"{where}: {attribute}={value!r}; expected a tuple of {', '.join(map(repr, accepted))}")
    if not cls.stages:
        raise VTokenError(f"{where}: stages=(); it must act at one stage at least")
    if cls.acts_on not in ("crops", "placed"):
        raise VTokenError(f"{where}: acts_on={cls.acts_on!r}; expected 'crops' or 'placed'")
    params = cls.declared_params()
    for param, spec in params.items():
        if param not in init:
            raise VTokenError(f"{where}: params declares {param!r}, which is not one of its fields {sorted(init)}")
        if not isinstance(spec, Param):
            raise VTokenError(f"{where}: params[{param!r}]={spec!r}; expected a vtoken.params declaration")
    if cls.budget_param is not None and cls.budget_param not in params:
        raise VTokenError(f"{where}: budget_param={cls.budget_param!r} is not a declared parameter {sorted(params)}")
    for attribute, names in (("controls", cls.controls or ()), ("demo_params", cls.demo_params)):
        unknown = sorted(set(names) - init)
        if unknown:
            raise VTokenError(f"{where}: {attribute} names {unknown}, which are not among its parameters")


def load_adapters() -> list[type[Adapter]]:
    """Every family's adapter class (found once, `vtoken.adapters.families.family_adapters`; imports transformers)."""
    with _lock:
        if not _adapters:
            from vtoken.adapters.families import family_adapters

            _adapters.extend(family_adapters())
    return _adapters


def available_methods() -> list[str]:
    """Names accepted by `vtoken.patch(model, name, ...)`: built-ins, installed plugins and run-time registrations."""
    load_methods()
    return sorted({*_methods, *_pending})


def supported_models() -> dict[str, list[str]]:
    """Adapter family -> the transformers model classes it patches."""
    return {a.family: list(a.model_classes) for a in load_adapters()}


def adapters() -> list[type[Adapter]]:
    """Every registered adapter class, in registration order."""
    return list(load_adapters())


def method_class(name: str) -> type[Method] | None:
    """The registered method class of `name` (case, '-' and '_' ignored), or None. An installed plugin's class is
    imported here, the first time it is asked for (a failure raises `VTokenError` naming the package)."""
    if not isinstance(name, str):
        return None
    load_methods()
    known = _taken(name)
    if known is None:
        return None
    return _methods[known] if known in _methods else _load_pending(known)


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
