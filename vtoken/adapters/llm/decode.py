"""One decoding step on a cache a pruned prefill filled: a `DecodeStep` owns the step's per-layer masks and
positions, built without a host sync (lengths and positions come from the views' host counts and the step's own
inputs), and what a decode-time selection decided for the layers it restricts.

What does not change between steps is made once per cache and kept on its views: the tokens each view lost (one
table for the views of a cache), the mask over each view's prompt slots (a one-token step's mask is that, then the
LLM's own over the tokens since), and the rotary rows come from one table of the LLM's own (`rotary_table`): a
one-token step adds a subtraction and two gathers for the positions of every renumbered view, and one
concatenation per view that needs a mask.
"""

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
    first: int = 0  # the first layer of the group
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
        if positions is None and stages.selection is not None:  # a decode-time selection starts from them
            positions = torch.arange(past, full, device=embeds.device).expand(batch, -1)
        groups: dict[int, DecodeGroup] = {}
        made: dict[int, DecodeGroup] = {}
        for index, view in enumerate(views):
            if view is not None:
                if id(view) not in made:
                    made[id(view)] = DecodeGroup(view, stages.renumber, index)
                groups[index] = made[id(view)]
        return cls(stages, embeds, mask, positions, cache, prompt_length, groups)

    def overrides(self, index: int, own_mask: Any, own_positions: torch.Tensor | None = None) -> Overrides | None:
        """Layer `index`'s overrides in this step (None: the LLM's own); `own_mask`: the mask the LLM gives its
        layers (None: nothing padded anywhere, so a view without padding slots needs none either); `own_positions`:
        the positions it gives them (used where the step's input named none). Every group is built at the first
        layer that asks, renumbered positions' rotary tables for all at once."""
        selected = self.selected.get(index)
        if selected is not None:
            return selected
        group = self.groups.get(index)
        if group is None:
            return None
        if not group.built:  # a hybrid LLM's linear-attention layers get no mask in a one-token step: do not trust it
            if self.positions is None:
                self.positions = own_positions if own_positions is not None else self._counted_positions()
            self._build_groups(own_mask if not self.stages.recurrent else True)
        return group.overrides

    def _counted_positions(self) -> torch.Tensor:
        """[B, n] the new tokens' positions by the cache's length (what the LLM does without position_ids)."""
        batch, steps = self.embeds.shape[:2]
        full = self.mask.shape[1]
        return torch.arange(full - steps, full, device=self.embeds.device).expand(batch, -1)

    def _build_groups(self, own_mask: Any) -> None:
        stages = self.stages
        groups = list({id(g): g for g in self.groups.values()}.values())
        positions: list[Any] = [self.positions] * len(groups)
        rotary: list[Any] = [None] * len(groups)
        renumbered = [k for k, g in enumerate(groups) if g.renumbered]
        if renumbered:  # positions right after each view's own prompt: one subtraction, the rotary rows for all
            views = [groups[k].view for k in renumbered]
            for k, place, tables in zip(renumbered, *self._renumbered(views), strict=True):
                positions[k], rotary[k] = place, tables
        one_token = self.embeds.shape[1] == 1 and stages.full_attention
        for k, group in enumerate(groups):
            group.built = True
            view = group.view
            mask = self._held_mask(view, own_mask) if one_token else None
            if mask is not None:
                pass
            elif own_mask is None and not view.padded:
                mask = stages.mask(self.embeds, None, positions[k], self.cache, group.first)
            else:
                new_columns = self.mask[:, self.prompt_length :].to(view.mask.dtype)
                view_mask = torch.cat([view.mask, new_columns], dim=1)
                mask = stages.mask(self.embeds, view_mask, positions[k], self.cache, group.first)
                if one_token:
                    self._hold_mask(view, own_mask, mask)
            group.overrides = None if mask is None and rotary[k] is None else Overrides(mask, positions[k], rotary[k])

    def _renumbered(self, views: list[LayerView]) -> tuple[list[torch.Tensor], list[tuple]]:
        """Per view of `views` (renumbered), the new tokens' positions [..., B, n] right after the view's own prompt
        and their rotary tables: rows of the LLM's own table (`rotary_table`) for 1-D positions, else one call of
        its rotary for all views."""
        stages, own = self.stages, self.positions
        lost = stacked_lost(views, own.device)  # [B, G]
        width = own.shape[-1]
        shifted = own.unsqueeze(-2) - lost.view(*[1] * (own.dim() - 2), *lost.shape, 1)  # [..., B, G, n]
        table = stages.rotary_table(self.embeds, self.mask.shape[1]) if own.dim() == 2 else None
        if table is not None:  # a 1-D position counts the real tokens before it (0 <= p < the cache's length)
            cos, sin = table[0][shifted], table[1][shifted]  # [B, G, n, d]
            tables = [(cos[:, g], sin[:, g]) for g in range(len(views))]
        else:
            cos, sin = stages.lm.rotary_emb(self.embeds, position_ids=shifted.flatten(-2))  # [..., B, G * n, d]
            tables = [(cos[..., g * width : (g + 1) * width, :], sin[..., g * width : (g + 1) * width, :])
                      for g in range(len(views))]  # fmt: skip
        return [shifted[..., g, :] for g in range(len(views))], tables

    def _held_mask(self, view: LayerView, own_mask: Any) -> torch.Tensor | None:
        """A one-token step's mask of the layers holding `view`, from what an earlier one-token step of this cache
        left on the view: its mask over the view's prompt slots, then the LLM's own over the tokens since (the new
        token attends to every one it caches, so only padding masks). None: nothing held that fits."""
        held = view.__dict__.get("_step_mask")
        if held is None or held[0] != (own_mask is None):
            return None
        prompt = held[1]
        if own_mask is None:  # nothing padded among the tokens since: all of them attended (a shared fill)
            since = self.mask.shape[1] - self.prompt_length
            # attended, in the mask's format: a boolean mask's True, a 2-D padding mask's 1, an additive mask's 0
            allowed = True if prompt.dtype == torch.bool else 1 if prompt.dim() == 2 else 0
            return torch.cat([prompt, prompt.new_full((*prompt.shape[:-1], since), allowed)], -1)
        if not isinstance(own_mask, torch.Tensor) or own_mask.shape[:-1] != prompt.shape[:-1]:
            return None
        return torch.cat([prompt, own_mask[..., self.prompt_length :]], -1)

    def _hold_mask(self, view: LayerView, own_mask: Any, mask: Any) -> None:
        """Leave on `view` the part of a one-token step's `mask` over its prompt slots, for the steps after."""
        if isinstance(mask, torch.Tensor) and mask.shape[-1] == view.width + self.mask.shape[1] - self.prompt_length:
            view.__dict__["_step_mask"] = (own_mask is None, mask[..., : view.width])


def stacked_lost(views: list[LayerView], device: torch.device) -> torch.Tensor:
    """[B, G] the tokens each of `views` lost before it (`LayerView.lost`), on `device`: made once per set of views
    (every decoding step of a cache reads it), kept on the first view."""
    key = tuple(id(v) for v in views)
    made = views[0].__dict__.setdefault("_stacked_lost", {})
    if key not in made:
        batch = len(views[0].lost)
        made[key] = on_device([view.lost[row] for row in range(batch) for view in views], device).view(batch, -1)
    return made[key]
