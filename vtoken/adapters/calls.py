"""How a patched model's calls run: the `CallPath` every adapter holds (one per patched model).

- `prepare`: encode every visual input with the encoder-stage method and shrink the prompt to the kept tokens;
- the forward pre-hook (`_pre_forward`) for a plain `model(**inputs)` call, including manual decoding steps after
  a pruned prefill (`_continue_decoding`), and the post-forward hook that applies labels to the kept columns;
- the generate wrapper's body (`generate`): encode and select first, then the stock `generate` on the
  shorter prompt with the pre-encoded features, the caller's prompt put back in front of the result.
Per-call state lives in the calling thread's `CallState` (see `state.py`), which the call path owns; the family
(the adapter) is asked what only it knows: its plan, its encoder, its positions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from vtoken.errors import InputError
from vtoken.geometry.tables import repeated
from vtoken.records import LazyRecords, Record

from . import hf
from .compiled import eager
from .conversation import Conversation, cached_length, forget, remember_prompt
from .frames import Columns
from .llm.views import LAYOUT_WIDTH, Layout, layout_counts
from .prompt import HostLayout, gather_columns, read_layout, shrink_prompt
from .state import CallState, PerThread

# names of the prompt's ids and mask among the values a call reads to the host (methods that read the question)
PROMPT_IDS, PROMPT_MASK = "prompt.input_ids", "prompt.attention_mask"
# the name of the LLM prefill's per-row prompt counts among them (`layout_counts`, read with the rest)
PROMPT_LAYOUT = "prompt.llm_layout"

# generate arguments (or generation-config fields) that switch on assisted decoding
ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def scatter_into_placeholders(is_placeholder: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: `values` [P] (one per placeholder, row-major) at the True places of `is_placeholder`, False
    elsewhere, without reading the mask's count back."""
    flat = is_placeholder.flatten()
    ordinal = (flat.long().cumsum(0) - 1).clamp(0, max(len(values) - 1, 0))
    placed = values.to(flat.device)[ordinal] if len(values) else torch.zeros_like(flat)
    return (flat & placed).view_as(is_placeholder)


class CallPath:
    """Everything that runs inside a patched `model(...)` / `model.generate(...)`, for one adapter: the forward
    hooks and the generate wrapper's body, the per-thread call state and the records of the calls."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.conversation = Conversation(self)
        self._calls = PerThread(CallState)  # per-call state, one per thread (hooks run in the calling thread)
        self._latest: list[Record] = []  # records of the most recent call of any thread

    def __getstate__(self) -> dict[str, Any]:
        """For copy.deepcopy and pickling: a copy keeps the patch, not the calls made (records hold timers)."""
        state = dict(self.__dict__)
        state["_latest"] = []
        state.pop("_generate_signature", None)
        return state

    # ----------------------------------------------------------------- per-call state
    @property
    def state(self) -> CallState:
        """The calling thread's call state."""
        return self._calls.get()

    @property
    def records(self) -> list[Record]:
        """The records of the calling thread's most recent call (a thread that made none: the most recent call of
        any thread). A call leaves them unbuilt (`LazyRecords`): they are built on the first read."""
        state = self.state
        return list(state.records if state.called else self._latest)  # built now, if they were not yet

    @records.setter
    def records(self, value: Sequence[Record]) -> None:
        state = self.state
        state.records, state.called = value, True
        self._latest = value  # one reference swap: readers see either list, whole

    def add_records(self, more: Sequence[Record]) -> None:
        """Append `more` to the calling thread's records, both left unbuilt (a stage adding its records during the
        forward must not build the encoder's: building them may read the device)."""
        state = self.state
        self.records = LazyRecords.chain([state.records if state.called else self._latest, more])

    # ----------------------------------------------------------------- the shared encode + shrink step
    def prepare(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Encode every visual input in `kwargs`, shrink the prompt, and return model kwargs for the stock code
        path with whether the prompt changed.

        Host-device syncs: at most one read before the encoder runs (`read_call_layout`: which row holds which
        image, for a batch of several rows; the sizes a family's crop grids follow; the prompt's words for a
        method that reads the question); after it, only where a layout's or method's definition makes a count
        depend on the data (LLaVA-NeXT's native newlines)."""
        kwargs = dict(kwargs)
        if kwargs.get("input_ids") is None:
            raise InputError(
                "a patched model needs `input_ids` (with the image placeholders) next to the images, to know where "
                "visual tokens go; inputs_embeds alone are not supported"
            )
        parts, changed, protected_parts, group_parts = [], False, {}, {}
        method = self.adapter.encoder_method
        tower = self.adapter.tower_stage
        present = self.adapter.present(kwargs)
        for modality in present:
            frames = self.adapter.videos_as_image_runs and "video" in method.modalities  # the adapter tells them apart
            if not frames:  # e.g. images given to a video method
                self.adapter.encoder.check_call_modality(modality.name, modality.pixel_key)
            if tower is not None:  # a tower method on images only: videos refused before anything runs
                tower.check_call_modality(modality.name, modality.pixel_key,
                                          self.adapter.tower_refusals.get(modality.name, ""))  # fmt: skip
        layout = self.read_call_layout(kwargs, present)
        state = self.state
        counts = layout.values.pop(PROMPT_LAYOUT, None)  # [B][6] the LLM prefill's counts of the caller's prompt
        state.host, state.tower = layout.values, {}
        try:
            kwargs = self.adapter.before_shrinking(kwargs)
            mm = hf.encoder_outputs(kwargs)
            for modality in present:
                pixel_values = kwargs.pop(modality.pixel_key)
                encoder_kwargs = {k: kwargs.pop(k) for k in modality.encoder_kwargs if k in kwargs}
                run_lengths = self.adapter.plan(modality, pixel_values, **encoder_kwargs)
                runs = layout.runs(self.adapter.placeholder_id(modality), run_lengths, modality.name)
                if tower is not None:  # before the prompt is shrunk and the tower runs: how many leave it (which)
                    state.tower[modality] = self.adapter.plan_tower(modality, pixel_values, **encoder_kwargs)
                if "question" in method.requires:
                    prompt = layout.values.get(PROMPT_IDS), layout.values.get(PROMPT_MASK)
                    state.questions = self.adapter.item_questions(
                        kwargs, runs, prompt if prompt[0] is not None else None
                    )
                shrink = functools.partial(
                    shrink_prompt,
                    kwargs["input_ids"],
                    self.adapter.placeholder_id(modality),
                    runs,
                    attention_mask=kwargs.get("attention_mask"),
                    position_ids=kwargs.get("position_ids"),
                    labels=kwargs.get("labels"),
                    pad_token_id=self.adapter.pad_token_id,
                    positions=self.adapter.positions,
                )
                # "How many" before the encoder, "which" after: with contiguous positions only the count matters to
                # the prompt, so for fixed-count methods it is shrunk while the accelerator is still idle.
                placed = self.adapter.encoder.placed  # selects among the packed tokens (DivPrune), after `encode`
                if placed:  # (after a tower stage, the packed tokens are known only after the tower)
                    planned = [None if tower else method.planned_count(n) for n in run_lengths]
                else:
                    planned = self.adapter.planned_counts(modality, run_lengths)
                early = None not in planned
                offsets = self.adapter.planned_offsets(modality, run_lengths, planned) if early else None
                early = offsets is not None  # (None: where they stay is known only after selecting)
                if early:
                    compressed = shrink(offsets)
                    kept_counts = offsets
                encoded = self.adapter.encode(modality, pixel_values, **encoder_kwargs)
                if placed:
                    encoded = self.adapter.select_placed(modality, encoded)
                if early:
                    produced = [len(f) for f in encoded.features]
                    if produced != planned:
                        raise RuntimeError(
                            f"{self.adapter.encoder_method.name} kept {produced} tokens, planned {planned}"
                        )
                else:
                    kept = encoded.keep_offsets
                    kept_counts = [len(f) for f in encoded.features] if kept is None else kept
                    compressed = shrink(kept_counts)
                plan = state.tower.get(modality)
                parts += [plan.records(), encoded.records] if plan is not None else [encoded.records]
                if encoded.protected is not None:
                    protected_parts[modality] = torch.cat(encoded.protected)
                if encoded.groups is not None:
                    group_parts[modality] = (encoded.groups, encoded.group_sizes, runs.rows)
                # a list where items differ in length: `join_ragged` joins them for the forward
                stack = modality.name in self.adapter.stacked_features and len({len(f) for f in encoded.features}) == 1
                features = torch.stack(encoded.features) if stack else encoded.features
                mm[modality.name] = self.adapter.encoder_output(encoded, features)
                if compressed.changed:
                    changed = True
                    if counts is not None and 0 in [k if isinstance(k, int) else len(k) for k in kept_counts]:
                        counts = None  # an item kept nothing: where a row's text starts moved (read in the prefill)
                    if counts is not None:  # the rows' real and visual tokens follow the shrink (host counts)
                        for row, n, k in zip(runs.rows, runs.lengths, kept_counts, strict=True):
                            k = k if isinstance(k, int) else len(k)
                            counts[row][0] += k - n
                            counts[row][1] += k - n
                    layout.padded = compressed.padded
                    kwargs["input_ids"] = compressed.input_ids
                    for key in ("attention_mask", "position_ids", "labels"):
                        value = getattr(compressed, key)
                        if value is not None or key in kwargs:
                            kwargs[key] = value
                    for key, fill in self.adapter.token_columns.items():
                        if kwargs.get(key) is not None:
                            kwargs[key] = gather_columns(kwargs[key], compressed.index, fill)
        finally:
            state.host, state.tower = {}, {}
        self.records = LazyRecords.chain(parts)
        state.protected = None
        if protected_parts:
            ids = kwargs["input_ids"]
            state.protected = torch.zeros_like(ids, dtype=torch.bool)
            for modality, flags in protected_parts.items():
                state.protected |= scatter_into_placeholders(ids == self.adapter.placeholder_id(modality), flags)
        state.groups = self._row_groups(kwargs["input_ids"], group_parts) if group_parts else None
        state.layout = None if counts is None else self._shrunk_layout(counts, kwargs["input_ids"].shape, layout)
        kwargs[hf.ENCODER_OUTPUTS] = mm
        return self.adapter.after_shrinking(kwargs), changed

    def read_call_layout(self, kwargs: dict[str, Any], present: list) -> HostLayout:
        """What the host must know of this call's device inputs, read in one read before the encoder runs (when
        the device queue is idle): for a batch of several rows, which row holds which image (only `input_ids` says);
        the inputs the family's geometry needs as integers (`Modality.host`, e.g. image sizes); the prompt's ids
        for a method that reads its question. A one-row call of a fixed-size family reads nothing."""
        values = {k: kwargs[k] for m in present for k in m.host if kwargs.get(k) is not None}
        method = self.adapter.encoder_method
        if self.adapter.reads_prompt or "question" in method.requires and getattr(method, "question", None) is None:
            values[PROMPT_IDS] = kwargs["input_ids"]
            if kwargs.get("attention_mask") is not None:
                values[PROMPT_MASK] = kwargs["attention_mask"]
        if self.adapter.llm is not None:  # the LLM prefill's counts, in the same read (none in the prefill)
            values[PROMPT_LAYOUT] = self._layout_counts(kwargs)
        ids = sorted({self.adapter.placeholder_id(m) for m in present})
        return read_layout(kwargs["input_ids"], kwargs.get("attention_mask"), ids, values)

    def _layout_counts(self, kwargs: dict[str, Any]) -> torch.Tensor:
        """[B, 6] the LLM prefill's `layout_counts` of the prompt in `kwargs`, on its device (not read here)."""
        return layout_counts(kwargs.get("attention_mask"), self._visual_of(kwargs["input_ids"]))

    @staticmethod
    def _shrunk_layout(counts: list[list[int]], shape: torch.Size, layout: HostLayout) -> tuple[Layout, tuple]:
        """(the LLM prefill's layout of the shrunk prompt of `shape` [B, L'], that shape) from the caller's
        prompt's counts with every row's real and visual tokens already following the shrink: text never moves; a
        row ends in padding where the batch is padded on the right and the row is shorter than the prompt."""
        width = shape[1]
        right = bool(layout.right_padded) if shape[0] > 1 else any(row[3] for row in counts)
        for row in counts:
            row[3] = int(right and row[0] < width) if shape[0] > 1 else row[3]
        return Layout.from_counts(counts), tuple(shape)

    def note_layout(self, kwargs: dict[str, Any]) -> None:
        """A call with an LLM stage that `prepare` does not see (no encoder-stage method): the prefill's layout of
        its prompt, read here, before anything of the call runs (the prefill then reads nothing); for a stage that
        follows frames, where they sit (`Adapter.frame_read`) in the same read."""
        state = self.state
        state.layout = state.frame_columns = None
        ids = kwargs.get("input_ids")
        if self.adapter.llm is None or ids is None or not self.adapter.present(kwargs):
            return
        counts = self._layout_counts(kwargs)
        extra = self.adapter.frame_read(ids, state.frames) if self.adapter.llm.follows_frames else None
        if extra is not None:
            counts = torch.cat([counts, extra.to(counts.device, counts.dtype)], 1)
        rows = counts.tolist()  # the call's one read, before its first kernel
        state.layout = Layout.from_counts([row[:LAYOUT_WIDTH] for row in rows]), tuple(ids.shape)
        if extra is not None:
            found = self.adapter.frame_columns([row[LAYOUT_WIDTH:] for row in rows], state.frames)
            state.frame_columns = found, tuple(ids.shape)

    def frame_columns_for(self, shape: tuple[int, int]) -> Columns | None:
        """Per row of an LLM input of `shape` [B, L] (rows repeated for beams / return sequences), per video, the
        (start, end) columns of its frames, from the call's read (`note_layout`); None where this call's prompt was
        not seen or holds no frames that match its videos (the prefill finds them then)."""
        found = self.state.frame_columns
        times = _repeats(found, shape)
        if times is None or found[0] is None:
            return None
        return [row for row in found[0] for _ in range(times)]

    def layout_for(self, shape: tuple[int, int]) -> Layout | None:
        """The LLM prefill's layout of an input of `shape` [B, L] (rows repeated for beams / return sequences), from
        the call's host counts; None where this call's prompt was not seen (the prefill reads it then)."""
        found = self.state.layout
        times = _repeats(found, shape)
        if times is None:
            return None
        layout = found[0]

        def each(values: list[int]) -> list[int]:
            return [v for v in values for _ in range(times)]

        return Layout(each(layout.lengths), each(layout.visual), each(layout.text), layout.right, each(layout.runs),
                      each(layout.after))  # fmt: skip

    # ----------------------------------------------------------------- what the LLM stages read
    def _note_visual(self, kwargs: dict[str, Any]) -> None:
        """Remember this forward's `input_ids` and which of them are visual, for the LLM and sparse stages."""
        ids = kwargs.get("input_ids")
        state = self.state
        state.ids = ids
        if self.adapter.llm is None or ids is None:
            state.visual = None
            return
        state.visual = self._visual_of(ids)

    def _visual_of(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] bool: the placeholders of every modality in `ids` [B, L] (made once per ids tensor in a call: the
        layout's read and the LLM stages read the same)."""
        state = self.state
        made = state.visual_of
        if made is not None and made[0] is ids:
            return made[1]
        visual = None
        for modality in self.adapter.modalities:
            found = ids == self.adapter.placeholder_id(modality)
            visual = found if visual is None else visual | found
        visual = torch.zeros_like(ids, dtype=torch.bool) if visual is None else visual
        state.visual_of = ids, visual
        return visual

    def _note_frames(self, kwargs: dict[str, Any]) -> None:
        """The call's videos' frames, from the caller's inputs, for a stage that follows frames (sparse "grid", an
        LLM stage's call points)."""
        sparse, llm = self.adapter.sparse, self.adapter.llm
        follows = (sparse is not None and sparse.follows_frames) or (llm is not None and llm.follows_frames)
        self.state.frames = self.adapter.video_frames(kwargs) if follows else None

    def visual_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """[B, L] visual tokens of the LLM input of this shape (None if the forward's input_ids were not seen)."""
        return self.state.visual if self.state.visual is not None and tuple(self.state.visual.shape) == shape else None

    def protected_mask_for(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """[B, L] tokens an encoder stage protected (rows repeated for beams / return sequences), or None."""
        protected = self.state.protected
        if protected is None or protected.shape[1] != shape[1] or shape[0] % protected.shape[0]:
            return None
        return protected.repeat_interleave(shape[0] // protected.shape[0], dim=0)

    def _row_groups(self, ids: torch.Tensor, parts: dict) -> tuple[torch.Tensor, list[list[int]]]:
        """([B, L] each placeholder's group, numbered per row in the order of the row's items, -1 elsewhere; per row
        its groups' sizes, host) from every modality's (per item groups, per item sizes, the row of each item)."""
        groups = torch.full_like(ids, -1)
        sizes: list[list[int]] = [[] for _ in range(ids.shape[0])]
        for modality, (per_item, item_sizes, rows) in parts.items():
            offsets = []
            for row, own in zip(rows, item_sizes, strict=True):  # an item's groups follow the row's earlier items'
                offsets.append(len(sizes[row]))
                sizes[row] += own
            lengths = [len(g) for g in per_item]
            shift = repeated(offsets, lengths, ids.device)
            values = torch.cat(per_item).to(ids.device)
            values = torch.where(values >= 0, values + shift, -1)
            placed = ids == self.adapter.placeholder_id(modality)
            ordinal = (placed.flatten().long().cumsum(0) - 1).clamp(0, max(len(values) - 1, 0))
            groups = torch.where(placed, values[ordinal].view_as(ids), groups)
        return groups, sizes

    def groups_for(self, shape: tuple[int, int]) -> tuple[torch.Tensor, list[list[int]]] | None:
        """([B, L] each placeholder's group from an encoder stage, per row the groups' sizes) for an LLM input of
        this shape (rows repeated for beams / return sequences), or None."""
        found = self.state.groups
        if found is None:
            return None
        groups, sizes = found
        if groups.shape[1] != shape[1] or shape[0] % groups.shape[0]:
            return None
        times = shape[0] // groups.shape[0]
        return groups.repeat_interleave(times, dim=0), [row for row in sizes for _ in range(times)]

    @eager
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if args:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            kwargs = {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}
        state = self.state
        if state.in_generate:  # generate already works on the shrunk prompt
            self._note_visual(kwargs)
            return None
        state.labels = None
        self._note_frames(kwargs)
        if self.adapter.llm is not None:
            self._refuse_static_cache(None, hf.cache_in(kwargs))
        kwargs = self._forward_kwargs(kwargs)
        if self.adapter.llm is not None and kwargs.get("labels") is not None:
            # applied to the kept columns in `post_forward` (with the Trainer's token count, if given)
            state.labels = kwargs.pop("labels"), kwargs.get("num_items_in_batch")
        self._note_visual(kwargs)
        return (), kwargs

    @eager
    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Leave the map of a pruned prompt on the cache the forward returns; with an LLM stage, the loss of a
        forward given labels: the model's own loss function over the sequence the last decoder layers ran on (the
        kept columns; a dropped column takes its label with it)."""
        state = self.state
        filled, state.filled = state.filled, None
        if filled is not None and not state.in_generate:
            cache = hf.cache_out(output)
            remember_prompt(cache, filled)
        given, state.labels = state.labels, None
        if given is None or state.in_generate:
            return None
        labels, num_items = given
        columns = self.adapter.llm.final_columns()
        if columns is not None:
            labels = gather_columns(labels, columns, -100)
        logits = output["logits"] if isinstance(output, dict) else output[0]
        extra = {} if num_items is None else {"num_items_in_batch": num_items}
        loss = self.adapter.model.loss_function(
            logits=logits, labels=labels.to(logits.device), vocab_size=logits.shape[-1], **extra
        )
        if isinstance(output, dict):
            return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
        return (loss, *output)

    def join_ragged(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """A modality whose forward wants one [items, tokens, D] tensor, when its items kept different numbers of
        tokens (VidCom2's videos): `prepare` hands generate a list (its beam expansion splits lists by placeholder
        counts), and the forward gets all items as one [1, total, D] item, which fills the placeholders alike."""
        outputs = kwargs.get(hf.ENCODER_OUTPUTS) or {}
        joined = {}
        for name in self.adapter.stacked_features:
            out = outputs.get(name)
            if out is not None and isinstance(out.pooler_output, list):
                joined[name] = type(out)(**{**out, "pooler_output": torch.cat(out.pooler_output)[None]})
        return (args, dict(kwargs, **{hf.ENCODER_OUTPUTS: {**outputs, **joined}})) if joined else None

    def _refuse_static_cache(self, implementation: str | None, cache: Any) -> None:
        """LLM stages give each layer's cache its own length: only a DynamicCache can hold that."""
        if implementation in hf.static_cache_implementations() or (
            cache is not None and not isinstance(cache, DynamicCache)
        ):
            got = f"cache_implementation={implementation!r}" if cache is None else type(cache).__name__
            raise InputError(
                f"{self.adapter.llm_method.name} acts inside the LLM on per-layer caches (of different lengths after a "
                f"drop; read whole at every step by a decode-time selection), which needs a DynamicCache (the "
                f"default); got {got}. A static cache works with encoder-stage methods only"
            )

    def _forward_kwargs(self, kwargs: dict) -> dict:
        """What the stock forward of a plain `model(...)` call gets: the shrunk prompt and pre-encoded features,
        new tokens on a cache mapped onto what the cache holds, or the call unchanged."""
        state = self.state
        state.filled = state.layout = state.visual_of = state.frame_columns = None
        cache = hf.cache_in(kwargs)
        past = cached_length(cache)
        if past:  # decoding steps and later turns keep the records of the call that filled the cache
            return self.conversation.continue_forward(kwargs, cache, past)
        forget(cache)
        if not self.adapter.present(kwargs) or self.adapter.encoder_method is None:  # no images, or LLM stages only
            self.records, state.protected, state.groups = [], None, None
            self.note_layout(kwargs)
            return kwargs
        caller_ids, caller_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        kwargs, _ = self.prepare(kwargs)
        state.filled = self.conversation.cached_prompt(
            caller_ids, caller_mask, kwargs
        )  # left on the cache after the forward
        return kwargs

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if "_generate_signature" not in self.__dict__:
            self._generate_signature = inspect.signature(self.adapter.stock_generate)
        bound = self._generate_signature.bind_partial(*args, **kwargs).arguments
        kwargs = {**{k: v for k, v in bound.items() if k != "kwargs"}, **bound.get("kwargs", {})}
        if isinstance(kwargs.get("inputs"), torch.Tensor) and kwargs.get("input_ids") is None:
            kwargs["input_ids"] = kwargs.pop("inputs")
        self._refuse_assisted(kwargs)
        self._note_frames(kwargs)
        if self.adapter.llm is not None:
            kwargs = self._llm_generate_kwargs(kwargs)
        state = self.state
        state.layout = state.visual_of = state.frame_columns = None
        cache = hf.cache_in(kwargs)
        past = cached_length(cache)
        if not past:
            forget(cache)
        caller_ids, caller_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        continuing = past and caller_ids is not None
        prunes = continuing or (self.adapter.present(kwargs) and self.adapter.encoder_method is not None)
        max_length = self._max_length(kwargs) if prunes else None
        if max_length is not None and caller_ids.shape[1] >= max_length:
            raise InputError(  # the stock check, with the caller's lengths (not the shrunk prompt's)
                f"Input length of input_ids is {caller_ids.shape[1]}, but `max_length` is set to {max_length}. "
                "This can lead to unexpected behavior. You should consider increasing `max_length` or, better yet, "
                "setting `max_new_tokens`."
            )
        changed = False
        if continuing:
            kwargs, changed = self.conversation.continue_generate(kwargs, cache, past)
            if self.adapter.llm is not None:  # a decode-time selection starts afresh at every generate call
                self.add_records(self.adapter.llm.new_call(cache))
        elif prunes:
            kwargs, changed = self.prepare(kwargs)
        else:
            self.records, state.protected, state.groups = [], None, None
            self.note_layout(kwargs)
        if changed:
            if max_length is not None:  # max_length counts the caller's prompt
                kwargs["max_length"] = max_length - (caller_ids.shape[1] - kwargs["input_ids"].shape[1])
            if kwargs.get("streamer") is not None:  # the streamer sees the caller's prompt, as the result does
                kwargs["streamer"] = CallersPrompt(kwargs["streamer"], caller_ids)
        if kwargs.get("attention_mask") is None:  # generate infers one from pad tokens: the prefill reads it then
            state.layout = None
        state.in_generate = True
        try:
            out = self.adapter.stock_generate(**kwargs)
        finally:
            state.in_generate = state.beams = False
        filled = cache if cache is not None else hf.cache_out(out)
        if filled is not None and caller_ids is not None and kwargs.get("input_ids") is not None:
            remember_prompt(filled, self.conversation.cached_prompt(caller_ids, caller_mask, kwargs))
        return _restore_prompt(out, caller_ids, kwargs["input_ids"].shape[1]) if changed else out

    def _refuse_assisted(self, kwargs: dict[str, Any]) -> None:
        """Assisted decoding (an assistant model, prompt lookup) verifies several tokens per forward, its first
        forward runs the prompt and the first candidates together, and it crops the cache where candidates are
        rejected; refused at the start of the call where that cannot give plain decoding's tokens."""
        config = kwargs.get("generation_config") or self.adapter.model.generation_config
        used = [name for name in ASSISTED if kwargs.get(name, getattr(config, name, None)) is not None]
        if not used:
            return
        named = ", ".join(f"{name}=" for name in used)
        inside = [m.name for m in self.adapter.methods if set(m.stages) & {"prefill", "decode", "sparse"}]
        if inside:
            raise InputError(
                f"assisted decoding ({named}) is not supported with {', '.join(inside)}, which acts inside the LLM: "
                "assisted decoding runs the prompt together with the first candidate tokens and crops the cache where "
                "candidates are rejected, so the prefill would see other tokens than plain decoding and the per-layer "
                "caches would be cut wrongly. Generate without it, or use an encoder-stage method"
            )
        past = cached_length(hf.cache_in(kwargs))
        if past:
            raise InputError(
                f"assisted decoding ({named}) does not continue from a cache ({hf.CACHE_KWARG}, {past} tokens here): "
                "its first step runs the whole input_ids again on top of the cache, so it gives other tokens than "
                "plain decoding (transformers does so without vtoken too). Generate this turn without it, or pass "
                f"the whole conversation without {hf.CACHE_KWARG}"
            )
        if kwargs.get("prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None)) is not None:
            present = self.adapter.present(kwargs)
            if present:
                raise InputError(
                    f"assisted decoding by prompt lookup (prompt_lookup_num_tokens=) proposes tokens copied from the "
                    f"prompt, here {present[0].name} placeholders, which the model then cannot match with "
                    f"{present[0].name} features (transformers fails the same way without vtoken); generate without "
                    "it, or use assistant_model="
                )

    def _max_length(self, kwargs: dict[str, Any]) -> int | None:
        """The `max_length` set for this call (by it, its generation config or the model's), which stock generate
        counts the caller's prompt in; None when `max_new_tokens` is set or none is (20 new tokens by default)."""
        config = kwargs.get("generation_config") or self.adapter.model.generation_config
        if kwargs.get("max_new_tokens", config.max_new_tokens) is not None:
            return None
        length = kwargs.get("max_length", config.max_length)
        return length if length is not None else self.adapter.model.generation_config.max_length

    def _llm_generate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """generate kwargs with an LLM stage: static caches refused at the start; `use_cache=False` runs with the
        cache. The LLM stages decide once, from the prompt, and the decode stage is defined on the per-layer cache,
        so the cached run is what the call means (re-running the pruned prompt at every step would re-decide)."""
        config = kwargs.get("generation_config") or self.adapter.model.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        self._refuse_static_cache(implementation, hf.cache_in(kwargs))
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            kwargs = dict(kwargs, use_cache=True)
        self.state.beams = (kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1) > 1
        return kwargs


class CallersPrompt:
    """A streamer (transformers' `put`/`end` protocol) standing in for the caller's: generate's first `put` (the
    prompt, shrunk) hands on the caller's own prompt [B, L] instead; every later `put` and `end` pass through."""

    def __init__(self, streamer: Any, prompt: torch.Tensor):
        self.streamer = streamer
        self._prompt = prompt.cpu()

    def put(self, value: torch.Tensor) -> None:
        if self._prompt is not None:
            value, self._prompt = self._prompt, None
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def _restore_prompt(out: Any, original_ids: torch.Tensor, shrunk_length: int) -> Any:
    """Put the caller's own prompt back in front of the generated tokens."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    repeats = sequences.shape[0] // original_ids.shape[0]
    prompt = original_ids.to(sequences.device).repeat_interleave(repeats, dim=0)
    full = torch.cat([prompt, sequences[:, shrunk_length:]], dim=1)
    if isinstance(out, torch.Tensor):
        return full
    out.sequences = full
    return out


def _repeats(found: tuple[Any, tuple[int, int]] | None, shape: tuple[int, int]) -> int | None:
    """How many times each row of what the call read (`found`: it and the prompt's [B, L]) repeats in an LLM input of
    `shape` [B', L] (beams / return sequences); None where nothing was read or it was another prompt."""
    if found is None:
        return None
    batch, length = found[1]
    if length != shape[1] or not batch or shape[0] % batch:
        return None
    return shape[0] // batch
