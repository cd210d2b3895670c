"""A decode-time selection (DyCoke): at every one-token decoding step, the new token's attention row at layer L - 1
(head mean, one fused op) decides which visual tokens layers L and later attend to in this step; those layers then
read only the kept entries of their caches, gathered for the step (the cache itself is never shrunk). Whether a
step re-selects is the method's data-dependent rule (DyCoke: the row moved), read back once per step: the one host
sync of this stage, which sizes the gather. Its state (the previous step's row) travels with the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vtoken.errors import InputError
from vtoken.geometry.tables import on_device
from vtoken.timing import Stopwatch

from .. import hf
from ..conversation import remember_selection, selection_of
from .records import Deferred, Elapsed, LazyRecord
from .views import Overrides, packed

if TYPE_CHECKING:
    from .prefill import PrefillRun
    from .stages import LanguageModelStages


@dataclass
class DecodeSelection:
    """A decode-time selection's state over one cache (left on the cache: `conversation.remember_selection`).

    visual: [B, P] bool, the prompt columns it chooses among; counts / kept: host, the visual tokens of every row
    and what a selecting step keeps of them (keep_counts: the same on the device); padded: the prompt has padding
    columns; slots: [B, V] each row's visual columns (-1 padded), made once; previous: [B, V] the last step's
    attention over them (None: the next step is a first step); records: one per row, updated every step (`timer`
    sums the steps). Under beam search (`beams`), which reorders the cache's rows between steps, `keys`
    [B, Hkv, S, d] is a copy of layer L - 1's cache after the last step: each row's parent is the row whose keys it
    now starts with, and `previous` follows it."""

    visual: torch.Tensor
    counts: list[int]
    kept: list[int]
    keep_counts: torch.Tensor
    padded: bool
    slots: torch.Tensor
    previous: torch.Tensor | None
    records: list
    timer: Elapsed
    beams: bool = False
    keys: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> DecodeSelection:
        """A copied cache (a branched conversation) continues with the same state and records of its own; the
        steps timed so far stay with the original (CUDA events do not copy)."""
        timer = Elapsed()
        records = [dataclasses.replace(r, kept=None if r.kept is None else r.kept.clone(), extra=dict(r.extra),
                                       timer=timer) for r in self.records]  # fmt: skip
        previous = None if self.previous is None else self.previous.clone()
        keys = None if self.keys is None else self.keys.clone()
        return DecodeSelection(self.visual.clone(), list(self.counts), list(self.kept), self.keep_counts.clone(),
                               self.padded, self.slots.clone(), previous, records, timer, self.beams, keys)  # fmt: skip

    def follow_beams(self, keys: torch.Tensor) -> None:
        """Beam search: `previous` reordered as the cache's rows were since the last step (`keys`: layer L - 1's
        cache now, [B, Hkv, S, d]), then a copy of `keys` kept for the next step."""
        if self.keys is not None and self.previous is not None:
            now = keys[:, :, : self.keys.shape[2]]
            if not torch.equal(now, self.keys):  # reordered: rows are exact copies of earlier rows
                same = torch.stack([(self.keys == row).flatten(1).all(1) for row in now])  # [B now, B before]
                parents = torch.where(same.any(1), same.long().argmax(1), torch.arange(len(now), device=now.device))
                self.previous = self.previous[parents.to(self.previous.device)]
        self.keys = keys.clone()


class GatheredCache:
    """The step's cache as layers L and later see it: `update` stores the new entries in the real cache and hands
    the attention only the kept ones (`index` [B, W] into the updated cache, -1 padding); the rest is the cache's."""

    def __init__(self, cache: Any, index: torch.Tensor):
        self._cache, self._index = cache, index.clamp(min=0)

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._cache.update(*args, **kwargs)
        index = self._index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        return keys.gather(2, index), values.gather(2, index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


@dataclass
class Step:
    """One decoding step of a decode-time selection, from the LLM's input to the hook after layer `L - 1`."""

    selection: DecodeSelection
    embeds: torch.Tensor
    mask: torch.Tensor  # [B, S] the step's 2-D mask (prompt, every token since, the new ones)
    positions: torch.Tensor
    cache: Any


class DecodeTimeSelection:
    """The decode-time selection of one `LanguageModelStages` (its method's `select_layer`, `decode_keep`)."""

    def __init__(self, stages: LanguageModelStages, layer: int):
        self.stages, self.layer = stages, layer

    def start(self, state: PrefillRun) -> list:
        """After a prefill with a cache: the state the decoding steps select with, left on the cache; one record
        per row (tokens_in: the visual tokens chosen among; tokens_out: what a selecting step keeps of them)."""
        stages = self.stages
        first = state.initial
        visual, counts = first.visual, list(first.visual_counts)
        trailer = getattr(stages.adapter, "video_run_trailer", 0)  # separators closing a run (OneVision's newline)
        if trailer:
            visual, counts = visual & ~run_trailers(visual, trailer), state.layout.frame_tokens(trailer)
        method = stages.method
        timer = Elapsed()
        share = 1 / max(len(counts), 1)
        records = [
            LazyRecord(f"decode.layer{self.layer}", method.name, image=row, crop=0, tokens_in=n,
                       tokens_out=method.decode_count(n), kept=None, grid=(1, n), timer=timer, share=share,
                       extra={"steps": 0, "selections": 0})
            for row, n in enumerate(counts)
        ]  # fmt: skip
        kept = [method.decode_count(n) for n in counts]
        keep_counts = on_device(kept, visual.device)
        beams = stages.beams
        padded = first.padded
        slots = packed(visual, max(counts, default=0), counts)  # each row's visual columns, for every step
        selection = DecodeSelection(visual, counts, kept, keep_counts, padded, slots, None, records, timer, beams)
        remember_selection(state.cache, selection)
        return records

    def new_call(self, cache: Any) -> list:
        """A `generate` call continuing from `cache`: its first step is a first step again; returns the records
        its steps will fill (new ones: the earlier call's stay as they were)."""
        selection = selection_of(cache)
        if selection is None:
            return []
        selection.previous, selection.timer, selection.keys = None, Elapsed(), None
        selection.beams = self.stages.beams  # this call's own decoding strategy
        selection.records = [
            dataclasses.replace(r, kept=None, timer=selection.timer, extra={"steps": 0, "selections": 0})
            for r in selection.records
        ]
        return selection.records

    def start_step(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> None:
        """A decoding step on a cache a prefill of this stage filled: one new token selects (in the hook after
        layer L - 1); several (a new turn's text) attend to everything and start the selection afresh."""
        selection = selection_of(cache)
        if selection is None:
            return
        batch, steps = embeds.shape[:2]
        if selection.visual.shape[0] != batch:
            raise InputError(
                f"{self.stages.method.name}: the cache was filled by a call with {selection.visual.shape[0]} rows; "
                f"this step has {batch}; continue each conversation with its own cache"
            )
        if steps != 1:
            selection.previous = None
            return
        self.stages.call.step = Step(selection, embeds, mask, positions, cache)
        self.stages.row_probe.active = True

    def select(self, step: Step) -> None:
        """After layer L - 1 in a decoding step: the new token's attention row (head mean) over the visual tokens
        decides which cache entries layers L and later read in this step."""
        stages, selection = self.stages, step.selection
        probe = stages.row_probe
        probe.active = False
        timer = Stopwatch(step.embeds.device).start()
        keys = hf.cache_layers(step.cache)[self.layer - 1].keys  # [B, Hkv, S, d], the new token last
        total = keys.shape[2]
        key_valid = step.mask[:, -total:] != 0
        counts = selection.counts
        with torch.no_grad():
            if selection.beams:
                selection.follow_beams(keys)
            slots = selection.slots.to(keys.device)  # [B, V] each row's visual columns
            valid = slots >= 0
            attention = probe.step_attention(keys, key_valid, slots)  # [B, V], 0 where invalid
            keep, reselect = stages.method.decode_keep(attention, valid, selection.previous, selection.keep_counts)
            keep, reselect = keep.bool() & valid, reselect.bool()
        selection.previous = attention
        flags = reselect.tolist()  # the step's one host read: does any row re-select (it sizes the gather)?
        timer.stop()
        selection.timer.watches.append(timer)
        for row, record in enumerate(selection.records):
            record.extra["steps"] += 1
            if flags[row]:
                record.extra["selections"] += 1
                record.kept = Deferred(functools.partial(kept_rows, keep, valid), row)
        if not any(flags):
            return
        dropped = [n - k for n, k in zip(counts, selection.kept, strict=True)]
        widths = [total - (dropped[row] if flags[row] else 0) for row in range(len(flags))]
        self.gather(step, slots, valid & ~keep & reselect[:, None], widths, selection.padded)

    def gather(self, step: Step, slots: torch.Tensor, dropped: torch.Tensor, widths: list[int], padded: bool) -> None:
        """Layers L and later read, in this step, each row's cache entries but the `dropped` visual slots."""
        stages = self.stages
        total = step.mask.shape[1]
        drop = torch.zeros(slots.shape[0], total + 1, dtype=torch.bool, device=slots.device)
        drop = drop.scatter_(1, torch.where(dropped, slots, total), True)[:, :total]
        index = packed(~drop, max(widths), widths)  # [B, W] the entries each row reads
        cache = GatheredCache(step.cache, index)
        mask = None
        if padded or len(widths) > 1:  # one unpadded row reads every gathered entry: no mask
            full = stages.mask(step.embeds, step.mask, step.positions, step.cache, self.layer)
            mask = gathered_mask(full, index)
        overrides = Overrides(mask, step.positions, None, cache)
        for layer in range(self.layer, len(stages.layers)):
            stages.call.decode.selected[layer] = overrides


def kept_rows(keep: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the indices among its visual tokens that `keep` [B, V] marks (`valid` [B, V]: real ones)."""
    return [k[v].nonzero().squeeze(1) for k, v in zip(keep, valid, strict=True)]


def gathered_mask(mask: Any, index: torch.Tensor) -> Any:
    """A decoding step's mask (4-D [B, 1, 1, S] or 2-D [B, S]; None: nothing masked) for the entries `index` [B, W]
    (-1: padding, masked)."""
    if isinstance(mask, dict):  # a hybrid LLM's masks by layer type
        return {kind: gathered_mask(value, index) for kind, value in mask.items()}
    if mask is None or not isinstance(mask, torch.Tensor):
        return mask
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    if mask.dtype != torch.bool and mask.dim() == 2:
        blocked = 0
    expanded = index.view(index.shape[0], *[1] * (mask.dim() - 2), index.shape[1])
    expanded = expanded.expand(*mask.shape[:-1], index.shape[1])
    return mask.gather(-1, expanded.clamp(min=0)).masked_fill(expanded < 0, blocked)


def run_trailers(visual: torch.Tensor, trailer: int) -> torch.Tensor:
    """[B, L] bool: the last `trailer` tokens of every placeholder run of `visual` [B, L] (no frame's tokens)."""
    following = torch.nn.functional.pad(visual, (0, trailer))
    ends = torch.zeros_like(visual)
    for shift in range(1, trailer + 1):
        ends |= ~following[:, shift : shift + visual.shape[1]]
    return visual & ends
