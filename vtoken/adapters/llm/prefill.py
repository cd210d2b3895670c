"""The prefill drop engine: at a method's drop point, a fixed burst of kernels (score, keep, gather the hidden states,
positions, rotary tables and the mask of the rest of the prefill) and no host sync beyond what the method's
definition needs, every count on the host.

The prompt's layout is read once, when the prefill starts (`Layout.read`: one host sync, right after the stock
model's own placeholder check synced); from then on a method's budget says how many tokens each row keeps
(`PrefillMethod.kept_counts`), so shapes never wait for the device. A threshold method (MustDrop) reads its counts
back once per drop. Records are built when read (`records.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.methods.base import PrefillMethod
from vtoken.timing import Stopwatch

from .. import hf
from .reads import layer_tokens
from .records import kept_ranks, prefill_records
from .views import LayerView, Layout, narrowed, packed, take_columns, text_after_image


@dataclass
class Overrides:
    """Keyword arguments a group of layers gets instead of the LLM's own (None: keep the LLM's)."""

    attention_mask: Any
    position_ids: Any
    position_embeddings: Any
    cache: Any = None  # the cache the layers get instead (a decode-time selection's gathered view of it)


@dataclass
class PrefillState:
    """One prefill: the current view, the prompt's layout (host counts), its own rotary tables and positions, the
    cache the layers fill, what each layer ran on, and the records of the drops so far. chosen: [B, T] the text
    rows a method chose (query_rows="chosen"), over each row's text after its first visual token."""

    view: LayerView
    layout: Layout
    cache: Any
    rotary: Any = None
    position_ids: Any = None
    views: list[LayerView] = field(default_factory=list)
    overrides: Overrides | None = None
    records: list = field(default_factory=list)
    chosen: torch.Tensor | None = None


def check_cache(method: PrefillMethod, cache: Any, recurrent: set[int]) -> None:
    """A prefill stage needs per-layer keys and values (a DynamicCache of attention layers), when given a cache."""
    if cache is None:
        return
    layers = hf.cache_layers(cache)
    odd = [f"{i}: {type(layer).__name__}" for i, layer in enumerate(layers or [])
           if not hasattr(layer, "keys") and i not in recurrent]  # fmt: skip
    if layers is None or odd:
        raise InputError(
            f"{method.name} needs a cache of per-layer keys and values (a DynamicCache of attention layers); got "
            f"{type(cache).__name__} with "
            + (f"layers without keys/values ({', '.join(odd)})" if odd else "no per-layer caches")
        )


def start(stages, embeds: torch.Tensor, kwargs: dict, visual: torch.Tensor, cache: Any) -> PrefillState | None:
    """The state of a prefill of `embeds` [B, L, D] whose visual tokens are `visual` [B, L]; None when no row has
    any (nothing to drop)."""
    method = stages.method
    check_cache(method, cache, stages.recurrent)
    batch, length = visual.shape
    device = embeds.device
    mask = kwargs.get("attention_mask")
    mask = torch.ones(batch, length, dtype=torch.long, device=device) if mask is None else mask.long()
    if mask.dim() != 2:
        raise InputError(f"{method.name} needs the usual 2-D [batch, seq] attention_mask; got {mask.dim()}-D")
    visual = visual.to(device) & (mask != 0)
    text = text_after_image(mask, visual)
    layout = Layout.read(mask, visual, text)  # the prefill's one host read
    if not any(layout.visual):
        return None
    positions = (mask.cumsum(1) - 1).clamp(min=0) if stages.renumber else None  # each row's own numbering
    column = torch.arange(length, device=device).expand(batch, length)
    protected = stages.adapter.protected_mask_for((batch, length))
    view = LayerView(column, mask, positions, visual, None if protected is None else protected.to(device), None,
                     layout.lengths, layout.visual, [0] * batch)  # fmt: skip
    state = PrefillState(view, layout, cache)
    if method.query_rows == "chosen":
        state.chosen = chosen_rows(method, embeds, view, layout, text)
    return state


def chosen_rows(method: PrefillMethod, embeds: torch.Tensor, view: LayerView, layout: Layout, text: torch.Tensor):
    """query_rows="chosen": [B, T] bool over each row's text after its first visual token (right-padded), the rows
    the method picks from the LLM's input embeddings."""
    visual = view.visual_slots()
    words = packed(text, max(max(layout.text, default=0), 1), layout.text)
    with torch.no_grad():
        chosen = method.choose_rows(take_columns(embeds, visual, 1), visual >= 0, take_columns(embeds, words, 1),
                                    words >= 0)  # fmt: skip
    return chosen.bool() & (words >= 0)


def drop(stages, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """After drop layer `layer`: the hidden states [B, C', D] of what goes on, the next view and its overrides."""
    state, method = stages.call.prefill, stages.method
    view = state.view
    timer = Stopwatch(hidden.device).start()
    slots = view.visual_slots()  # [B, V] each row's visual slots, -1 padded
    counts = view.visual_counts
    merged = updated = None
    with torch.no_grad():  # a selection: nothing to differentiate
        tokens = layer_tokens(stages, state, layer, hidden, slots)
        if max(counts, default=0) == 0:  # no row has visual tokens left
            keep_visual, kept = tokens.valid, list(counts)
        else:
            keep_visual = method.keep_mask(tokens).bool() & tokens.valid
            kept = method.kept_counts(tokens)
            if tokens.protected is not None:
                keep_visual |= tokens.protected
                kept = None
            merged = method.merge(tokens, keep_visual)
            updated = method.update(tokens, keep_visual)
        if kept is None:  # a threshold decided: the drop's one host read
            kept = keep_visual.sum(1).tolist()
        added = merged.counts if merged is not None else None
    width = view.width
    marked = torch.where(keep_visual, slots, width)
    keep = torch.zeros(slots.shape[0], width + 1, dtype=torch.bool, device=slots.device).scatter_(1, marked, True)
    keep = keep[:, :width] | ((view.mask != 0) & ~view.visual)
    now = [k + (added[row] if added else 0) for row, k in enumerate(kept)]
    lengths = [n - v + k for n, v, k in zip(view.lengths, counts, now, strict=True)]
    if updated is not None:  # kept tokens that others were merged into take their new states
        hidden = replace_columns(hidden, slots, updated, keep_visual)
    merged_columns = None
    if merged is not None:
        anchors = slots.gather(1, merged.anchors.clamp(min=0)).clamp(min=0)
        merged_columns = view.column.gather(1, anchors).masked_fill(~merged.valid, -1)
        hidden = torch.cat([hidden, merged.features.to(hidden.dtype)], 1)
    new_view, sources = narrowed(view, keep, lengths, now, state.layout.right, stages.renumber, merged,
                                 merged_columns)  # fmt: skip
    hidden = take_columns(hidden, sources, 1)
    if new_view.padded:
        hidden = hidden.masked_fill((sources < 0)[:, :, None], 0.0)
    compute = kept_ranks(state.views[0].visual, view.column, view.merged, slots, keep_visual)
    timer.stop()
    state.records += prefill_records(method.name, layer, counts, kept, added, compute, timer)
    state.view = new_view
    state.overrides = overrides_for(stages, hidden, new_view, state, layer + 1)
    return hidden


def replace_columns(hidden: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """hidden [B, C, D] with rows [B, V, D] written at the visual slots [B, V] (-1: none) where `where` [B, V]; the
    rest unchanged (padding and unchosen entries write into a spare column, dropped)."""
    batch, width, dim = hidden.shape
    target = torch.where(where & (slots >= 0), slots, width)
    spare = torch.cat([hidden, hidden.new_zeros(batch, 1, dim)], 1)
    return spare.scatter(1, target[..., None].expand(-1, -1, dim), rows.to(hidden.dtype))[:, :width]


def overrides_for(stages, hidden: torch.Tensor, view: LayerView, state: PrefillState, layer: int) -> Overrides:
    """Mask, positions and rotary tables of the layers running on `view` from `layer` on, in the prefill."""
    if stages.renumber:
        positions = view.positions
        rotary = stages.lm.rotary_emb(hidden, position_ids=positions)
    else:  # the prompt's own positions and tables, sliced
        positions = state.position_ids
        if positions is None:
            first = state.views[0].mask
            positions = (first.cumsum(1) - 1).clamp(min=0)
        positions = take_columns(positions, view.column, positions.dim() - 1)
        rotary = tuple(take_columns(t, view.column, 1) for t in state.rotary)
    mask = stages.mask(hidden, view.mask if view.padded else None, positions, state.cache, layer)
    return Overrides(mask, positions, rotary)
