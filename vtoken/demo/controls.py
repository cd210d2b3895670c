"""Each method's own controls on the page, from its declaration (`Method.params`, `controls`, `demo_params`):
which parameters, their starting values on a model, and how the values the page sends back become method
parameters (bad text gives an `InputError` naming the control)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from ..applicability import fitting_params
from ..budget import DEFAULT_BUDGET, parse_budget
from ..errors import BudgetError, InputError
from ..params import Choice, Param, Real, own
from ..registry import available_methods, method_class
from ..specs import common_budget

BUDGET_HINT = "a fraction kept (0.25) or a token count (144)"


@dataclass
class Control:
    """One parameter control: method, parameter name, how the UI value becomes the parameter."""

    method: str
    param: str
    kind: str  # "budget", "float", "int", "count", "choice", "optional_int", "optional_float", "layers",
    # "fractions", "counts" (lists, one per layer), "free"


def control_specs() -> list[Control]:
    """The controls of every registered method, from its declaration: the parameters its `controls` names (every
    declared one the page can show, when it names none), each shown as its declaration says; and a free
    `key=value` box for a method with parameters it does not declare, or none the page can show."""
    specs = []
    for name in available_methods():
        cls = method_class(name)
        declared = cls.declared_params()
        shown = [p for p in (cls.controls or declared) if p in declared and declared[p].control]
        specs += [Control(name, param, declared[param].control) for param in shown]
        if not shown or set(cls.defaults()) - set(declared):
            specs.append(Control(name, "params", "free"))
    return specs


def default_params(model, name: str) -> dict[str, Any]:
    """The demo's starting values for method `name` on `model`: the method's defaults, its `demo_params` (values
    that act on a short demo prompt: MustDrop's thresholds, sparse prefill's lengths), one budget for every
    encoder-stage method (`DEFAULT_BUDGET`, as the CLI: rows side by side keep the same share), and what its `fit`
    says for the model (drop layers that fit the LLM)."""
    cls = method_class(name)
    params = {k: v for k, v in cls.defaults().items() if not callable(v)}
    params.update(cls.demo_params)
    knob = common_budget(cls, None)
    if knob is not None:
        params[knob] = DEFAULT_BUDGET
    params.update(fitting_params(model, name))
    return params


def control_value(control: Control, value: Any) -> tuple[bool, Any]:
    """(set it?, parameter value) from a UI value; raises InputError naming the control on bad text. A budget is
    read as the library reads it ('0.25' a fraction kept, '144' a token count), never clamped; an empty one (or
    'None', a budget a method leaves unset by default) is not set."""
    if control.kind == "budget":
        if value is None or str(value).strip().lower() in ("", "none"):  # left empty: the method's own (ToMe: its r)
            return False, None
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
    declared = cls.declared_params().get(control.param, Param())
    spec, hint = own(declared), declared.hint or own(declared).hint
    if control.kind == "budget":  # text, so that 0.25 (a fraction) and 144 (a count) stay apart; no clamping
        return gr.Textbox(value=str(value), label=f"{label}: {BUDGET_HINT}")
    if control.kind == "float":
        if isinstance(spec, Real) and 0 <= spec.bounds[0] and spec.bounds[1] <= 1:  # a share: a slider over [0, 1]
            return gr.Slider(0.0, 1.0, value=value, step=0.01, label=label)
        return gr.Number(value=value, label=label)
    if control.kind == "int":
        return gr.Slider(0, max(int(value or 0), 1), value=value, step=1, label=label)
    if control.kind == "count":
        return gr.Number(value=value, precision=0, label=label)
    if control.kind == "choice":
        options = list(spec.choices(cls)) if isinstance(spec, Choice) else [value]
        return gr.Radio(options, value=value if value in options else options[0], label=label)
    if control.kind == "optional_int":
        return gr.Number(value=0, precision=0, label=f"{label} (0: unset; {hint})")
    if control.kind == "optional_float":
        return gr.Slider(0.0, 1.0, value=0.0, step=0.01, label=f"{label} (0: unset; {hint})")
    if control.kind in LISTS:
        hint = LISTS[control.kind][1].replace("LLM layer numbers", "LLM layers")
        return gr.Textbox(value=", ".join(map(str, value or ())), label=f"{label} ({hint})")
    return gr.Textbox(value="", label=f"{control.method} parameters (key=value, comma-separated)")


def control_update(gr, control: Control, defaults: dict[str, Any]):
    """Defaults that fit a newly loaded model: an LLM layer's slider (FastV's) spans its LLM, MustDrop's layers fit
    it."""
    if control.kind == "int":
        value = defaults.get(control.param) or 0
        return gr.update(maximum=max(value, 1), value=value)
    if control.kind in LISTS:
        return gr.update(value=", ".join(map(str, defaults.get(control.param) or ())))
    return gr.update()
