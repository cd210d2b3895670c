"""Which methods apply to a loaded model, with parameters that fit it (e.g. drop layers within its LLM's depth).

`applicable_methods(model)` asks the model's adapter to validate every registered method, exactly as `patch` does
before installing anything, so its verdicts are `patch`'s own (and its reasons `patch`'s error messages).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .api import check
from .errors import VTokenError
from .modelview import model_view
from .registry import available_methods, make_method, method_class


def llm_depth(model: nn.Module) -> int:
    """Decoder layers of the model's LLM (what LLM-stage drop points index)."""
    return model_view(model).llm_layers


def attention_layers(model: nn.Module) -> set[int]:
    """LLM layers with softmax attention rows to score tokens by (a hybrid LLM's linear-attention layers have
    none: Qwen3.5)."""
    return set(model_view(model).attention_layers)


def fitting_params(model: nn.Module, name: str) -> dict[str, Any]:
    """Parameters method `name` needs beyond its defaults to fit `model`: what its `fit` says (LLM drop points
    within the LLM's depth: FastV's layer 2 and MustDrop's layers (2, 6, 10, 14) need an LLM of at least 4 and 16
    layers; PyramidDrop's (8, 16, 24) and SparseVLM's (2, 6, 15) are scaled to a shallower LLM, SparseVLM's
    official counts kept; DyCoke's layer 3 becomes the deepest that fits, reading a softmax-attention layer)."""
    cls = method_class(name)
    if cls is None:
        make_method(name)  # the unknown-method error, naming the available ones
    return cls.fit(model_view(model))


def applicable_layouts(model: nn.Module, method: str, **params: Any) -> list[str]:
    """The layouts (see `vtoken.patch`) in which `method` (with `params`, else fitting ones) applies to `model`."""
    instance = make_method(method, **(params or fitting_params(model, method)))
    layouts = []
    for layout in model_view(model).layouts:
        try:
            check(model, instance, layout=layout)  # validates only; installs nothing
        except VTokenError:
            continue
        layouts.append(layout)
    return layouts


def applicable_methods(model: nn.Module) -> dict[str, str | None]:
    """Every registered method -> None if it applies to `model` (in at least one layout, with `fitting_params`),
    else the reason it cannot (the message `vtoken.patch` would raise)."""
    view = model_view(model)
    verdicts: dict[str, str | None] = {}
    for name in available_methods():
        try:
            method = make_method(name, **method_class(name).fit(view))
        except VTokenError as err:
            verdicts[name] = str(err)
            continue
        reasons = []
        for layout in view.layouts:
            try:
                check(model, method, layout=layout)
            except VTokenError as err:
                reasons.append(str(err))
                continue
            break
        verdicts[name] = reasons[0] if len(reasons) == len(view.layouts) else None
    return verdicts
