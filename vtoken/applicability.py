"""Which methods apply to a loaded model, with parameters that fit it (e.g. drop layers within its LLM's depth).

`applicable_methods(model)` asks the model's adapter to validate every registered method, exactly as `patch` does
before installing anything, so its verdicts are `patch`'s own (and its reasons `patch`'s error messages).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .api import _find_adapter
from .errors import VTokenError
from .methods.random import Random
from .registry import available_methods, make_method

# MustDrop's official drop layers (a 32-layer LLaMA); shallower LLMs keep those that fit
MUSTDROP_LAYERS = (2, 6, 10, 14)
# PyramidDrop's and SparseVLM's official layers on a 32-layer LLaMA; a shallower LLM gets them scaled to its depth
OFFICIAL_DEPTH = 32
# the documented opt-in variants of methods whose official signal a model may lack: CDPruner's CLIP relevance (a
# CLIP text tower for the model's tower), HoloV's [CLS] attention
VARIANTS = {"cdpruner": {"relevance": "llm"}, "holov": {"score": "received"}}


def _language_model(model: nn.Module) -> nn.Module:
    """The decoder stack LLM stages hook, as the model's adapter finds it."""
    return _find_adapter(model)(model, [Random()], "native").language_model


def llm_depth(model: nn.Module) -> int:
    """Decoder layers of the model's LLM (what LLM-stage drop points index)."""
    return len(_language_model(model).layers)


def fitting_params(model: nn.Module, name: str) -> dict[str, Any]:
    """Parameters a method needs beyond its defaults to fit `model`: LLM drop points within the LLM's depth
    (FastV's layer 2 and MustDrop's layers (2, 6, 10, 14) need an LLM of at least 4 and 16 layers; PyramidDrop's
    (8, 16, 24) and SparseVLM's (2, 6, 15) are scaled to a shallower LLM, SparseVLM's official counts kept; DyCoke's
    layer 3 becomes the deepest that fits, reading a softmax-attention layer; CDPruner and HoloV their labelled
    variant, `VARIANTS`, where the official signal is missing and the variant applies)."""
    if name in VARIANTS:
        if _applies(model, name, {}) or not _applies(model, name, VARIANTS[name]):
            return {}
        return dict(VARIANTS[name])
    if name not in ("fastv", "mustdrop", "dart", "pyramiddrop", "sparsevlm", "dycoke"):
        return {}
    depth = llm_depth(model)
    last = depth - 2  # a drop after the last layer saves nothing
    if last < 0:
        return {}  # a one-layer LLM: the method says why it cannot apply
    attention = attention_layers(model)
    scored = [k for k in range(last + 1) if k in attention] or [last]
    if name == "fastv":
        return {"layer": max([k for k in scored if k <= 2] or scored[:1])}
    if name == "mustdrop":
        return {"layers": tuple(k for k in MUSTDROP_LAYERS if k in scored) or (scored[-1],)}
    if name == "dart":  # K reads layer K - 1
        return {"layer": max([k for k in scored if k <= 1] or scored[:1]) + 1}
    if name == "dycoke":  # layers from `layer` on are restricted, reading layer - 1: the official 3, or the nearest
        return {"layer": max([k for k in scored if k <= 2] or scored[:1]) + 1}
    scale = min(1.0, depth / OFFICIAL_DEPTH)  # official layers on a 32+-layer LLM, else scaled to its depth

    def nearest(fits: list[int], official: tuple[int, ...]) -> list[int]:
        return sorted({min(fits, key=lambda k: abs(k - layer * scale)) for layer in official})

    if name == "pyramiddrop":  # each stage scored by the layer it drops before
        first = min(attention, default=0)  # a hybrid LLM reads its cache length there: no drop before it
        fits = [k for k in range(1, depth) if k in attention and k - 1 >= first]
        layers = nearest(fits, (8, 16, 24)) if fits else [1]
        return {"layers": tuple(layers), "ratios": (0.5, 0.25, 0.125)[: len(layers)]}
    layers = nearest(scored, (2, 6, 15))
    return {"layers": tuple(layers), "keep": (300, 200, 110)[-len(layers) :]}  # fewer layers: the last counts


def _applies(model: nn.Module, name: str, params: dict[str, Any]) -> bool:
    """Whether `patch` would accept method `name` with `params` on `model` in some layout."""
    adapter = _find_adapter(model)
    try:
        method = make_method(name, **params)
    except VTokenError:
        return False
    for layout in adapter.layouts:
        try:
            adapter(model, [method], layout)  # validates only; installs nothing
        except VTokenError:
            continue
        return True
    return False


def attention_layers(model: nn.Module) -> set[int]:
    """LLM layers with softmax attention rows to score tokens by (a hybrid LLM's linear-attention layers have
    none: Qwen3.5)."""
    lm = _language_model(model)
    types = getattr(lm.config, "layer_types", None) or ["full_attention"] * len(lm.layers)
    return {i for i, kind in enumerate(types) if kind != "linear_attention"}


def applicable_layouts(model: nn.Module, method: str, **params: Any) -> list[str]:
    """The layouts (see `vtoken.patch`) in which `method` (with `params`, else fitting ones) applies to `model`."""
    adapter = _find_adapter(model)
    instance = make_method(method, **(params or fitting_params(model, method)))
    layouts = []
    for layout in adapter.layouts:
        try:
            adapter(model, [instance], layout)  # validates only; installs nothing
        except VTokenError:
            continue
        layouts.append(layout)
    return layouts


def applicable_methods(model: nn.Module) -> dict[str, str | None]:
    """Every registered method -> None if it applies to `model` (in at least one layout, with `fitting_params`),
    else the reason it cannot (the message `vtoken.patch` would raise)."""
    adapter = _find_adapter(model)
    verdicts: dict[str, str | None] = {}
    for name in available_methods():
        try:
            method = make_method(name, **fitting_params(model, name))
        except VTokenError as err:
            verdicts[name] = str(err)
            continue
        reasons = []
        for layout in adapter.layouts:
            try:
                adapter(model, [method], layout)
            except VTokenError as err:
                reasons.append(str(err))
                continue
            break
        verdicts[name] = reasons[0] if len(reasons) == len(adapter.layouts) else None
    return verdicts
