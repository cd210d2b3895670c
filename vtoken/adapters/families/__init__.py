"""One adapter per model family: what differs between VLMs (their towers, token layouts, prompts and signals),
built on the engine one level up (`adapters/base.py`, `calls.py`, `hf.py`, `probes.py`, `llm/`).

A family is one module here: `family_adapters` finds it, so adding one touches no list (the registry asks this
package, and no family module imports the registry).
"""

from __future__ import annotations

import importlib
import pkgutil


def family_adapters() -> list[type]:
    """Every family's adapter class: the modules of this package in alphabetical order, in each the `Adapter`
    subclasses it defines with a `family` name, in the order they are defined."""
    from ..base import Adapter

    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [
            cls
            for cls in vars(module).values()  # a module's namespace keeps the order its classes were defined in
            if isinstance(cls, type) and issubclass(cls, Adapter) and cls.__module__ == module.__name__ and cls.family
        ]
    return found
