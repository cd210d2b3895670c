"""Methods, one file each: every module of this package that defines a `Method` subclass with a `name` brings a
built-in method, exported here under its class name (found by `builtin_methods`, so adding a method touches no
list: the registry, `vtoken.<Class>`, the CLI, the demo and the docs' API page read them from here)."""

from __future__ import annotations

import importlib
import pkgutil

from .base import EncoderMethod as EncoderMethod
from .base import Method
from .base import PrefillMethod as PrefillMethod
from .base import ScoreMethod as ScoreMethod
from .base import TowerMethod as TowerMethod
from .base import TowerShape as TowerShape

BASES = ["Method", "EncoderMethod", "PrefillMethod", "ScoreMethod", "TowerMethod", "TowerShape"]


def builtin_methods() -> dict[str, type[Method]]:
    """Class name -> class of every built-in method: the modules of this package in alphabetical order, in each
    the `Method` subclasses it defines with a registered `name`, in the order they are defined."""
    found: dict[str, type[Method]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for cls in vars(module).values():  # a module's namespace keeps the order its classes were defined in
            if isinstance(cls, type) and issubclass(cls, Method) and cls.__module__ == module.__name__ and cls.name:
                found[cls.__name__] = cls
    return found


_BUILTINS = builtin_methods()
globals().update(_BUILTINS)
__all__ = [*BASES, *_BUILTINS]
del _BUILTINS
