"""One decoding step on a cache a pruned prefill filled: a `DecodeStep` owns the step's per-layer masks and
positions, built without a host sync (lengths and positions come from the views' host counts and the step's own
inputs), and what a decode-time selection decided for the layers it restricts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vtoken.errors import InputError
from vtoken.geometry.tables import on_device

from .. import hf
from .views import LayerView, Overrides

if TYPE_CHECKING:
    from .stages import LanguageModelStages


@dataclass
class DecodeGroup:
    """The layers whose caches hold one view, in one decoding step: built at the first of them (the LLM's own mask
    is known there), shared by the rest."""

    view: LayerView
    renumbered: bool  # positions renumbered: the view's new tokens sit right after its own prompt
    overrides: Overrides | None = None
    built: bool = False


class DecodeStep:
    """One decoding step: per layer its group (absent: the LLM's own inputs), or what a decode-time selection
    decided for it (`selected`). embeds [B, n, D]; mask [B, past + n]; positions of the new tokens."""

    def __init__(self, stages: LanguageModelStages, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any, prompt_length: int, groups: dict[int, DecodeGroup]):  # fmt: skip
        self.stages = stages
        self.embeds = embeds
        self.mask = mask
        self.positions = positions
        self.cache = cache
        self.prompt_length = prompt_length
        self.groups = groups
        self.selected: dict[int, Overrides] = {}  # a decode-time selection's, per layer

    @classmethod
    def start(cls, stages: LanguageModelStages, embeds: torch.Tensor, kwargs: dict, cache: Any, past: int,
              views: list, prompt_length: int) -> DecodeStep:  # fmt: skip
        """A decoding step's per-layer groups (nothing computed yet)."""
        batch, steps = embeds.shape[:2]
        mask = kwargs.get("attention_mask")
        full = past + steps
        name = stages.method.name
        if past < prompt_length:
            raise InputError(
                f"the cache ({hf.CACHE_KWARG}) holds {past} tokens, fewer than the {prompt_length} of the prompt "
                f"{name} pruned into it (was it cropped?); its layers hold different lengths, so it can only grow: "
                "continue from the whole cache, or start again without one"
            )
        if mask is None:
            mask = torch.ones(batch, full, dtype=torch.long, device=embeds.device)
        if mask.dim() != 2 or mask.shape[1] != full:
            raise InputError(
                f"a decoding step after {name}'s pruned prefill needs a 2-D attention_mask covering the prompt and "
                f"every token since ({full} columns here, as generate() passes it); got {tuple(mask.shape)}"
            )
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(past, full, device=embeds.device).expand(batch, -1)
        groups: dict[int, DecodeGroup] = {}
        made: dict[int, DecodeGroup] = {}
        for index, view in enumerate(views):
            if view is not None:
                if id(view) not in made:
                    made[id(view)] = DecodeGroup(view, stages.renumber)
                groups[index] = made[id(view)]
        return cls(stages, embeds, mask, positions, cache, prompt_length, groups)

    def overrides(self, index: int, own_mask: Any) -> Overrides | None:
        """Layer `index`'s overrides in this step (None: the LLM's own); `own_mask`: the mask the LLM gives its
        layers (None: nothing padded anywhere, so a view without padding slots needs none either). Every group is
        built at the first layer that asks, renumbered positions' rotary tables in one call."""
        selected = self.selected.get(index)
        if selected is not None:
            return selected
        group = self.groups.get(index)
        if group is None:
            return None
        if not group.built:  # a hybrid LLM's linear-attention layers get no mask in a one-token step: do not trust it
            self._build_groups(own_mask if not self.stages.recurrent else True)
        return group.overrides

    def _build_groups(self, own_mask: Any) -> None:
        stages = self.stages
        groups = list({id(g): g for g in self.groups.values()}.values())
        positions = [self.positions] * len(groups)
        rotary = [None] * len(groups)
        renumbered = [k for k, g in enumerate(groups) if g.renumbered]
        if renumbered:  # positions right after each view's own prompt: one subtraction, one rotary call for all
            lost = stacked_lost([groups[k].view for k in renumbered], self.positions.device)  # [B, G]
            width = self.positions.shape[-1]
            shifted = self.positions.unsqueeze(-2) - lost.view(*[1] * (self.positions.dim() - 2), *lost.shape, 1)
            cos, sin = stages.lm.rotary_emb(self.embeds, position_ids=shifted.flatten(-2))  # [..., B, G * n]
            for n, k in enumerate(renumbered):
                positions[k] = shifted[..., n, :]
                rotary[k] = (cos[..., n * width : (n + 1) * width, :], sin[..., n * width : (n + 1) * width, :])
        for k, group in enumerate(groups):
            group.built = True
            view = group.view
            first = min(i for i, g in self.groups.items() if g is group)
            if own_mask is None and not view.padded:
                mask = stages.mask(self.embeds, None, positions[k], self.cache, first)
            else:
                new_columns = self.mask[:, self.prompt_length :].to(view.mask.dtype)
                view_mask = torch.cat([view.mask, new_columns], dim=1)
                mask = stages.mask(self.embeds, view_mask, positions[k], self.cache, first)
            group.overrides = None if mask is None and rotary[k] is None else Overrides(mask, positions[k], rotary[k])


def stacked_lost(views: list[LayerView], device: torch.device) -> torch.Tensor:
    """[B, G] the tokens each of `views` lost before it (`LayerView.lost`), on `device`: made once per set of views
    (every decoding step of a cache reads it), kept on the first view."""
    key = tuple(id(v) for v in views)
    made = views[0].__dict__.setdefault("_stacked_lost", {})
    if key not in made:
        batch = len(views[0].lost)
        made[key] = on_device([view.lost[row] for row in range(batch) for view in views], device).view(batch, -1)
    return made[key]
