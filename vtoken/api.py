"""The one-call API: `patch`, `unpatch`, `patched`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from .adapters import hf
from .errors import AlreadyPatchedError, UnsupportedModelError, VTokenError
from .methods.base import Method
from .records import Record, summarize
from .registry import adapters, make_method, supported_models

_HANDLE_ATTR = "_vtoken_patch"


class PatchHandle:
    """What `patch` returns: the methods applied and the records of the model's most recent call."""

    def __init__(self, model: nn.Module, methods: list[Method], adapter):
        self.model = model
        self.methods = methods
        self.adapter = adapter

    @property
    def records(self) -> list[Record]:
        """One `Record` per crop (or frame) per stage, from the calling thread's most recent `model(...)` /
        `generate(...)` (in a thread that made no call: the most recent call of any thread)."""
        return self.adapter.records

    def summary(self) -> str:
        return summarize(self.records)

    def unpatch(self) -> None:
        unpatch(self.model)

    def __repr__(self) -> str:
        names = ", ".join(repr(m) for m in self.methods)
        return f"PatchHandle({type(self.model).__name__}, [{names}], adapter={self.adapter.family})"


def _resolve_methods(method: str | Method | Sequence[str | Method], params: dict[str, Any]) -> list[Method]:
    if isinstance(method, (str, Method)):
        method = [method]
    if not isinstance(method, Sequence) or not method:
        raise VTokenError(
            f"method={method!r}; expected a method name (str), a method object (e.g. vtoken.FasterVLM(budget=0.25)) "
            "or a non-empty list of them"
        )
    methods = []
    for item in method:
        if isinstance(item, str):
            methods.append(make_method(item, **params))
        elif isinstance(item, Method):
            if params:
                raise VTokenError(
                    f"parameters {sorted(params)} were given next to a method object; set them on the object instead"
                )
            methods.append(item)
        else:
            raise VTokenError(f"method {item!r} is neither a registered name nor a vtoken method object")
    return methods


def _find_adapter(model: nn.Module):
    for adapter in adapters():
        if adapter.matches(model):
            return adapter
    families = ", ".join(supported_models())
    raise UnsupportedModelError(
        f"{type(model).__name__} is not a supported vision-language model; supported families: {families} "
        "(`vtoken list` or vtoken.supported_models() names their model classes)"
    )


def _refuse_compiled_wrapper(model: nn.Module) -> None:
    """`torch.compile(model)` returns a wrapper (OptimizedModule) that calls the model: the model itself is patched."""
    original = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(original, nn.Module):
        raise UnsupportedModelError(
            f"this is torch.compile's wrapper around a {type(original).__name__}, not the model: patch the model "
            "itself, vtoken.patch(model._orig_mod, ...) (the compiled wrapper then runs the patched model), or patch "
            "first and compile after"
        )


def patch(
    model: nn.Module, method: str | Method | Sequence[str | Method], *, layout: str = "native", **params: Any
) -> PatchHandle:
    """Apply token reduction to `model` in place and return a handle whose `.records` say what was kept.

    `method`: a registered name (see `available_methods()`) with its parameters as keywords, e.g.
    `patch(model, "fastervlm", budget=0.25)`, or a method object, or a list of them (stages compose).
    `layout`: how kept tokens are packed for anyres models: "native" (the model's own packing, the default) or
    "official" (a seed method's own code layout, for paper reproduction; LLaVA-NeXT; on LLaVA-OneVision the tower
    methods' flat layout, every crop alike, which they require there).
    The model's own `generate(...)` / `model(...)` keep working; `unpatch(model)` restores it exactly.
    Warns once per process if the installed transformers lies outside the tested range (`vtoken.adapters.hf`).
    """
    hf.warn_if_untested()
    _refuse_compiled_wrapper(model)
    if getattr(model, _HANDLE_ATTR, None) is not None:
        raise AlreadyPatchedError(
            f"{type(model).__name__} is already patched with {getattr(model, _HANDLE_ATTR).methods}; "
            "call vtoken.unpatch(model) first"
        )
    methods = _resolve_methods(method, params)
    adapter = _find_adapter(model)(model, methods, layout)  # validates before anything is installed
    try:
        adapter.install()
    except BaseException:
        adapter.remove()
        raise
    handle = PatchHandle(model, methods, adapter)
    model.__dict__[_HANDLE_ATTR] = handle
    return handle


def check(model: nn.Module, method: str | Method | Sequence[str | Method], *, layout: str = "native",
          **params: Any) -> None:  # fmt: skip
    """Raise what `patch(model, method, layout=layout, **params)` would raise before installing anything (an
    unsupported model, an unknown method or parameter, a signal or stage the model lacks, a layout it has not);
    install nothing either way."""
    _refuse_compiled_wrapper(model)
    _find_adapter(model)(model, _resolve_methods(method, params), layout)


def unpatch(model: nn.Module) -> None:
    """Remove everything `patch` installed on `model`."""
    handle = model.__dict__.pop(_HANDLE_ATTR, None)
    if handle is None:
        raise VTokenError(f"{type(model).__name__} is not patched by vtoken; nothing to unpatch")
    handle.adapter.remove()


def handle_of(model: nn.Module) -> PatchHandle | None:
    """The active patch of `model`, or None."""
    return model.__dict__.get(_HANDLE_ATTR)


@contextmanager
def patched(model: nn.Module, method: str | Method | Sequence[str | Method], **params: Any) -> Iterator[PatchHandle]:
    """`with vtoken.patched(model, ...) as handle:` — patched inside the block, restored on exit."""
    handle = patch(model, method, **params)
    try:
        yield handle
    finally:
        unpatch(model)
