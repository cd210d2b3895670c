"""What a group of decoder layers runs on after visual tokens were dropped: a `LayerView` of the prompt, and the
index arithmetic that makes the next view from a keep mask in a fixed burst of kernels and no host sync.

Every count (tokens per row, visual tokens per row, the view's width) lives on the host: the layout is read once
per prefill (`Layout`), and a method's budget says how many tokens each row keeps at every drop. Tensors hold only
what the device needs (which slot holds which prompt column), and shapes come from the host counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vtoken.tokens import Merged


@dataclass
class Overrides:
    """Keyword arguments a group of layers gets instead of the LLM's own (None: keep the LLM's)."""

    attention_mask: Any
    position_ids: Any
    position_embeddings: Any
    cache: Any = None  # the cache the layers get instead (a decode-time selection's gathered view of it)


def take_columns(x: torch.Tensor, column: torch.Tensor, dim: int, padded: bool = True) -> torch.Tensor:
    """x with its sequence axis `dim` (batch axis just before it, maybe broadcast) gathered by column [B, C]
    (-1 reads column 0: mask it where it matters; `padded=False`: column holds no -1)."""
    x = x.expand(*x.shape[: dim - 1], column.shape[0], *x.shape[dim:])
    index = column.clamp(min=0) if padded else column
    index = index.view(*[1] * (dim - 1), *column.shape, *[1] * (x.dim() - dim - 1))
    return x.gather(dim, index.expand(*x.shape[: dim - 1], *column.shape, *x.shape[dim + 1 :]))


def packed(flags: torch.Tensor, width: int, counts: list[int], right: bool = True, exact: bool = False) -> torch.Tensor:
    """[B, width] indices of each row's set `flags` [B, C] in ascending order, padded with -1 on the right (or the
    left: `right=False`); `counts`: the set flags per row (host), width >= max(counts). A scatter, not a sort: each
    set flag goes to its 1-based rank, every other one to a spare slot 0 (dropped). `exact`: `counts` are exactly
    the flags set (not an upper bound), so when every row fills the width nothing needs a fill: 4 kernels."""
    batch, length = flags.shape
    target = flags.cumsum(1, dtype=torch.long)  # 1-based rank among the set flags
    padded = not exact or any(n != width for n in counts)
    if not right and padded:
        target = target + (width - flags.sum(1, keepdim=True))
    target = target * flags
    slots = flags.new_full((batch, width + 1), -1, dtype=torch.long) if padded else _spare(flags, batch, width)
    source = torch.arange(length, device=flags.device).expand(batch, -1)
    return slots.scatter_(1, target, source)[:, 1:]


def _spare(like: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[B, 1 + width] int64 for a scatter that fills every slot after the spare slot 0 (no fill needed)."""
    return torch.empty(batch, width + 1, dtype=torch.long, device=like.device)


@dataclass
class Layout:
    """A prompt's shape per row, on the host: real tokens, visual tokens, text tokens after the row's first visual
    token, whether the batch is padded on the right, placeholder runs per row, and real tokens after the row's last
    visual token. The call path knows them before the prefill starts (`CallPath` reads them in its one read before
    the encoder and follows the shrink on the host: `from_counts`); a prefill it did not see reads them once
    (`read`, one host sync)."""

    lengths: list[int]
    visual: list[int]
    text: list[int]
    right: bool
    runs: list[int]
    after: list[int]

    @classmethod
    def read(cls, mask: torch.Tensor, visual: torch.Tensor) -> Layout:
        """The layout of `mask` [B, L] with visual tokens `visual` [B, L] bool, read back (one host sync)."""
        return cls.from_counts(layout_counts(mask, visual).tolist())

    @classmethod
    def from_counts(cls, rows: list[list[int]]) -> Layout:
        """The layout of per-row counts as `layout_counts` gives them ([B] lists of six)."""
        lengths, seen, words, right, runs, late = (list(c) for c in zip(*rows, strict=True)) if rows else ([],) * 6
        return cls(lengths, seen, words, any(right), runs, late)

    def frame_tokens(self, trailer: int) -> list[int]:
        """Visual tokens of every row less the `trailer` separators closing each of its placeholder runs."""
        return [max(n - runs * trailer, 0) for n, runs in zip(self.visual, self.runs, strict=True)]


LAYOUT_WIDTH = 6  # the counts per row `layout_counts` gives (a read may carry more columns after them)


def layout_counts(mask: torch.Tensor | None, visual: torch.Tensor) -> torch.Tensor:
    """[B, 6] the counts a `Layout` holds of a prompt with padding mask `mask` [B, L] (None: no padding) and visual
    tokens `visual` [B, L] bool, on the device (padding slots are never visual): real tokens, visual tokens, text
    after the first visual one, 1 where the last column is padding, placeholder runs, real tokens after the last
    visual one. A fixed ~16 kernels: one running count of visual tokens answers "after the first" (count > 0) and
    "after the last" (count == the row's total), one sum counts four flags at once."""
    real = torch.ones_like(visual) if mask is None else mask != 0
    visual = visual & real
    seen = visual.long().cumsum(1)  # [B, L] visual tokens up to each slot
    from_first = real & (seen > 0)  # the first visual token and every real one after it
    from_last = real & (seen == seen[:, -1:])  # the last visual token and every real one after it (all: none)
    flags = torch.stack([real, visual, from_first, from_last], 2).sum(1)  # [B, 4]
    runs = (visual[:, 1:] & ~visual[:, :-1]).sum(1) + visual[:, 0]  # a run starts where a visual token follows none
    lengths, seen_visual, first, last = flags.unbind(1)
    has = (seen_visual > 0).long()
    return torch.stack([lengths, seen_visual, first - seen_visual, (~real[:, -1]).long(), runs, last - has], 1)


def text_after_image(real: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """[B, C] bool: real, non-visual slots after each row's first visual slot (`real` [B, C] the real slots,
    `visual` [B, C] the visual ones, all real)."""
    return (real ^ visual) & (visual.cumsum(1, dtype=torch.long) > 0)


def text_after_visual(real: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """[B, C] bool: real slots after each row's last visual slot (all of a row's real slots if it has none); `real`
    and `visual` as `text_after_image` takes them. A slot is after the last visual one where the running count of
    visual slots is already the row's total, and it is not visual itself."""
    seen = visual.cumsum(1, dtype=torch.long)
    return (real ^ visual) & (seen == seen[:, -1:])


@dataclass
class LayerView:
    """The sequence one group of decoder layers holds, relative to the L-column prompt the LLM received.

    column: [B, C] prompt column of each slot (-1 = padding slot); mask: [B, C] 1 for real tokens; positions: [B, C]
    each slot's position in a renumbered view (None when positions stay the prompt's); visual: [B, C] bool;
    protected: [B, C] bool, visual tokens no drop may remove, or None; merged: [B, C] bool, tokens a method added
    (holding the column of a token dropped where they were made), or None. Host counts per row: lengths (real
    tokens), visual_counts, lost (tokens dropped before this view; merged tokens count back). groups: [B, C] each
    visual slot's group from an encoder stage (`LayerTokens.groups`; -1: none), or None.
    """

    column: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor | None
    visual: torch.Tensor
    protected: torch.Tensor | None
    merged: torch.Tensor | None
    lengths: list[int]
    visual_counts: list[int]
    lost: list[int]
    groups: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.column.shape[1]

    @functools.cached_property
    def real(self) -> torch.Tensor:
        """[B, C] bool: the real slots (`mask` != 0); made once per view (a narrowed view is given it)."""
        return self.mask != 0

    @property
    def padded(self) -> bool:
        """Some row holds fewer real tokens than the view is wide (host-known)."""
        return any(n != self.width for n in self.lengths)

    def visual_slots(self) -> torch.Tensor:
        """[B, V] each row's visual slots, ascending, right-padded with -1 (V = most visual tokens of a row)."""
        made = self.__dict__.get("_visual_slots")
        if made is None:  # once per view (the prompt's view: a method's chosen rows and the first drop read it)
            made = packed(self.visual, max(self.visual_counts, default=0), self.visual_counts, exact=True)
            self.__dict__["_visual_slots"] = made
        return made

    def text_slots(self, counts: list[int], width: int) -> torch.Tensor:
        """[B, width] each row's real, non-visual slots after its first visual one, ascending, right-padded with -1
        (`counts`: per row, host; width >= max(counts)). Made once per view and width; a narrowed view gets its
        source's moved (text is never dropped: its slots only shift), two kernels instead of nine."""
        made = self.__dict__.setdefault("_text_slots", {})
        if width in made:
            return made[width][0]
        target, source = self.__dict__.get("_narrowed_from", (None, None))
        held = None if source is None else source.__dict__.get("_text_slots", {}).get(width)
        if held is not None:  # where the source's text slots went: `target` - 1 of the slot each was in
            slots, padded = held
            slots_now = target.gather(1, slots.clamp(min=0) if padded else slots) - 1
            made[width] = (slots_now.masked_fill(slots < 0, -1) if padded else slots_now), padded
        else:
            slots = packed(text_after_image(self.real, self.visual), width, counts)
            # -1 entries: rows short of the width, or (after a drop) rows whose first image may have gone
            made[width] = slots, any(n != width for n in counts) or any(self.lost)
        return made[width][0]


def narrowed(
    view: LayerView,
    keep: torch.Tensor,
    lengths: list[int],
    visual_counts: list[int],
    right: bool,
    renumber: bool,
    merged: Merged | None = None,
    merged_columns: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> tuple[LayerView, torch.Tensor]:
    """The view of the slots `keep` [B, C] marks (plus `merged` tokens, placed right after each row's last visual
    slot, holding prompt columns `merged_columns` [B, M]), and [B, C'] the source of each new slot (an index into
    the view's slots, C + j for merged token j; -1 padding). Host counts per row of the result: `lengths`,
    `visual_counts`. Left padding unless `right`; contiguous positions from each row's first one if `renumber`.
    `slots`: [B, V] the view's visual slots (`LayerView.visual_slots`) where the caller has them (placing merged
    tokens reads each row's last one from them)."""
    batch, length = keep.shape
    width = max(lengths, default=0)
    device = keep.device
    padded = any(n != width for n in lengths)
    rank = keep.cumsum(1, dtype=torch.long)  # 1-based among the kept slots
    flags = keep
    if merged is not None:
        count = merged.valid.shape[1]
        slot = torch.arange(length, device=device)
        every = slots is not None and all(n == slots.shape[1] > 0 for n in view.visual_counts)
        if every:  # every row has all V visual slots
            last_visual = slots[:, -1:]  # [B, 1] every row's last visual slot
        else:
            last_visual = slot.masked_fill(~view.visual, -1).amax(1, keepdim=True)  # [B, 1] (-1: none)
        after = slot > last_visual
        added = merged.known
        if added is not None and all(n == count for n in added):  # every row adds all `count`
            rank = rank + after * count
        else:
            rank = rank + after * merged.valid.sum(1, keepdim=True)
        # kept slots up to the last visual one: the running count there (0 for a row with none)
        if every:
            before = rank.gather(1, last_visual)
        else:
            before = rank.gather(1, last_visual.clamp(min=0)) * (last_visual >= 0)
        rank = torch.cat([rank, before + torch.arange(1, count + 1, device=device)], 1)
        flags = torch.cat([keep, merged.valid], 1)
    if not right and padded:
        rank = rank + (width - flags.sum(1, keepdim=True))
    target = rank * flags  # the others to the spare slot 0, dropped
    sources = keep.new_full((batch, width + 1), -1, dtype=torch.long) if padded else _spare(keep, batch, width)
    sources = sources.scatter_(1, target, torch.arange(flags.shape[1], device=device).expand(batch, -1))[:, 1:]
    index = sources.clamp(min=0) if padded else sources

    def take(x: torch.Tensor | None, extra: torch.Tensor | None, fill) -> torch.Tensor:
        if merged is not None:
            x = torch.cat([x, extra], 1)
        out = x.gather(1, index)
        return out.masked_fill(sources < 0, fill) if padded else out

    no_merge = None
    if merged is not None and (view.protected is not None or view.groups is not None):
        no_merge = torch.zeros_like(merged.valid)
    column = take(view.column, merged_columns, -1)
    real = column >= 0
    mask = real.to(view.mask.dtype)
    visual = take(view.visual, None if merged is None else merged.valid, False)
    protected = None if view.protected is None else take(view.protected, no_merge, False)
    groups = None if view.groups is None else take(view.groups, None if merged is None else no_merge.long() - 1, -1)
    was_merged = view.merged
    if merged is not None and was_merged is None:  # the slots taken from the merged tokens (sources C + j)
        was_merged = sources >= length
    elif merged is not None:
        was_merged = take(was_merged, merged.valid, False)
    elif was_merged is not None:
        was_merged = take(was_merged, None, False)
    positions = None
    if renumber:  # contiguous from 0 (each row's first real token's position in a renumbered view)
        if padded:
            positions = (mask.cumsum(1) - 1).clamp(min=0).masked_fill(~real, 0)
        else:
            positions = torch.arange(width, device=device).expand(batch, -1)
    lost = [was + held - now for was, held, now in zip(view.lost, view.lengths, lengths, strict=True)]
    new = LayerView(column, mask, positions, visual, protected, was_merged, lengths, visual_counts, lost, groups)
    new.real = real
    new.__dict__["_narrowed_from"] = target, view  # each source slot's new slot + 1 (0: dropped), for text_slots
    return new, sources
