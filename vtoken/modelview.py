"""`vtoken.model_view(model)`: a loaded model as vtoken sees it, read-only.

Its family, the inputs it takes, the score signals its adapter provides to methods, the stages and anyres layouts
it supports, its LLM's layers (how many, which have softmax attention), and how many visual tokens a prompt gives.
The tools (the CLI, the demo, `vtoken.counts`, `applicable_methods`) and a method's `fit` read a model through it;
nothing is patched or changed.

    view = vtoken.model_view(model)
    view.family, view.signals, view.llm_layers, view.visual_tokens(inputs["input_ids"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelView:
    """What vtoken sees in a loaded model.

    family: the adapter family ("llava-1.5", "qwen2.5-vl", ...). model_class: the transformers class name.
    modalities: the inputs its processor's pixels come as ("image", "video"). placeholder_ids: modality -> the
    placeholder token id of its visual tokens in the prompt. signals: the score signals methods can require on it
    (`Method.requires`). stages, layouts: what `vtoken.patch` supports on it. llm_layers: its LLM's decoder layers;
    attention_layers: those with softmax attention (a hybrid LLM's linear-attention layers have none).
    language_model: the decoder stack itself, for reading (e.g. a forward pre-hook measuring its input); do not
    change it. vision_width: the hidden size of the vision tower whose features encoder methods read, where the
    family has one such tower (the LLaVA families' CLIP; None elsewhere), e.g. for a method that pairs it with
    another checkpoint of that width (CDPruner's CLIP). multi_axis_positions: the LLM numbers tokens on several
    axes (Qwen's M-RoPE (t, h, w)), where a renumbering of kept tokens is not defined.
    """

    family: str
    model_class: str
    modalities: tuple[str, ...]
    placeholder_ids: MappingProxyType
    signals: frozenset[str]
    stages: tuple[str, ...]
    layouts: tuple[str, ...]
    llm_layers: int
    attention_layers: tuple[int, ...]
    language_model: nn.Module = field(repr=False, compare=False)
    vision_width: int | None = None
    multi_axis_positions: bool = False

    def visual_tokens(self, input_ids: torch.Tensor) -> list[int]:
        """[B] visual tokens of each row of a prompt `input_ids` [B, L]: its image and video placeholders, which is
        what the unpatched model's LLM receives (LLaVA-NeXT's newline separators included)."""
        ids = torch.tensor(sorted(set(self.placeholder_ids.values())), device=input_ids.device)
        return torch.isin(input_ids, ids).sum(dim=1).tolist()


def model_view(model: nn.Module) -> ModelView:
    """The `ModelView` of `model` (an `UnsupportedModelError` names the supported families)."""
    from .api import _find_adapter
    from .stages.encoder import COMMON_SIGNALS

    cls = _find_adapter(model)
    adapter = cls(model, [], "native")  # no method: validates nothing, installs nothing
    language_model = adapter.language_model
    depth = len(getattr(language_model, "layers", ()))
    types = getattr(getattr(language_model, "config", None), "layer_types", None) or ["full_attention"] * depth
    ids: dict[str, Any] = {m.name: getattr(model.config, m.placeholder_attr, None) for m in cls.modalities}
    return ModelView(
        family=cls.family,
        model_class=type(model).__name__,
        modalities=tuple(m.name for m in cls.modalities),
        placeholder_ids=MappingProxyType({k: v for k, v in ids.items() if isinstance(v, int)}),
        signals=frozenset(adapter.available_signals() | set(COMMON_SIGNALS)),
        stages=tuple(cls.stages),
        layouts=tuple(cls.layouts),
        llm_layers=depth,
        attention_layers=tuple(i for i, kind in enumerate(types) if kind != "linear_attention"),
        language_model=language_model,
        vision_width=getattr(getattr(getattr(adapter, "tower", None), "config", None), "hidden_size", None),
        multi_axis_positions=bool(cls.multi_axis_positions),
    )
