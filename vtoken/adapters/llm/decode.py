"""After a pruned prefill: the output-aware KV cut (MustDrop), what the prefill leaves on the cache, and each
decoding step's per-layer mask and positions, without a host sync (lengths and positions come from the views'
host counts and the step's own inputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.timing import Stopwatch

from .. import hf
from ..conversation import remember_views
from .prefill import Overrides, PrefillState
from .records import LazyRecord
from .views import LayerView


def cut_caches(stages, state: PrefillState, views: list[LayerView | None], prompt_length: int) -> list:
    """Cut the caches of `stages.cut_layers` to the visual tokens in the final view (output-aware KV cut); one
    record per row. Two gathers per cut layer, no host sync."""
    final = state.view
    cut_views: dict[int, tuple[LayerView, torch.Tensor]] = {}  # per view held: its cut view, final's slots there
    for index in stages.cut_layers:
        held = state.views[index]
        if id(held) not in cut_views:
            cut = LayerView(final.column, final.mask, final.positions, final.visual, final.protected, final.merged,
                            final.lengths, final.visual_counts, held.lost)  # fmt: skip
            cut_views[id(held)] = cut, slots_of_columns(held, final.column, prompt_length)
        views[index], slots = cut_views[id(held)]
        layer_cache = hf.cache_layers(state.cache)[index]
        for name in ("keys", "values"):
            tensor = getattr(layer_cache, name)
            index_ = slots.clamp(min=0)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
            setattr(layer_cache, name, tensor.gather(2, index_))
    rows = range(len(final.lengths))
    before = [sum(state.views[i].visual_counts[row] for i in stages.cut_layers) for row in rows]
    after = [final.visual_counts[row] * len(stages.cut_layers) for row in rows]
    lengths = [[(v or state.views[0]).lengths[row] for v in views] for row in rows]
    timer = Stopwatch(final.mask.device).start().stop()
    return [
        LazyRecord("decode.kv", stages.method.name, image=row, crop=0, tokens_in=before[row], tokens_out=after[row],
                   kept=None, grid=(1, 0), timer=timer, share=0.0, extra={"cache_lengths": lengths[row]})
        for row in rows
    ]  # fmt: skip


def slots_of_columns(view: LayerView, columns: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """[B, R] slots of `view` holding prompt columns `columns` [B, R] (-1: padding, or not held)."""
    batch = view.column.shape[0]
    lookup = torch.full((batch, prompt_length + 1), -1, dtype=torch.long, device=view.column.device)
    slots = torch.arange(view.width, device=view.column.device).expand(batch, -1)
    lookup.scatter_(1, view.column + 1, slots)
    return lookup.gather(1, columns + 1).masked_fill(columns < 0, -1)


def finish(stages, state: PrefillState, prompt_length: int) -> list:
    """After the prefill: the KV cut, the decode-time selection's state, the records' layer averages; the views each
    layer's cache holds are left on the cache for the decoding steps."""
    first = state.views[0]
    views: list[LayerView | None] = [None if v is first else v for v in state.views]
    counts = [v.visual_counts for v in state.views]  # per layer, per row (host)
    records = state.records
    if stages.cut_layers and state.cache is not None:
        records += cut_caches(stages, state, views, prompt_length)
    if stages.selection is not None and state.cache is not None:
        records += stages.selection.start(state)
    rows = range(len(first.lengths))
    average = [sum(layer[row] for layer in counts) / max(len(counts), 1) for row in rows]
    for record in records:
        if record.stage.startswith("prefill"):
            record.extra["layer_average"] = average[record.image]
    remember_views(state.cache, (views, prompt_length))
    return records


@dataclass
class DecodeGroup:
    """The layers whose caches hold one view, in one decoding step: built at the first of them (the LLM's own mask
    is known there), shared by the rest."""

    view: LayerView
    lost: torch.Tensor | None  # [B] the view's lost tokens (renumbered views)
    overrides: Overrides | None = None
    built: bool = False


@dataclass
class DecodeStep:
    """One decoding step on a cache a pruned prefill filled: per layer its group (absent: the LLM's own inputs),
    or what a decode-time selection decided for it (`selected`)."""

    embeds: torch.Tensor
    mask: torch.Tensor  # [B, past + steps]
    positions: torch.Tensor
    cache: Any
    prompt_length: int
    groups: dict[int, DecodeGroup]
    selected: dict[int, Overrides] = field(default_factory=dict)  # a decode-time selection's, per layer


def start_step(stages, embeds, kwargs, cache, past: int, views: list, prompt_length: int) -> DecodeStep:
    """A decoding step's per-layer groups (nothing computed yet)."""
    batch, steps = embeds.shape[:2]
    mask = kwargs.get("attention_mask")
    full = past + steps
    if past < prompt_length:
        raise InputError(
            f"the cache ({hf.CACHE_KWARG}) holds {past} tokens, fewer than the {prompt_length} of the prompt "
            f"{stages.method.name} pruned into it (was it cropped?); its layers hold different lengths, so it can "
            "only grow: continue from the whole cache, or start again without one"
        )
    if mask is None:
        mask = torch.ones(batch, full, dtype=torch.long, device=embeds.device)
    if mask.dim() != 2 or mask.shape[1] != full:
        raise InputError(
            f"a decoding step after {stages.method.name}'s pruned prefill needs a 2-D attention_mask covering "
            f"the prompt and every token since ({full} columns here, as generate() passes it); got "
            f"{tuple(mask.shape)}"
        )
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(past, full, device=embeds.device).expand(batch, -1)
    groups: dict[int, DecodeGroup] = {}
    made: dict[int, DecodeGroup] = {}
    for index, view in enumerate(views):
        if view is not None:
            if id(view) not in made:
                lost = view.lost_tensor() if stages.renumber else None  # made once per view
                made[id(view)] = DecodeGroup(view, lost)
            groups[index] = made[id(view)]
    return DecodeStep(embeds, mask, positions, cache, prompt_length, groups)


def step_overrides(stages, step: DecodeStep, index: int, own_mask: Any) -> Overrides | None:
    """Layer `index`'s overrides in this step (None: the LLM's own); `own_mask`: the mask the LLM gives its layers
    (None: nothing padded anywhere, so a view without padding slots needs none either). Every group is built at
    the first layer that asks, renumbered positions' rotary tables in one call."""
    group = step.groups.get(index)
    if group is None:
        return None
    if not group.built:  # a hybrid LLM's linear-attention layers get no mask in a one-token step: do not trust it
        build_groups(stages, step, own_mask if not stages.recurrent else True)
    return group.overrides


def build_groups(stages, step: DecodeStep, own_mask: Any) -> None:
    groups = list({id(g): g for g in step.groups.values()}.values())
    positions = [step.positions] * len(groups)
    rotary = [None] * len(groups)
    renumbered = [k for k, g in enumerate(groups) if g.lost is not None]
    if renumbered:  # positions right after each view's own prompt: one rotary call for every group
        for k in renumbered:
            positions[k] = step.positions - groups[k].lost.view(*[1] * (step.positions.dim() - 2), -1, 1)
        width = step.positions.shape[-1]
        cos, sin = stages.lm.rotary_emb(step.embeds, position_ids=torch.cat([positions[k] for k in renumbered], -1))
        for n, k in enumerate(renumbered):
            rotary[k] = (cos[..., n * width : (n + 1) * width, :], sin[..., n * width : (n + 1) * width, :])
    for k, group in enumerate(groups):
        group.built = True
        view = group.view
        if own_mask is None and not view.padded:
            mask = stages.mask(step.embeds, None, positions[k], step.cache, first_layer(step, group))
        else:
            new_columns = step.mask[:, step.prompt_length :].to(view.mask.dtype)
            view_mask = torch.cat([view.mask, new_columns], dim=1)
            mask = stages.mask(step.embeds, view_mask, positions[k], step.cache, first_layer(step, group))
        if mask is None and rotary[k] is None:
            group.overrides = None
        else:
            group.overrides = Overrides(mask, positions[k], rotary[k])


def first_layer(step: DecodeStep, group: DecodeGroup) -> int:
    return min(i for i, g in step.groups.items() if g is group)
