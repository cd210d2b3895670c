"""`HookOwner`: everything vtoken installs on one model instance, in one place, removed in one call.

An adapter and its stages never register a hook themselves: they ask the owner, which keeps the handle. The model
gets one generate wrapper whatever the stages (the adapter's `PatchedGenerate`); a stage that needs something at a
call's start reads it from the call path's per-call state instead of wrapping generate again. `remove()` takes
everything away in the reverse order it came, so a model patched, unpatched and patched again is the model it was.
Nothing here touches parameters, buffers or modules; only one model instance, never a class. What it keeps to undo
are bound methods (of hook handles, of the stages), never closures: a deep copy of a patched model gets an owner
whose undo acts on the copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn


class HookOwner:
    """The hooks, the generate wrapper and the other undoable installs (attention registrations) on one model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._undo: list[Callable[[], None]] = []  # newest last: removed in reverse
        self._own_generate = None  # an instance-level generate the model had before (restored on removal)
        self._wrapper = None
        self.installed = False

    def before_forward(self, module: nn.Module, hook: Callable, *, prepend: bool = False) -> None:
        """`hook(module, args, kwargs)` before every forward of `module` (a forward pre-hook with kwargs)."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=prepend)
        self._undo.append(handle.remove)

    def after_forward(self, module: nn.Module, hook: Callable) -> None:
        """`hook(module, args, output)` after every forward of `module`."""
        handle = module.register_forward_hook(hook)
        self._undo.append(handle.remove)

    def replace_forward(self, module: nn.Module, forward: Callable) -> None:
        """`module`'s forward, on this instance only, is `forward` (a picklable callable, not a closure); hooks
        around the module still run. Removed by deleting the instance attribute (the class's forward again)."""
        if "forward" in module.__dict__:
            raise RuntimeError(f"{type(module).__name__} already has an instance-level forward; refusing to replace it")
        module.forward = forward
        self._undo.append(functools.partial(_restore_forward, module, forward))

    def on_remove(self, undo: Callable[[], None]) -> None:
        """Something else installed (a registered attention function, a stored setting): `undo` restores it."""
        self._undo.append(undo)

    def wrap_generate(self, wrapper: Any) -> None:
        """The model's one generate wrapper (an object whose call hands generate to the adapter)."""
        if not hasattr(self.model, "generate"):
            return
        self._own_generate = self.model.__dict__.get("generate")
        self._wrapper = self.model.generate = wrapper
        self._undo.append(self._restore_generate)

    def _restore_generate(self) -> None:
        model = self.model
        if model.__dict__.get("generate") is self._wrapper:  # not one the user set since
            if self._own_generate is None:
                del model.__dict__["generate"]
            else:
                model.__dict__["generate"] = self._own_generate
        self._wrapper = None

    @property
    def stock_generate(self) -> Any:
        """The generate the model had before patch: the user's own instance-level one, else the class's."""
        if self._own_generate is not None:
            return self._own_generate
        return type(self.model).generate.__get__(self.model)

    def remove(self) -> None:
        """Everything installed, removed newest first (also after a partial install that failed)."""
        self.installed = False
        while self._undo:
            self._undo.pop()()


def _restore_forward(module: nn.Module, forward: Callable) -> None:
    if module.__dict__.get("forward") is forward:  # not one set since
        del module.__dict__["forward"]
