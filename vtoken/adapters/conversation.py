"""What a cache filled by a patched model holds, kept on the cache itself, so a later call continues from it.

A pruned call leaves a cache holding a *shorter* sequence than the caller's: the prompt lost visual tokens (an
encoder stage), and after an LLM stage some layers hold fewer tokens than others. A chat client then calls again
with the whole conversation's ids (`generate`) or only the new tokens (`model(...)`), a mask over the caller's
columns, and that cache. To continue exactly as decoding would have continued, the next call needs the map from
the caller's columns to the cache's, and the LLM stages need each layer's view of its cache. Both travel with
the cache object (an attribute, so a `copy.deepcopy` of the cache, the usual way to branch a conversation, keeps
them), never with the model: two conversations on one model never mix.

`CachedPrompt` is the map: the caller's prompt of the call that filled the cache (`caller_ids`, P columns) stands
for `ids` (P' columns) in the cache; every later column follows one to one (generated tokens, later turns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vtoken.errors import InputError

from . import hf

_PROMPT = "_vtoken_prompt"
_VIEWS = "_vtoken_views"
_SELECTION = "_vtoken_selection"


@dataclass
class CachedPrompt:
    """The caller's prompt of the call that filled a cache, and what the cache holds for it.

    caller_ids / caller_mask: [B, P] the prompt as the caller passed it (mask None: no padding).
    ids / mask: [B, P'] that prompt as the LLM received it (shrunk; mask None: no padding).
    columns: per-token inputs (`mm_token_type_ids`, `token_type_ids`) of the shrunk prompt, [B, P'] each.
    offset: [B] what decoding adds to a new token's position counted over real tokens (0 for 1-D RoPE; the M-RoPE
    rope delta on Qwen families), or None for 0. changed: the cache's columns differ from the caller's.
    """

    caller_ids: torch.Tensor
    caller_mask: torch.Tensor | None
    ids: torch.Tensor
    mask: torch.Tensor | None
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    offset: torch.Tensor | None = None
    changed: bool = True

    @property
    def removed(self) -> int:
        """Columns the cache holds fewer than the caller's sequence (P - P')."""
        return self.caller_ids.shape[1] - self.ids.shape[1]

    def lost(self) -> torch.Tensor:
        """[B] real tokens each row lost (the caller's real prompt tokens minus the cache's)."""
        return _real(self.caller_mask, self.caller_ids) - _real(self.mask, self.ids)

    def rows(self, batch: int) -> CachedPrompt:
        """The map for a batch of `batch` rows: rows repeated when the cache was expanded (beams, return
        sequences); raises ValueError when `batch` is not a multiple of the rows."""
        have = self.caller_ids.shape[0]
        if batch == have:
            return self
        if batch % have:
            raise ValueError(f"the cache was filled by a call with {have} rows; this one has {batch}")
        times = batch // have

        def rep(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.repeat_interleave(times, dim=0)

        return CachedPrompt(rep(self.caller_ids), rep(self.caller_mask), rep(self.ids), rep(self.mask),
                            {k: rep(v) for k, v in self.columns.items()}, rep(self.offset), self.changed)  # fmt: skip


def _real(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return torch.full((ids.shape[0],), ids.shape[1], device=ids.device) if mask is None else mask.long().sum(1)


def cached_length(cache: Any) -> int:
    """Tokens a cache holds (0 for None or an empty cache)."""
    return 0 if cache is None else int(cache.get_seq_length())


def prompt_of(cache: Any) -> CachedPrompt | None:
    """The map a patched call left on `cache`, or None (a cache no pruned call filled)."""
    return getattr(cache, _PROMPT, None)


def remember_prompt(cache: Any, prompt: CachedPrompt | None) -> None:
    """Leave `prompt` on `cache` (None: the cache holds the caller's columns one to one)."""
    if cache is not None:
        setattr(cache, _PROMPT, prompt)


def views_of(cache: Any) -> tuple[list, int] | None:
    """(per-layer views, prompt length) an LLM stage left on `cache`, or None."""
    return getattr(cache, _VIEWS, None)


def remember_views(cache: Any, views: tuple[list, int] | None) -> None:
    if cache is not None:
        setattr(cache, _VIEWS, views)


def selection_of(cache: Any) -> Any:
    """The decode-time selection state (`llm.DecodeSelection`) an LLM stage left on `cache`, or None."""
    return getattr(cache, _SELECTION, None)


def remember_selection(cache: Any, selection: Any) -> None:
    if cache is not None:
        setattr(cache, _SELECTION, selection)


def forget(cache: Any) -> None:
    """A cache that starts a new sequence (empty) holds nothing of an earlier call."""
    if cache is not None:
        for name in (_PROMPT, _VIEWS, _SELECTION):
            if name in getattr(cache, "__dict__", {}):
                delattr(cache, name)


class Conversation:
    """The continuation half of a model's calls (`CallPath` holds one): a call whose cache already holds tokens.

    `generate` gets the whole conversation's ids; `model(...)` only the tokens the cache lacks, with a mask over the
    caller's columns. Either way the cached part is mapped onto what the cache holds (`CachedPrompt`), visual
    inputs of the new tokens alone are encoded and pruned (their placeholders are counted in the new tokens only),
    and the new tokens get the positions decoding would have given them (the family's `continued_positions`).
    """

    def __init__(self, calls):
        self.calls = calls
        self.adapter = calls.adapter

    def notes(self, cache: Any, batch: int) -> CachedPrompt | None:
        notes = prompt_of(cache)
        if notes is None:
            return None
        try:
            return notes.rows(batch)
        except ValueError as error:
            raise InputError(f"{hf.CACHE_KWARG}: {error}; continue each conversation with its own cache") from None

    def refuse_visual_on_cache(self, kwargs: dict[str, Any], past: int) -> None:
        """LLM stages prune during a prefill from an empty cache; new visual inputs on a cache are refused."""
        present = self.adapter.present(kwargs)
        if self.adapter.llm is None or not present:
            return
        raise InputError(
            f"{self.adapter.llm_method.name} prunes visual tokens inside the LLM during a prefill from an empty cache; "
            f"this call brings new {present[0].name}s on top of a cache holding {past} tokens, which it cannot "
            f"prune there. Pass the whole conversation without {hf.CACHE_KWARG} (it is pruned afresh), continue with "
            "text only, or use an encoder-stage method, which prunes a later turn's images too"
        )

    def continue_generate(self, kwargs: dict[str, Any], cache: Any, past: int) -> tuple[dict[str, Any], bool]:
        """generate kwargs for a call continuing from `cache` (holding `past` tokens): the caller's ids [B, T] of the
        whole conversation become what the cache holds plus the new tokens (their images pruned), with a mask
        and positions over those. Returns (kwargs, whether the ids changed)."""
        ids = kwargs["input_ids"]
        batch, width = ids.shape
        notes = self.notes(cache, batch)
        held, stands_for = (0, 0) if notes is None else (notes.ids.shape[1], notes.caller_ids.shape[1])
        if notes is not None and past < held:
            raise InputError(
                f"the cache ({hf.CACHE_KWARG}) holds {past} tokens, fewer than the {held} of the pruned prompt it was "
                "filled with (cropped inside the prompt?); continue from the whole cache, or start again without one"
            )
        cut = stands_for + past - held  # the caller's column of the first token the cache lacks
        if width <= cut:
            raise InputError(
                f"input_ids hold {width} columns, but the cache ({hf.CACHE_KWARG}) already holds {cut} of this "
                "conversation (counted as you count them); generate() takes the whole conversation: the earlier "
                "turns, as returned, followed by the new tokens"
            )
        if notes is not None and not torch.equal(ids[:, :stands_for], notes.caller_ids.to(ids.device)):
            raise InputError(
                f"input_ids[:, :{stands_for}] differ from the prompt the cache ({hf.CACHE_KWARG}) was filled with; "
                f"pass that conversation followed by the new tokens, or no {hf.CACHE_KWARG}"
            )
        self.refuse_visual_on_cache(kwargs, past)
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        tail = dict(kwargs, input_ids=ids[:, cut:], attention_mask=mask[:, cut:])
        given = kwargs.get("position_ids")
        if given is not None:
            tail["position_ids"] = given[..., cut:]
        prefix = {"input_ids": ids[:, :cut], "attention_mask": mask[:, :cut]}
        for key in self.adapter.token_columns:
            if kwargs.get(key) is not None:
                tail[key] = kwargs[key][:, cut:]
                prefix[key] = kwargs[key][:, :cut]
        if notes is not None:  # the cached prompt as the cache holds it, then the tokens since, one to one
            ones = torch.ones_like(notes.ids)
            held_prompt = {"input_ids": notes.ids, "attention_mask": ones if notes.mask is None else notes.mask}
            held_prompt.update(notes.columns)
            for key in list(prefix):
                start = held_prompt.get(key)
                if start is None:
                    start = torch.full_like(notes.ids, self.adapter.token_columns.get(key, 0))
                prefix[key] = torch.cat([start.to(prefix[key]), prefix[key][:, stands_for:]], dim=1)
        changed = notes is not None and notes.changed
        if self.adapter.present(tail) and self.adapter.encoder_method is not None:
            tail, shrunk = self.calls.prepare(tail)
            changed = changed or shrunk
        else:
            self.calls.records, self.calls.state.protected, self.calls.state.groups = [], None, None
        glued = dict(tail)
        for key, start in prefix.items():
            end = tail.get(key)
            if end is None:
                end = torch.full_like(
                    tail["input_ids"], 1 if key == "attention_mask" else self.adapter.token_columns[key]
                )
            glued[key] = torch.cat([start, end.to(start)], dim=1)
        glued["position_ids"] = self.placed(glued["attention_mask"], past, tail, given, notes)
        return glued, changed

    def continue_forward(self, kwargs: dict[str, Any], cache: Any, past: int) -> dict[str, Any]:
        """model(...) kwargs for new tokens on `cache`: the caller's mask [B, T] (T = the conversation as the caller
        counts it plus the new tokens) mapped onto the cache's columns, new images pruned, positions placed."""
        new = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if new is None:
            return kwargs
        batch, steps = new.shape[:2]
        notes = self.notes(cache, batch)
        pixels = bool(self.adapter.present(kwargs))
        if not pixels and (notes is None or not notes.changed):  # the cache holds the caller's columns: as stock
            return kwargs
        self.refuse_visual_on_cache(kwargs, past)
        held, stands_for = (0, 0) if notes is None else (notes.ids.shape[1], notes.caller_ids.shape[1])
        callers_past = stands_for + past - held
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise InputError(
                f"a call continuing from the cache of a pruned call needs the usual 2-D attention_mask (or none); "
                f"got {mask.dim()}-D"
            )
        if mask is not None and mask.shape[1] not in (callers_past + steps, past + steps):
            raise InputError(
                f"a call continuing from the cache of a pruned call needs a 2-D attention_mask covering the "
                f"conversation so far and the new tokens: {callers_past + steps} columns as you count them (or "
                f"{past + steps} as the cache holds them); got {tuple(mask.shape)}"
            )
        if mask is None:  # no padding since the cached prompt: its mask, then ones
            prefix_mask = torch.ones(batch, past, dtype=torch.long, device=new.device)
            if notes is not None and notes.mask is not None:
                prefix_mask[:, :held] = notes.mask.to(prefix_mask)
            tail_mask = None
        elif mask.shape[1] == past + steps:
            prefix_mask, tail_mask = mask[:, :past], mask[:, past:]
        else:
            prefix_mask, tail_mask = mask[:, :callers_past], mask[:, callers_past:]
            if notes is not None:
                start = torch.ones_like(notes.ids) if notes.mask is None else notes.mask
                prefix_mask = torch.cat([start.to(mask), prefix_mask[:, stands_for:]], dim=1)
        tail = dict(kwargs, attention_mask=tail_mask)
        given = kwargs.get("position_ids")
        if pixels and self.adapter.encoder_method is not None:
            tail, _ = self.calls.prepare(tail)
        tail_mask = tail.get("attention_mask")
        if tail_mask is None:
            tail_mask = torch.ones(batch, tail["input_ids"].shape[1], dtype=prefix_mask.dtype, device=new.device)
        full = torch.cat([prefix_mask.to(tail_mask), tail_mask], dim=1)
        positions = self.placed(full, past, tail, given, notes)
        out = dict(tail, position_ids=positions[..., past:])
        if mask is not None or bool((full == 0).any()):
            out["attention_mask"] = full
        return out

    def placed(self, mask: torch.Tensor, past: int, tail: dict[str, Any], given: Any, notes: CachedPrompt | None):
        """Positions [..., B, past + n] of a continuation (mask [B, past + n] over what the cache holds and the new
        tokens): the caller's own for the new tokens where given (renumbered ones moved back by the tokens the
        cache lost), else those decoding gives (`continued_positions`)."""
        offset = notes.offset if notes is not None else None
        positions = self.adapter.continued_positions(
            mask, past, tail.get("position_ids") if given is None else None, offset
        )
        if given is None:
            return positions
        mine = tail["position_ids"]  # the caller's, of the new tokens (gathered if their images were pruned)
        if self.adapter.positions == "renumber" and notes is not None:
            mine = mine - notes.lost().to(mine.device).view(*[1] * (mine.dim() - 2), -1, 1)
        return torch.cat([positions[..., :past].to(mine), mine], dim=-1)

    def cached_prompt(self, caller_ids, caller_mask, kwargs: dict[str, Any]) -> CachedPrompt:
        """The map a call leaves on its cache: the caller's prompt and what the LLM received for it."""
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        # the same tensors when nothing was shrunk (compared by identity first: no read of the device)
        changed = ids is not caller_ids and (ids.shape != caller_ids.shape or not torch.equal(ids, caller_ids))
        changed = changed or ((mask is None) != (caller_mask is None)) or (
            mask is not None and mask is not caller_mask and not torch.equal(mask, caller_mask))  # fmt: skip
        columns = {key: kwargs[key] for key in self.adapter.token_columns if kwargs.get(key) is not None}
        return CachedPrompt(caller_ids, caller_mask, ids, mask, columns, self.adapter.position_offset(kwargs), changed)
