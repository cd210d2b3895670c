"""One prefill of a call with an LLM stage: a `PrefillRun` owns what the prefill has made so far (the current view
of the prompt, the layout read once, the prompt's own rotary tables, the cache the layers fill, what each layer ran
on, the records) and does the three things a prefill does: at a method's drop point a fixed burst of kernels
(gather what the method reads, score, keep, gather the hidden states, positions, rotary tables and the mask of the
rest of the prefill), the output-aware KV cut when the prefill ends, and the records.

The prompt's layout (per row: real, visual and text tokens) comes from the call path, which reads it with the
rest of what it reads before the encoder and follows the shrink on the host, so the prefill reads nothing (a prompt
the call path did not see is read when the prefill starts: `Layout.read`, one host sync). From then on a method's
budget says how many tokens each row keeps (`PrefillMethod.kept_counts`), so shapes never wait for the device. A
threshold method (MustDrop) reads its counts back once per drop. Records are built when read (`records.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vtoken.errors import InputError
from vtoken.methods.base import PrefillMethod
from vtoken.timing import Stopwatch
from vtoken.tokens import LayerTokens, TextTokens

from .. import hf
from .midlayer import CallPoints
from .records import LazyRecord, kept_ranks, prefill_records
from .views import (
    LayerView,
    Layout,
    Overrides,
    narrowed,
    packed,
    take_columns,
    text_after_visual,
)

if TYPE_CHECKING:
    from .stages import LanguageModelStages


class PrefillRun:
    """One prefill of one call, on the decoder layers of `stages` (the hooks that drive it).

    view: what the layers run on now; layout: the prompt's host counts; cache: the cache the layers fill; rotary /
    position_ids: the prompt's own tables and positions (seen at the first layer); views: what every layer ran on,
    in order; overrides: what the layers after the last drop get; records: the drops' records so far; chosen: [B, T]
    the text rows a method chose (query_rows="chosen"), over each row's text after its first visual token.
    """

    def __init__(self, stages: LanguageModelStages, view: LayerView, layout: Layout, cache: Any,
                 chosen: torch.Tensor | None = None):  # fmt: skip
        self.stages = stages
        self.method: PrefillMethod = stages.method
        self.view = view
        self.layout = layout
        self.cache = cache
        self.chosen = chosen
        self._unchosen: torch.Tensor | None = None  # ~chosen, made once
        self.rotary: Any = None
        self.position_ids: Any = None
        self.initial = view  # the prompt as the LLM received it
        self.views: list[LayerView] = []
        self.overrides: Overrides | None = None
        self.records: list = []
        self.group_sizes: list[list[int]] | None = None  # per row, its groups' sizes (an encoder stage's groups)
        self.calls: CallPoints | None = None  # the method's mid-layer call points (calls=("mid_layer",))

    # ----------------------------------------------------------------- start
    @classmethod
    def start(cls, stages: LanguageModelStages, embeds: torch.Tensor, kwargs: dict, visual: torch.Tensor,
              cache: Any) -> PrefillRun | None:  # fmt: skip
        """The run of a prefill of `embeds` [B, L, D] whose visual tokens are `visual` [B, L]; None when no row has
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
        layout = stages.adapter.layout_for((batch, length))  # host counts the call path knows
        if layout is None:  # a prompt the call path did not see: read here, the prefill's one host read
            layout = Layout.read(mask, visual)
        if not any(layout.visual):
            return None
        positions = (mask.cumsum(1) - 1).clamp(min=0) if stages.renumber else None  # each row's own numbering
        column = torch.arange(length, device=device).expand(batch, length)
        protected = stages.adapter.protected_mask_for((batch, length))
        found = stages.adapter.groups_for((batch, length))
        groups = None if found is None else found[0].to(device).masked_fill(~visual, -1)
        view = LayerView(column, mask, positions, visual, None if protected is None else protected.to(device), None,
                         layout.lengths, layout.visual, [0] * batch, groups)  # fmt: skip
        run = cls(stages, view, layout, cache)
        run.group_sizes = None if found is None else found[1]
        if method.query_rows == "chosen":
            run.chosen = run._chosen_rows(embeds)
        if method.calls:
            run.calls = CallPoints.start(run, embeds)
        return run

    def _chosen_rows(self, embeds: torch.Tensor) -> torch.Tensor:
        """query_rows="chosen": [B, T] bool over each row's text after its first visual token (right-padded), the
        rows the method picks from the LLM's input embeddings. The visual and text slots are the prompt view's own
        (made once: the first drop reads them again)."""
        view, counts = self.view, self.layout.text
        visual = view.visual_slots()
        width = max(max(counts, default=0), 1)
        words = view.text_slots(counts, width)
        whole = all(n == visual.shape[1] for n in view.visual_counts)
        with torch.no_grad():
            chosen = self.method.choose_rows(take_columns(embeds, visual, 1, not whole), visual >= 0,
                                             take_columns(embeds, words, 1), words >= 0)  # fmt: skip
        chosen = chosen.bool()
        return chosen if all(n == width for n in counts) else chosen & (words >= 0)

    # ----------------------------------------------------------------- every layer
    def enter_layer(self, kwargs: dict, hidden: torch.Tensor | None = None) -> tuple[Overrides | None, torch.Tensor]:
        """Before a decoder layer: note what it runs on; the first one also shows the prompt's own tables and cache,
        and is where a method's call point 0 acts on the LLM's input `hidden` [B, L, D]. Returns what the layer gets
        instead of the LLM's own arguments (None: the LLM's) and its hidden states."""
        if self.rotary is None:
            self.rotary, self.position_ids = kwargs.get("position_embeddings"), kwargs.get("position_ids")
            self.cache = self.cache if self.cache is not None else hf.cache_in(kwargs)
            if self.calls is not None and hidden is not None:
                hidden = self.calls.call(0, hidden)
        self.views.append(self.view)
        return self.overrides, hidden

    def call_point(self, point: int, hidden: torch.Tensor) -> torch.Tensor:
        """A method's call point `point` >= 1 (after layer point - 1's attention, residual added): the hidden
        states [B, C', D] its MLP and the later layers run on."""
        return hidden if self.calls is None else self.calls.call(point, hidden)

    # ----------------------------------------------------------------- a drop
    def drop(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """After drop layer `layer`: the hidden states [B, C', D] of what goes on; the next view and its overrides."""
        method, view = self.method, self.view
        timer = Stopwatch(hidden.device).start()
        slots = view.visual_slots()  # [B, V] each row's visual slots, -1 padded
        counts = view.visual_counts
        merged = updated = None
        with torch.no_grad():  # a selection: nothing to differentiate
            tokens = self.layer_tokens(layer, hidden, slots)
            if max(counts, default=0) == 0:  # no row has visual tokens left
                keep_visual, kept = tokens.valid, list(counts)
            else:
                keep_visual = method.keep_mask(tokens).bool()
                if any(n != slots.shape[1] for n in counts):  # padding entries stay dropped
                    keep_visual = keep_visual & tokens.valid
                kept = method.kept_counts(tokens)
                if tokens.protected is not None:
                    keep_visual |= tokens.protected
                    kept = None
                merged = method.merge(tokens, keep_visual)
                updated = method.update(tokens, keep_visual)
            if kept is None:  # a threshold decided: the drop's one host read
                kept = keep_visual.sum(1).tolist()
            added = merged.counts if merged is not None else None
        keep = kept_slots(view, slots, keep_visual)
        now = [k + (added[row] if added else 0) for row, k in enumerate(kept)]
        lengths = [n - v + k for n, v, k in zip(view.lengths, counts, now, strict=True)]
        if updated is not None:  # kept tokens that others were merged into take their new states
            hidden = replace_columns(hidden, slots, updated, keep_visual)
        merged_columns = None
        if merged is not None:
            if any(n != slots.shape[1] for n in counts):  # padding entries (-1) among the slots
                anchors = slots.gather(1, merged.anchors.clamp(min=0)).clamp(min=0)
            else:
                anchors = slots.gather(1, merged.anchors)
            merged_columns = view.column.gather(1, anchors)
            if any(n != merged.valid.shape[1] for n in added):  # rows with fewer merged tokens
                merged_columns = merged_columns.masked_fill(~merged.valid, -1)
            hidden = torch.cat([hidden, merged.features.to(hidden.dtype)], 1)
        new_view, sources = narrowed(view, keep, lengths, now, self.layout.right, self.stages.renumber, merged,
                                     merged_columns, slots)  # fmt: skip
        hidden = gathered(hidden, sources, new_view.padded)
        compute = kept_ranks(self.initial.visual, view.column, view.merged, slots, keep_visual)
        timer.stop()
        self.records += prefill_records(method.name, layer, counts, kept, added, compute, timer)
        self.view = new_view
        self.overrides = self._overrides(hidden, new_view, layer + 1)
        return hidden

    def narrow(self, hidden: torch.Tensor, keep: torch.Tensor, lengths: list[int], visual_counts: list[int],
               layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Go on with the slots `keep` [B, C] marks of the current view (host counts of the result per row:
        `lengths`, `visual_counts`) from layer `layer` on: the next view, its overrides, and (the hidden states
        [B, C', D] gathered, [B, C'] the source slot of each new slot)."""
        new_view, sources = narrowed(self.view, keep, lengths, visual_counts, self.layout.right, self.stages.renumber)
        hidden = gathered(hidden, sources, new_view.padded)
        self.view = new_view
        self.overrides = self._overrides(hidden, new_view, layer)
        return hidden, sources

    def _overrides(self, hidden: torch.Tensor, view: LayerView, layer: int) -> Overrides:
        """Mask, positions and rotary tables of the layers running on `view` from `layer` on."""
        stages = self.stages
        if stages.renumber:  # positions count each row's real tokens from 0: rows of the LLM's own rotary table
            positions = view.positions
            table = stages.rotary_table(hidden, self.initial.width) if positions.dim() == 2 else None
            if table is not None and not view.padded:  # positions 0..C-1 in every row: the table's first rows
                rotary = tuple(t[None, : view.width].expand(positions.shape[0], -1, -1) for t in table)
            elif table is not None:
                rotary = table[0][positions], table[1][positions]
            else:
                rotary = stages.lm.rotary_emb(hidden, position_ids=positions)
        else:  # the prompt's own positions and tables, sliced
            positions = self.position_ids
            if positions is None:
                first = self.initial.mask
                positions = (first.cumsum(1) - 1).clamp(min=0)
            positions = take_columns(positions, view.column, positions.dim() - 1, view.padded)
            rotary = tuple(take_columns(t, view.column, 1, view.padded) for t in self.rotary)
        mask = stages.mask(hidden, view.mask if view.padded else None, positions, self.cache, layer)
        return Overrides(mask, positions, rotary)

    # ----------------------------------------------------------------- what a method reads at a drop point
    def layer_tokens(self, layer: int, hidden: torch.Tensor, slots: torch.Tensor) -> LayerTokens:
        """What the method reads at drop point `layer` (`PrefillMethod.reads`), gathered into `LayerTokens`: the
        attention of its query rows to the visual tokens (one fused op), post-RoPE keys, final-normed and raw
        hidden states, each for the row's visual tokens and its text after the image; counts from the host.
        slots: [B, V] each row's visual slots (-1: padding)."""
        stages, view, method = self.stages, self.view, self.method
        reads = method.reads
        key_valid = view.real
        valid = slots >= 0
        rows = row_valid = attention = keys = None
        if "attention" in reads or "next_attention" in reads:
            rows = self._query_rows(method.query_rows)
            row_valid = rows >= 0
            probe = stages.probes[layer]
            cached = None
            if "next_attention" in reads:  # the next layer's own input norm and the rotary tables it will get
                rotary = self.overrides.position_embeddings if self.overrides is not None else self.rotary
                probe.replay(stages.layers[layer + 1].input_layernorm(hidden), rotary)
            else:
                cached = self._cached_keys(layer, view.width)
            attention = probe.visual_attention(rows, key_valid, slots, cached)
        if "plain_attention" in reads:  # no rotary, no causal mask, max over heads (PruneVid)
            rows = self._query_rows(method.query_rows)
            row_valid = rows >= 0
            attention = stages.probes[layer].plain_attention(rows, key_valid, slots)
        if "keys" in reads:
            shifted = not self.layout.right and view.padded  # a left-padded row may be numbered from its padding
            keys = stages.probes[layer].keys(key_valid, self._cached_keys(layer, view.width), shifted)  # [B, S, H*d]
        normed = stages.lm.norm(hidden) if "normed" in reads else None
        index = text = None
        safe = slots if all(n == slots.shape[1] for n in view.visual_counts) else slots.clamp(min=0)
        if keys is not None or normed is not None:
            # each slot's index in its row's unpadded LLM input: from the row's first real slot (slot 0 unpadded)
            first = view.column[:, :1] if not view.padded else view.column.gather(1, view.mask.argmax(1, keepdim=True))
            index = view.column - first
            counts = self.layout.text
            width = max(counts, default=0)
            text_slots = view.text_slots(counts, width)
            text_valid = text_slots >= 0
            text_slots = text_slots if all(n == width for n in counts) else text_slots.clamp(min=0)
            text_keys = None if keys is None else take_columns(keys, text_slots, 1, False)
            text_normed = None if normed is None else take_columns(normed, text_slots, 1, False)
            text = TextTokens(text_valid, index.gather(1, text_slots), text_keys, text_normed, known=counts)
            index = index.gather(1, safe)

        def visual_part(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else take_columns(x, safe, 1, False)

        protected = None if view.protected is None else view.protected.gather(1, safe)
        if protected is not None and safe is not slots:  # padding entries are never protected
            protected = protected & valid
        hidden_visual = visual_part(hidden) if "hidden" in reads else None
        received = self.initial.visual_counts
        groups = None if view.groups is None else view.groups.gather(1, safe).masked_fill(~valid, -1)
        return LayerTokens(layer, attention, row_valid, valid, protected, received, index, visual_part(keys),
                           visual_part(normed), hidden_visual, text, known=view.visual_counts, groups=groups,
                           group_sizes=None if groups is None else self.group_sizes)  # fmt: skip

    def _query_rows(self, rows: str) -> torch.Tensor:
        """[B, R] sequence indices of the method's query rows in the current view (-1: none)."""
        view, layout = self.view, self.layout
        if rows == "last":  # each row's own last real token: the last column unless the batch is padded on the right
            if not layout.right:
                return torch.full((view.column.shape[0], 1), view.width - 1, dtype=torch.long,
                                  device=view.column.device)  # fmt: skip
            return view.mask.sum(1, keepdim=True) - 1
        if rows == "after_visual":  # every real token after the row's last visual one (never dropped)
            return packed(text_after_visual(view.real, view.visual), max(max(layout.after, default=0), 1),
                          layout.after)  # fmt: skip
        text = view.text_slots(layout.text, max(max(layout.text, default=0), 1))
        if rows == "chosen":  # text tokens are never dropped: the chosen ones keep their place among them
            if self._unchosen is None:
                self._unchosen = ~self.chosen
            return text.masked_fill(self._unchosen, -1)
        return text

    def _cached_keys(self, layer: int, width: int) -> torch.Tensor | None:
        """Layer `layer`'s rotated keys [B, Hkv, S, d] as its cache holds them after it ran in this prefill (the
        prefill starts from an empty cache), or None without a cache (they are rotated from the capture then)."""
        layers = hf.cache_layers(self.cache) if self.cache is not None else None
        if not layers or layer >= len(layers):
            return None
        keys = getattr(layers[layer], "keys", None)
        return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[2] == width else None

    # ----------------------------------------------------------------- the end
    def finish(self, cache: Any, prompt_length: int) -> tuple[list, list[LayerView | None]]:
        """After the prefill (`cache`: the one the LLM returned, if it made one): the KV cut, the decode-time
        selection's state, the records' layer averages. Returns the records and what each layer's cache holds
        (None: the prompt as the LLM received it), for the decoding steps."""
        self.cache = cache if cache is not None else self.cache
        stages, first = self.stages, self.initial
        views: list[LayerView | None] = [None if v is first else v for v in self.views]
        counts = [v.visual_counts for v in self.views]  # per layer, per row (host)
        records = self.records
        if self.calls is not None:
            records += self.calls.records()
        if stages.cut_layers and self.cache is not None:
            records += self._cut_caches(views, prompt_length)
        if self.cache is not None:
            self._whole_first_cache(views, prompt_length)
        if stages.selection is not None and self.cache is not None:
            records += stages.selection.start(self)
        rows = range(len(first.lengths))
        average = [sum(layer[row] for layer in counts) / max(len(counts), 1) for row in rows]
        for record in records:
            if record.stage.startswith("prefill"):
                record.extra["layer_average"] = average[record.image]
        return records, views

    def _cut_caches(self, views: list[LayerView | None], prompt_length: int) -> list:
        """Cut the caches of `stages.cut_layers` to the visual tokens in the final view (output-aware KV cut); one
        record per row. Two gathers per cut layer, no host sync."""
        final, cut_layers = self.view, self.stages.cut_layers
        cut_views: dict[int, tuple[LayerView, torch.Tensor]] = {}  # per view held: its cut view, final's slots there
        for index in cut_layers:
            held = self.views[index]
            if index == self.stages.first_attention:  # transformers reads the cache length here: masked, not cut
                views[index] = holey(held, final, prompt_length)
                continue
            if id(held) not in cut_views:
                cut = LayerView(final.column, final.mask, final.positions, final.visual, final.protected,
                                final.merged, final.lengths, final.visual_counts, held.lost)  # fmt: skip
                slots = slots_of_columns(held, final.column, prompt_length, final.padded)
                cut_views[id(held)] = cut, slots.clamp(min=0) if final.padded else slots
            views[index], slots = cut_views[id(held)]
            layer_cache = hf.cache_layers(self.cache)[index]
            for name in ("keys", "values"):
                tensor = getattr(layer_cache, name)
                setattr(layer_cache, name, tensor.gather(2, slots[:, None, :, None].expand(
                    -1, tensor.shape[1], -1, tensor.shape[-1])))  # fmt: skip
        rows = range(len(final.lengths))
        before = [sum(self.views[i].visual_counts[row] for i in cut_layers) for row in rows]
        after = [final.visual_counts[row] * len(cut_layers) for row in rows]
        lengths = [[(v or self.initial).lengths[row] for v in views] for row in rows]
        timer = Stopwatch(final.mask.device).start().stop()
        return [
            LazyRecord("decode.kv", self.method.name, image=row, crop=0, tokens_in=before[row],
                       tokens_out=after[row], kept=None, grid=(1, 0), timer=timer, share=0.0,
                       extra={"cache_lengths": lengths[row]})
            for row in rows
        ]  # fmt: skip

    def _whole_first_cache(self, views: list[LayerView | None], prompt_length: int) -> None:
        """The first attention layer's cache holds one entry per prompt column, whatever that layer ran on:
        transformers reads the cache length (so the next position and every mask's size) from it. A layer that ran
        on a shorter view (a call point before it) has its keys and values spread to their prompt columns, the
        columns it never saw masked out in its view. Two scatters; nothing when it ran on the whole prompt."""
        index = self.stages.first_attention
        held = views[index] if index < len(views) else None
        layers = hf.cache_layers(self.cache)
        if held is None or not layers or index >= len(layers) or held.width == prompt_length:
            return
        layer_cache = layers[index]
        target = torch.where(held.column >= 0, held.column, prompt_length)  # [B, C] (padding to a spare column)
        for name in ("keys", "values"):
            tensor = getattr(layer_cache, name)
            batch, heads, _, dim = tensor.shape
            spread = tensor.new_zeros(batch, heads, prompt_length + 1, dim)
            spread.scatter_(2, target[:, None, :, None].expand(-1, heads, -1, dim), tensor)
            setattr(layer_cache, name, spread[:, :, :prompt_length])

        def place(x: torch.Tensor | None, fill) -> torch.Tensor | None:
            if x is None:
                return None
            out = torch.full((x.shape[0], prompt_length + 1), fill, dtype=x.dtype, device=x.device)
            return out.scatter_(1, target, x)[:, :prompt_length]

        column = self.initial.column
        views[index] = LayerView(column, place(held.mask, 0), None, place(held.visual, False),
                                 place(held.protected, False), place(held.merged, False), held.lengths,
                                 held.visual_counts, held.lost, place(held.groups, -1))  # fmt: skip


def holey(held: LayerView, final: LayerView, prompt_length: int) -> LayerView:
    """A cut of the cache `held` holds to the tokens of `final`, as a view with the others masked out (nothing
    moves in the cache): for the first attention layer, whose length transformers reads."""
    slots = slots_of_columns(held, final.column, prompt_length)
    width = held.width
    flags = torch.zeros(slots.shape[0], width + 1, dtype=torch.bool, device=slots.device)
    flags = flags.scatter_(1, torch.where(slots >= 0, slots, width), True)[:, :width] & (held.mask != 0)

    def kept(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x & flags

    groups = None if held.groups is None else held.groups.masked_fill(~flags, -1)
    return LayerView(held.column, held.mask * flags.to(held.mask.dtype), held.positions, kept(held.visual),
                     kept(held.protected), kept(held.merged), list(final.lengths), list(final.visual_counts),
                     held.lost, groups)  # fmt: skip


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


def kept_slots(view: LayerView, slots: torch.Tensor, keep_visual: torch.Tensor) -> torch.Tensor:
    """[B, C] bool: the slots of `view` a drop keeps: every real one that is not visual, and the visual slots
    `slots` [B, V] (-1: padding) where `keep_visual` [B, V]. One scatter of `keep_visual` over the real slots (the
    visual ones overwritten); padding entries write into a spare column."""
    width = view.width
    if not any(n != slots.shape[1] for n in view.visual_counts):  # no padding entry: every slot is a visual one
        return view.real.scatter(1, slots, keep_visual)
    spare = torch.cat([view.real, view.real.new_zeros(slots.shape[0], 1)], 1)
    return spare.scatter(1, torch.where(slots >= 0, slots, width), keep_visual)[:, :width]


def gathered(hidden: torch.Tensor, sources: torch.Tensor, padded: bool) -> torch.Tensor:
    """hidden [B, C, D] gathered by `sources` [B, C'] (-1: a padding slot, zeroed when `padded`)."""
    index = sources.clamp(min=0) if padded else sources
    out = hidden.gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))
    return out.masked_fill((sources < 0)[:, :, None], 0.0) if padded else out


def replace_columns(hidden: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """hidden [B, C, D] with rows [B, V, D] written at the visual slots [B, V] (-1: none) where `where` [B, V]; the
    rest unchanged (padding and unchosen entries write into a spare column, dropped)."""
    batch, width, dim = hidden.shape
    target = torch.where(where & (slots >= 0), slots, width)
    spare = torch.cat([hidden, hidden.new_zeros(batch, 1, dim)], 1)
    return spare.scatter(1, target[..., None].expand(-1, -1, dim), rows.to(hidden.dtype))[:, :width]


def slots_of_columns(view: LayerView, columns: torch.Tensor, prompt_length: int, padded: bool = True) -> torch.Tensor:
    """[B, R] slots of `view` holding prompt columns `columns` [B, R] (-1: padding, or not held). `padded=False`:
    `columns` holds no padding and every one of them is held (a later view's columns): a lookup table with no fill
    and no mask."""
    batch = view.column.shape[0]
    device = view.column.device
    slots = torch.arange(view.width, device=device).expand(batch, -1)
    if not padded:
        lookup = torch.empty(batch, prompt_length + 1, dtype=torch.long, device=device)
        if not view.padded:  # every slot holds a column: no spare entry for padding
            return lookup[:, 1:].scatter_(1, view.column, slots).gather(1, columns)
        return lookup.scatter_(1, view.column + 1, slots)[:, 1:].gather(1, columns)
    lookup = torch.full((batch, prompt_length + 1), -1, dtype=torch.long, device=device)
    lookup.scatter_(1, view.column + 1, slots)
    return lookup.gather(1, columns + 1).masked_fill(columns < 0, -1)
