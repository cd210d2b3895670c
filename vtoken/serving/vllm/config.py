"""The `vtoken` entry of vLLM's `hf_overrides`: parsed into vtoken's own method objects and checked at start.

    LLM(model, hf_overrides={"vtoken": {"method": "fastervlm", "budget": 0.25}})
    vllm serve MODEL --hf-overrides '{"vtoken": {"method": "hired", "rate": 0.2}}'

Keys: "method" (a registered name, or a list of names and {"method": name, **params} objects, composing as
`vtoken.patch` composes them), "layout" (as `vtoken.patch`), and every other key a parameter of the method(s),
exactly as `vtoken.patch(model, method, **params)` takes them. Only this module reads the entry; the front end
(its processor) and the engine core (its model) both call `serving_config`, so a bad entry fails at start in the
process the user sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vtoken.api import _resolve_methods
from vtoken.errors import VTokenError
from vtoken.methods.base import EncoderMethod, Method, TowerMethod
from vtoken.registry import make_method
from vtoken.stages.tower import KeepAll

OVERRIDE_KEY = "vtoken"
KEYS = ("method", "layout")  # besides the methods' own parameters

WHY_NOT_SERVED = {
    "prefill": "it drops tokens between LLM layers, inside vLLM's paged-attention forward, which a plugin cannot "
    "reach (vLLM schedules and caches every prompt token)",
    "decode": "it changes which KV-cache entries decoding attends to (evicting them, or masking them step by step), "
    "which vLLM's paged KV cache and attention backends do not let a plugin do",
    "sparse": "it replaces the LLM's attention kernel, which vLLM's attention backends do not let a plugin do",
}


class ServingConfigError(VTokenError):
    """A `vtoken` hf_overrides entry that vLLM cannot serve (raised before the engine starts)."""


def error(message: str) -> ServingConfigError:
    return ServingConfigError(f"vtoken (vLLM hf_overrides['{OVERRIDE_KEY}']): {message}")


@dataclass(frozen=True)
class ServingConfig:
    """The parsed entry: the encoder-stage method the plugin runs, the anyres layout, and a tower-stage method
    (PixelPrune; then `method` is `KeepAll`: every token the tower leaves reaches the LLM)."""

    method: EncoderMethod
    layout: str = "native"
    tower: TowerMethod | None = None

    @property
    def name(self) -> str:
        return self.method.name if self.tower is None else self.tower.name


def _method_item(item: Any) -> str | Method:
    """A JSON list item: a name, or {"method": name, **params} (the JSON form of a method object)."""
    if isinstance(item, dict):
        params = dict(item)
        name = params.pop("method", None)
        if not isinstance(name, str):
            raise error(f"a method object {item!r} needs a 'method' name, e.g. {{'method': 'pool', 'budget': 0.25}}")
        return make_method(name, **params)
    return item


def parse(raw: Any) -> ServingConfig | None:
    """The entry as vtoken's method objects (None: no entry, vLLM runs unchanged). Raises `ServingConfigError`
    naming the key or method at fault, why, and what is accepted."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise error(f"{raw!r} ({type(raw).__name__}); expected an object such as "
                    "{'method': 'fastervlm', 'budget': 0.25}")  # fmt: skip
    if "method" not in raw:
        raise error(f"no 'method' key in {raw!r}; expected e.g. {{'method': 'fastervlm', 'budget': 0.25}}")
    params = {k: v for k, v in raw.items() if k not in KEYS}
    layout = raw.get("layout", "native")
    method = raw["method"]
    try:
        items = [_method_item(m) for m in method] if isinstance(method, list) else method
        methods = _resolve_methods(items, params)
    except ServingConfigError:
        raise
    except VTokenError as failure:  # unknown method or parameter, bad budget: vtoken's own message
        raise error(f"{failure}; keys other than {list(KEYS)} are the method's parameters") from failure
    towers = [m for m in methods if "tower" in m.stages]
    if towers:
        return _tower_config(towers, [m for m in methods if m not in towers], layout)
    for m in methods:
        later = [s for s in m.stages if s != "encoder"]
        if later:
            raise error(
                f"method {m.name!r} acts at the {', '.join(later)} stage(s): {WHY_NOT_SERVED[later[0]]}. vLLM serves "
                "encoder-stage methods, whose token count is known before the encoder runs; use vtoken.patch on "
                "transformers for this one"
            )
    if len(methods) > 1:
        raise error(
            f"methods {[m.name for m in methods]} all act at the encoder stage; combine at most one method per stage"
        )
    if not isinstance(layout, str):
        raise error(f"layout={layout!r}; expected 'native' or 'official'")
    return ServingConfig(methods[0], layout)


def _tower_config(towers: list[Method], others: list[Method], layout: Any) -> ServingConfig:
    """A tower-stage method served alone (the families check that their vLLM tower takes it)."""
    if len(towers) > 1:
        raise error(f"methods {[m.name for m in towers]} all act at the tower stage; combine at most one per stage")
    if others:
        raise error(
            f"{towers[0].name} (tower stage) with {[m.name for m in others]}: the plugin serves a tower method alone "
            "(composing it with an encoder-stage method, whose crop is what the tower left, is not wired into the "
            "plugin yet); use vtoken.patch on transformers for the combination"
        )
    if not isinstance(layout, str):
        raise error(f"layout={layout!r}; expected 'native' or 'official'")
    return ServingConfig(KeepAll(), layout, towers[0])


def serving_config(hf_config: Any) -> ServingConfig | None:
    """The parsed entry of a model's HF config (vLLM stores a dict-valued override as a plain attribute)."""
    return parse(getattr(hf_config, OVERRIDE_KEY, None))
