"""Each method's own controls on the page: which parameters, their starting values on a model, and how the values
the page sends back become method parameters (bad text gives an `InputError` naming the control)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import Any

from ..applicability import fitting_params
from ..budget import DEFAULT_BUDGET, parse_budget
from ..errors import BudgetError, InputError
from ..registry import available_methods, method_class

BUDGET_HINT = "a fraction kept (0.25) or a token count (144)"


@dataclass
class Control:
    """One parameter control: method, parameter name, how the UI value becomes the parameter."""

    method: str
    param: str
    kind: str  # "budget", "float", "int", "count", "choice", "optional_int", "optional_float", "layers",
    # "fractions", "counts" (lists, one per layer), "free"


def control_specs() -> list[Control]:
    """The controls of every registered method: budget and scope for encoder methods, each method's own knobs, and
    a free `key=value` box for methods without a dedicated form (e.g. ones added later)."""
    specs = []
    for name in available_methods():
        cls = method_class(name)
        names = {f.name for f in fields(cls)}
        known = {
            "fastv": [("layer", "int"), ("keep", "budget")],
            "dart": [("layer", "int"), ("keep", "budget")],
            "dycoke": [("k", "float"), ("layer", "int"), ("p", "float")],
            "pyramiddrop": [("layers", "layers"), ("ratios", "fractions")],
            "sparsevlm": [("layers", "layers"), ("keep", "counts")],
            "mustdrop": [
                ("layers", "layers"),
                ("global_thr", "float"),
                ("individual_thr", "float"),
                ("merge_threshold", "float"),
                ("key_rate", "float"),
            ],  # fmt: skip
            "hired": [("budget", "budget"), ("alpha", "float"), ("partition", "choice")],
            "mmtok": [("budget", "budget"), ("scope", "choice"), ("alpha", "float")],
            "fourier": [("budget", "budget"), ("reserve", "optional_int"), ("ratio", "optional_float")],
            "visionzip": [("budget", "budget")],  # D + C per crop, split 54:10 as the official settings
            "vispruner": [("budget", "budget"), ("important_ratio", "float")],
            "cdpruner": [("budget", "budget"), ("relevance", "choice")],
            "holov": [("budget", "budget"), ("chunks", "count"), ("alpha", "float"), ("score", "choice")],
            "sparse_prefill": [
                ("pattern", "choice"),
                ("density", "optional_float"),
                ("sink", "count"),
                ("block_size", "count"),
                ("min_length", "count"),
            ],  # fmt: skip
        }.get(name)
        if known is None and "budget" in names:
            known = [("budget", "budget")] + [("scope", "choice")] * ("scope" in names)
        if known is None:
            known = [("params", "free")]
        specs += [Control(name, param, kind) for param, kind in known]
    return specs


def default_params(model, name: str) -> dict[str, Any]:
    """The demo's starting values for method `name` on `model`: the method's defaults, one budget for every method
    that has one (`DEFAULT_BUDGET`, as the CLI: rows side by side keep the same share), drop layers that fit the
    LLM, and MustDrop thresholds that drop tokens (its own defaults drop none in the prefill)."""
    params = {f.name: f.default for f in fields(method_class(name)) if f.init and not callable(f.default)}
    if "budget" in params:
        params["budget"] = DEFAULT_BUDGET
    params.update(fitting_params(model, name))
    if name == "mustdrop":
        params.update(global_thr=0.01, individual_thr=0.01)
    if name == "sparsevlm" and params.get("keep") is None:  # its counts control shows the official 192 setting
        params.update(keep=method_class(name)().counts, budget=None)
    if name == "sparse_prefill":  # its defaults run dense below 32k tokens: a demo prompt is far shorter
        params.update(sink=4, block_size=16, min_length=64)
    return params


def control_value(control: Control, value: Any) -> tuple[bool, Any]:
    """(set it?, parameter value) from a UI value; raises InputError naming the control on bad text. A budget is
    read as the library reads it ('0.25' a fraction kept, '144' a token count), never clamped."""
    if control.kind == "budget":
        try:
            return True, parse_budget(str(value).strip())
        except BudgetError as err:
            raise InputError(f"{control.method} {control.param}: {err}") from None
    if control.kind in ("int", "count"):
        return True, int(value)
    if control.kind == "float":
        return True, float(value)
    if control.kind == "choice":
        return True, value
    if control.kind == "optional_int":
        return (value is not None and int(value) > 0), (int(value) if value else None)
    if control.kind == "optional_float":
        return (value is not None and float(value) > 0), (float(value) if value else None)
    if control.kind in LISTS:
        kind, example = LISTS[control.kind]
        try:
            items = tuple(kind(x) for x in str(value).replace(",", " ").split())
        except ValueError:
            raise InputError(f"{control.method} {control.param} {value!r}: expected {example}") from None
        if not items:
            raise InputError(f"{control.method} {control.param}: give at least one, e.g. {example.split(', e.g. ')[1]}")
        return True, items
    return False, value  # "free": parsed by parse_free


# list controls: item type and what is expected
LISTS = {
    "layers": (int, "LLM layer numbers, e.g. 2, 6"),
    "fractions": (float, "fractions, one per layer, e.g. 0.5, 0.25"),
    "counts": (int, "token counts, one per layer, e.g. 300, 200"),
}


def parse_free(method: str, text: str) -> dict[str, Any]:
    """`key=value, key=value` (Python literals) -> parameters."""
    params = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise InputError(f"{method} parameters: {part!r} is not key=value (e.g. budget=0.25)")
        try:
            params[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            params[key.strip()] = value.strip()
    return params


def method_params(specs: list[Control], values: list[Any]) -> dict[str, dict[str, Any]]:
    params: dict[str, dict[str, Any]] = {}
    for control, value in zip(specs, values, strict=True):
        mine = params.setdefault(control.method, {})
        if control.kind == "free":
            mine.update(parse_free(control.method, value))
            continue
        use, parameter = control_value(control, value)
        if use:
            mine[control.param] = parameter
    return params


def make_control(gr, control: Control, defaults: dict[str, Any]):
    """The Gradio component of one control, labelled "<method> <parameter>"."""
    label = f"{control.method} {control.param}"
    value = defaults.get(control.param)
    cls = method_class(control.method)
    if control.kind == "budget":  # text, so that 0.25 (a fraction) and 144 (a count) stay apart; no clamping
        return gr.Textbox(value=str(value), label=f"{label}: {BUDGET_HINT}")
    if control.kind == "float":
        top = 1.0 if control.param in ("alpha", "key_rate", "merge_threshold", "important_ratio") else None
        if top is None:
            return gr.Number(value=value, label=label)
        return gr.Slider(0.0, top, value=value, step=0.01, label=label)
    if control.kind == "int":
        return gr.Slider(0, max(int(value or 0), 1), value=value, step=1, label=label)
    if control.kind == "count":
        return gr.Number(value=value, precision=0, label=label)
    if control.kind == "choice":
        options = {
            "scope": list(getattr(cls, "scopes", ("crop",))),
            "partition": ["bands", "tiles"],
            "pattern": ["vertical_slash", "a_shape", "grid"],
            "relevance": ["clip", "llm"],
            "score": ["cls", "received"],
        }[control.param]
        return gr.Radio(options, value=value if value in options else options[0], label=label)
    if control.kind == "optional_int":
        return gr.Number(value=0, precision=0, label=f"{label} (0: unset; side of the kept grid)")
    if control.kind == "optional_float":
        return gr.Slider(0.0, 1.0, value=0.0, step=0.01, label=f"{label} (0: unset; per-axis fraction)")
    if control.kind in LISTS:
        hint = LISTS[control.kind][1].replace("LLM layer numbers", "LLM layers")
        return gr.Textbox(value=", ".join(map(str, value or ())), label=f"{label} ({hint})")
    return gr.Textbox(value="", label=f"{control.method} parameters (key=value, comma-separated)")


def control_update(gr, control: Control, defaults: dict[str, Any]):
    """Defaults that fit a newly loaded model: FastV's layer slider spans its LLM, MustDrop's layers fit it."""
    if control.kind == "int" and control.param == "layer":
        value = defaults.get("layer", 0)
        return gr.update(maximum=max(value, 1), value=value)
    if control.kind in LISTS:
        return gr.update(value=", ".join(map(str, defaults.get(control.param) or ())))
    return gr.update()
