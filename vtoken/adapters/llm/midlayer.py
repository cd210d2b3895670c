"""A prefill method's call points inside the LLM (`PrefillMethod.calls = ("mid_layer",)`, FrameFusion): call 0 on
the LLM's input, before layer 0; call c (1..L - 1) after layer c - 1's attention with its residual added, before
its MLP. `CallPoints` owns one prefill's share of it: the method's own run, its candidates (the video tokens, in
the method's order, kept in that order by compaction), the attention rows a call asks for, and the call records.

Where the calls run: call 0 in the pre-hook of layer 0 (`PrefillRun.enter_layer`); call c inside layer c - 1, whose
forward the stages split at its residual (`hf.split_attention` / `hf.split_mlp`, `stages.SplitLayer`): its MLP and
every later layer run on the shorter sequence, so the caches of the layers after the call hold it. A call that
drops nothing changes no view. Each call is a fixed burst of kernels on the device; the method's own reads (how
many tokens a threshold flags) are its documented syncs. Where the frames sit comes from the call's one read of
its prompt's layout (`CallPath.note_layout` reads `Adapter.frame_read` with it): the slot table is built on the
host once per prefill and copied to the device once (`frames.slot_table`); decoding steps never touch it. A prompt
the call path did not note (shrunk by an encoder stage) reads its frames here, once.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from vtoken.errors import InputError
from vtoken.timing import Stopwatch
from vtoken.tokens import MidLayerStep, MidLayerTokens

from ..frames import Columns, slot_table
from .records import Deferred, LazyRecord
from .views import take_columns

if TYPE_CHECKING:
    from .prefill import PrefillRun


def _read_frame_columns(adapter: Any, batch: int, length: int) -> Columns | None:
    """The frames' columns of a prefill of [B, L] whose prompt the call path did not note (an encoder stage shrank
    it): read from its input_ids here, in one read (`Adapter.frame_read`); None where none match its videos."""
    state = adapter.calls.state
    if state.ids is None or tuple(state.ids.shape) != (batch, length):
        return None
    found = adapter.frame_read(state.ids, state.frames)
    return None if found is None else adapter.frame_columns(found.tolist(), state.frames)


class CallPoints:
    """One prefill's call points. run: the method's state (`PrefillMethod.start`); order, chain, columns: [B, P] the
    candidates (slots of the current view, -1 past a row's count), their keys, their prompt columns; counts: host,
    candidates per row; rows: how many of each row's last tokens give attention rows; armed: the layer whose
    queries and keys are captured for the next call's attention (None: none)."""

    def __init__(self, prefill: PrefillRun, run: Any, order: torch.Tensor, chain: torch.Tensor, counts: list[int],
                 rows: int):  # fmt: skip
        self.prefill = prefill
        self.method = prefill.method
        self.run = run
        self.order = order
        self.chain = chain
        self.columns = order.clone()  # the prompt's columns, before any call dropped a token
        self.counts = counts
        self.received = list(counts)
        self.rows = rows
        self.armed: int | None = None
        self.timer = Stopwatch(order.device)
        self.after: dict[int, Any] = {}  # call point -> the view the sequence went on with after it

    @classmethod
    def start(cls, prefill: PrefillRun, embeds: torch.Tensor) -> CallPoints:
        """The call points of a prefill of `embeds` [B, L, D]: the frames' slots from the call's host columns, the
        method's run and order. A call whose prompt holds no video is refused (the method acts on videos)."""
        stages, method = prefill.stages, prefill.method
        adapter = stages.adapter
        batch, length = embeds.shape[:2]
        spans = adapter.calls.frame_columns_for((batch, length))  # read with the call's layout, before it ran
        if spans is None:
            spans = _read_frame_columns(adapter, batch, length)
        if spans is None or not any(spans):
            raise InputError(
                f"{method.name} acts on videos (the tokens at one place of consecutive frames), and this call's "
                "prompt holds no video frames it can find (images only, or placeholders that do not match the "
                "videos given)"
            )
        lead = adapter.frame_leading  # a frame's first tokens that are not patches (Video-LLaVA's [CLS])
        if lead:
            spans = [[[(start + lead, end) for start, end in video] for video in row] for row in spans]
        slots, videos, counts = slot_table(spans, batch, length, embeds.device)
        order, chain = method.candidate_order(slots, videos, counts)
        run = method.start(batch, len(stages.layers))
        return cls(prefill, run, order, chain, counts, method.query_count(adapter.family))

    @property
    def done(self) -> bool:
        return bool(getattr(self.run, "done", False))

    def call(self, point: int, hidden: torch.Tensor) -> torch.Tensor:
        """Call point `point` on the hidden states [B, C, D] of the current view: the method's step applied. Returns
        the hidden states [B, C', D] the sequence goes on with."""
        if self.done:
            self._disarm()
            return hidden
        self.timer.start()
        with torch.no_grad():
            attention = row_valid = None
            if self.armed is not None:
                attention, row_valid = self._attention()
            tokens = MidLayerTokens(point, hidden, self.order, self.chain, self.columns, list(self.counts),
                                    attention, row_valid)  # fmt: skip
            step = self.method.step(self.run, tokens)
            hidden = self._apply(point, hidden, step)
            self.after[point] = self.prefill.view
            wants = getattr(self.run, "wants_attention", None)
            if wants is not None and point + 1 < len(self.prefill.stages.layers) and any(wants(point + 1)):
                self._arm(point)  # layer `point` runs next: the next call reads its attention
        self.timer.stop()
        return hidden

    # ----------------------------------------------------------------- the attention of the layer before a call
    def _arm(self, layer: int) -> None:
        self.armed = layer
        self.prefill.stages.call_probes[layer].active = True

    def _disarm(self) -> None:
        if self.armed is not None:
            probe = self.prefill.stages.call_probes[self.armed]
            probe.active = False
            probe.clear()
            self.armed = None

    def _attention(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, R, P] the armed layer's head-mean causal attention of each row's last R real tokens over the
        candidates, in order; [B, R] real rows), from the layer's captured queries and its cache's keys."""
        prefill, layer = self.prefill, self.armed
        view = prefill.view
        probe = prefill.stages.call_probes[layer]
        key_valid = view.mask != 0
        device = view.column.device
        back = torch.arange(self.rows - 1, -1, -1, device=device)
        if prefill.layout.right:  # each row's own last real slot
            last = view.mask.long().sum(1, keepdim=True) - 1
        else:  # every row ends at the last slot
            last = torch.full((view.column.shape[0], 1), view.width - 1, dtype=torch.long, device=device)
        rows = last - back  # [B, R]
        rows = rows.masked_fill(rows < 0, -1)
        attention = probe.visual_attention(rows, key_valid, self.order, prefill._cached_keys(layer, view.width))
        probe.active = False
        probe.clear()
        self.armed = None
        return attention, rows >= 0

    # ----------------------------------------------------------------- a step applied
    def _apply(self, point: int, hidden: torch.Tensor, step: MidLayerStep) -> torch.Tensor:
        """Write the step's states into the kept candidates, drop the others from the view (positions stay) and
        compact the candidates, keeping their order."""
        prefill = self.prefill
        view = prefill.view
        valid = self.order >= 0
        keep = step.keep & valid
        if step.states is not None:  # fp32 states into the hidden dtype, at the kept candidates' slots
            width = view.width
            target = torch.where(keep, self.order, width)
            spare = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], 1, hidden.shape[2])], 1)
            index = target[..., None].expand(-1, -1, hidden.shape[2])
            hidden = spare.scatter(1, index, step.states.to(hidden.dtype))[:, :width]
        removed = [n - k for n, k in zip(self.counts, step.kept, strict=True)]
        if not any(removed):
            self.counts = list(step.kept)
            return hidden
        width = view.width
        gone = torch.where(valid & ~keep, self.order, width)
        dropped = torch.zeros(gone.shape[0], width + 1, dtype=torch.bool, device=gone.device).scatter_(1, gone, True)
        keep_slots = (view.mask != 0) & ~dropped[:, :width]
        lengths = [n - r for n, r in zip(view.lengths, removed, strict=True)]
        visual_counts = [n - r for n, r in zip(view.visual_counts, removed, strict=True)]
        hidden, sources = prefill.narrow(hidden, keep_slots, lengths, visual_counts, point)
        # the candidates that stay, in their order: a stable sort puts them first; then their slots in the new view
        compact = (~keep).long().argsort(dim=1, stable=True)[:, : max(max(step.kept, default=0), 1)]
        alive = torch.gather(keep, 1, compact)
        moved = torch.full((sources.shape[0], width + 1), -1, dtype=torch.long, device=sources.device)
        moved.scatter_(1, torch.where(sources >= 0, sources, width), torch.arange(sources.shape[1],
                       device=sources.device).expand_as(sources))  # fmt: skip
        order = self.order.gather(1, compact)
        self.order = take_columns(moved[:, :width], order, 1).masked_fill(~alive, -1)
        self.chain = self.chain.gather(1, compact).masked_fill(~alive, -1)
        self.columns = self.columns.gather(1, compact).masked_fill(~alive, -1)
        self.counts = list(step.kept)
        return hidden

    # ----------------------------------------------------------------- records
    def records(self) -> list:
        """Per row, one record per call that acted, from the run's log: "prefill.merge.cC" (call C), a prune
        "prefill.prune.layerL" (scored by layer L's attention, L = C - 1), the row's visual tokens in and out
        (candidates, and those that are none: OneVision's newline), the entry's other numbers and the run's
        `sparsity` list and achieved `cost` as extras, `kept` the row's visual tokens that went on after the call
        (ranks among its visual tokens as the LLM received them; a merged token at its head's place), computed
        when read."""
        self._disarm()
        run, name = self.run, self.method.name
        batch = self.order.shape[0]
        log = getattr(run, "log", None) or [[] for _ in range(batch)]
        sparsities = getattr(run, "sparsities", None)
        cost = getattr(run, "cost", None)
        first = self.prefill.initial.visual
        others = [n - c for n, c in zip(self.prefill.initial.visual_counts, self.received, strict=True)]
        shared: dict[int, dict] = {point: {} for point in self.after}
        out = []
        for row in range(batch):
            extra = {} if sparsities is None else {"sparsity": list(sparsities[row])}
            if cost is not None:
                extra["cost"] = cost(row)
            for entry in log[row]:
                point = entry["call"]
                what = entry.get("what", "merge")
                stage = f"prefill.prune.layer{point - 1}" if what == "prune" else f"prefill.{what}.c{point}"
                view = self.after[point]
                numbers = {k: v for k, v in entry.items() if k not in ("call", "before", "after", "what")}
                kept = Deferred(functools.partial(visual_ranks, first, view.column, view.visual), row, shared[point])
                before, after = entry["before"] + others[row], entry["after"] + others[row]
                out.append(LazyRecord(stage, name, image=row, crop=0, tokens_in=before, tokens_out=after, kept=kept,
                                      grid=(1, before), timer=self.timer, share=1 / batch,
                                      extra={**numbers, **extra}))  # fmt: skip
        return out


def visual_ranks(first: torch.Tensor, column: torch.Tensor, visual: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the ranks among its visual prompt columns (`first` [B, L]) of the visual slots of a view whose slots
    hold prompt columns `column` [B, C] (`visual` [B, C]); ascending (a view keeps the prompt's order)."""
    rank = first.long().cumsum(1) - 1
    ranks = rank.gather(1, column.clamp(min=0))
    held = visual & (column >= 0)
    return [ranks[row][held[row]] for row in range(ranks.shape[0])]
