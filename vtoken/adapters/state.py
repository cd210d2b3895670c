"""Per-call state of a patched model, one per thread, and the picklable wrapper around `model.generate`.

A patched model may be called from several threads at once (a server, a Gradio app). Everything a call leaves for
its own hooks to read (the visual-token mask, the protected key set, the LLM stages' views, probe captures) lives
in a `CallState` of the calling thread: hooks run in the thread that called the model, so they read their own
call's state, and no call sees another's. A `PerThread` holder survives `copy.deepcopy` and pickling: a copy
starts with no calls made.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any


class PerThread:
    """One `factory()` object per thread, made on first use; copies and unpickled objects start empty."""

    def __init__(self, factory: Any):
        self._factory = factory
        self._local = threading.local()

    def get(self) -> Any:
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = self._factory()
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {"_factory": self._factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._factory = state["_factory"]
        self._local = threading.local()


class CallState:
    """What one thread's current (or most recent) call on a patched model keeps.

    records: the records of the thread's most recent call (`called`: whether the thread made one).
    visual / protected: [B, L] visual tokens of the LLM's current input / tokens an encoder stage protected.
    groups: ([B, L] each placeholder's group from an encoder stage, numbered per row; per row its groups' sizes), or
    None (`EncodedImages.groups`).
    in_generate: the thread is inside the patched generate (its forwards already get the shrunk prompt).
    filled: the map of a pruned model(...) prompt, left on the cache the forward returns (`conversation.py`).
    questions: the prompt question of every image of the call (methods that read the question).
    labels: labels of a plain forward with an LLM stage, applied to the kept columns after the forward.
    beams: inside a beam-search generate (a decode-time selection follows the reordered rows).
    frames / ids: the call's videos' frames (for a stage that follows frames: sparse prefill's "grid") and the
    input_ids of the current forward.
    family: per-family extras (e.g. Qwen's resized grids). (The LLM stages keep their own per-call state:
    `llm.stages.LanguageModelCall`.)
    host: while `prepare` runs, the call's inputs read to the host once (image sizes, the prompt's ids), by name.
    tower: while `prepare` runs, the tower stage's plan of each modality (`vtoken.adapters.tower.TowerPlan`).
    layout: (the LLM prefill's `Layout` of the call's prompt as the LLM gets it, its [B, L] shape), host counts the
    call path knows before the prefill starts, or None.
    frame_columns: (per row, per video, the (start, end) columns of its frames or None where they do not match the
    videos, the [B, L] shape), read with `layout` for a stage that follows frames, or None.
    """

    def __init__(self) -> None:
        self.records: list = []
        self.called = False
        self.visual = None
        self.protected = None
        self.groups = None
        self.in_generate = False
        self.filled = None
        self.questions: list[str] = []
        self.labels = None
        self.beams = False
        self.frames: list[int] | None = None
        self.ids = None
        self.family: dict[str, Any] = {}
        self.host: dict[str, Any] = {}
        self.tower: dict[Any, Any] = {}
        self.layout: Any = None
        self.frame_columns: Any = None
        self.visual_of: Any = None  # (input_ids, [B, L] its placeholders): made once per ids tensor


class PatchedGenerate:
    """What `model.generate` is while patched: hands the call to the adapter. Once the adapter is removed, a
    reference taken while patched calls the generate the model had before (no pruning). A small class rather than
    a closure, so that a patched model deep-copies (the copy's wrapper is bound to the copy's adapter) and pickles.
    """

    __name__ = "generate"

    def __init__(self, adapter: Any):
        self.adapter = adapter
        self.__doc__ = getattr(adapter.stock_generate, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.adapter.installed:
            return self.adapter.stock_generate(*args, **kwargs)
        return self.adapter.calls.generate(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.adapter.stock_generate)

    def __repr__(self) -> str:
        return f"<vtoken-patched generate of {type(self.adapter.model).__name__}>"
