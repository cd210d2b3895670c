"""`--model_args` of the lmms-eval model `vtoken`: which methods, with which parameters, validated up front.

The syntax is `vtoken.specs`' (shared with `vtoken run --method/--param`): `method=hired+fastv` composes stages,
`fastv.keep=0.25` sets one method's parameter, an unprefixed parameter goes to the one listed method that accepts
it. lmms-eval turns `1` into the int 1 (one token): write `budget=1.0` to keep every token.
"""

from __future__ import annotations

from typing import Any

from ..specs import build_methods as _build_methods
from ..specs import method_names

__all__ = ["build_methods", "method_names"]


def build_methods(method: str | None, params: dict[str, Any], model_keys: list[str]) -> list:
    """The method objects of `method=` with `params` routed to them; errors name `--model_args` and
    `model_keys` (the model's own keys)."""
    return _build_methods(method, params, model_keys, source="model_args")
