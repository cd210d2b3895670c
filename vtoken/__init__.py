"""vtoken: training-free visual-token pruning and merging for Hugging Face vision-language models.

import vtoken
handle = vtoken.patch(model, "fastervlm", budget=0.25)
model.generate(**processor(images=image, text=prompt, return_tensors="pt"))
print(handle.summary())
vtoken.unpatch(model)

The names below are imported on first use (PEP 562), so that `import vtoken` and `vtoken --help` stay light (no
torch, no transformers); the method and adapter registries fill themselves when first asked.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (relative to vtoken) that defines it
_EXPORTS = {
    **dict.fromkeys(("PatchHandle", "handle_of", "patch", "patched", "unpatch"), "api"),
    "applicable_methods": "applicability",
    "tokens_to_keep": "budget",
    **dict.fromkeys(
        (
            "AlreadyPatchedError",
            "BudgetError",
            "InputError",
            "MissingSignalError",
            "UnknownMethodError",
            "UnsupportedModelError",
            "VTokenError",
        ),
        "errors",
    ),  # fmt: skip
    **dict.fromkeys(("encode", "select"), "functional"),
    "remember_tokenizer": "question",
    "Record": "records",
    **dict.fromkeys(
        ("available_methods", "make_method", "register_method", "unregister_method", "supported_models"), "registry"
    ),
    **dict.fromkeys(("ModelView", "model_view"), "modelview"),
    **dict.fromkeys(("LayerTokens", "Merged", "Selection", "TextQuery", "TextTokens", "VisualTokens"), "tokens"),
    "warmup": "warmup",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use: the table above, then every method class `vtoken.methods` exports, then
    a submodule (`vtoken.adapters`, `vtoken.zoo`, ...); `__all__` is the table's names and every method class."""
    if name == "__all__":
        value = [*_CORE, *importlib.import_module(".methods", __name__).__all__]
        globals()[name] = value
        return value
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        methods = importlib.import_module(".methods", __name__)
        if name in getattr(methods, "__all__", ()):
            value = getattr(methods, name)
        else:
            try:
                value = importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as err:
                if err.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .api import PatchHandle, handle_of, patch, patched, unpatch
    from .applicability import applicable_methods
    from .budget import tokens_to_keep
    from .errors import (
        AlreadyPatchedError,
        BudgetError,
        InputError,
        MissingSignalError,
        UnknownMethodError,
        UnsupportedModelError,
        VTokenError,
    )
    from .functional import encode, select
    from .methods import *  # noqa: F403 - every method class (found in vtoken/methods/, `vtoken.methods.__all__`)
    from .methods import EncoderMethod, Method, PrefillMethod, ScoreMethod, TowerMethod, TowerShape
    from .modelview import ModelView, model_view
    from .question import remember_tokenizer
    from .records import Record
    from .registry import available_methods, make_method, register_method, supported_models, unregister_method
    from .tokens import LayerTokens, Merged, Selection, TextQuery, TextTokens, VisualTokens
    from .warmup import warmup

# the public names besides the method classes, which `vtoken.methods` finds (see `__getattr__`)
_CORE = [
    "patch",
    "unpatch",
    "encode",
    "select",
    "patched",
    "handle_of",
    "warmup",
    "PatchHandle",
    "available_methods",
    "applicable_methods",
    "make_method",
    "register_method",
    "unregister_method",
    "supported_models",
    "model_view",
    "ModelView",
    "tokens_to_keep",
    "remember_tokenizer",
    "Selection",
    "VisualTokens",
    "LayerTokens",
    "TextTokens",
    "Merged",
    "TextQuery",
    "Record",
    "VTokenError",
    "BudgetError",
    "UnknownMethodError",
    "UnsupportedModelError",
    "MissingSignalError",
    "AlreadyPatchedError",
    "InputError",
]
