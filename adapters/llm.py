"""The LLM-side stages: dropping visual tokens between decoder layers (prefill) and per-layer KV caches (decode).

Works on the decoder stack every supported family shares in transformers 5.x (`language_model.layers`, each layer
called with `attention_mask`, `position_embeddings` and `position_ids` as keywords, a `DynamicCache` with one
layer cache each), through hooks on one model instance:
- after a drop layer K, a forward hook computes layer K's attention from the method's query rows only (from the
  q/k projections it hooked, rotary applied, while the layer itself ran SDPA/flash), asks the method which visual
  tokens go on, and hands the next layer the shorter hidden states;
- a forward pre-hook on every later layer swaps in the matching mask, positions and rotary embeddings;
- after the prefill, the method's decode policy may cut layer caches to the tokens that survived every drop;
- during decoding, each layer whose cache differs from the prompt gets its own mask and positions;
- a decode-time selection (DyCoke): at every one-token decoding step, a forward hook after layer `L - 1` computes
  the new token's attention row over the cache from its query (the layer itself runs SDPA/flash), asks the method
  which visual tokens this step keeps, and hands layers `L` and later a mask without the others (the cache is
  never shrunk). Its state (the previous step's row) travels with the cache, reset at every new prompt.
Every layer's cache is described by a `LayerView`: which prompt columns it holds, in which positions.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vtoken.kernels import causal_rows_probs

from vtoken.errors import InputError, VTokenError
from vtoken.methods.base import PrefillMethod
from vtoken.records import Record
from vtoken.timing import Stopwatch
from vtoken.tokens import LayerTokens, Merged, TextTokens

from . import hf
from .compiled import eager
from .conversation import remember_selection, remember_views, selection_of, views_of
from .frames import placeholder_runs
from .state import PerThread


@dataclass
class LayerView:
    """The sequence one group of decoder layers holds, relative to the L-column prompt the LLM received.

    column: [B, C] prompt column of each slot (-1 = padding slot); mask: [B, C] 1 for real tokens;
    positions: [B, C] position of each slot (prefill numbering); visual: [B, C] bool, visual tokens;
    protected: [B, C] bool, visual tokens no drop may remove, or None; lost: [B] tokens dropped before this view
    (new tokens of a renumbered view sit `lost` positions earlier than in the prompt's own numbering);
    merged: [B, C] bool, tokens a method added (they hold the column of a token dropped where they were made), or
    None.
    """

    column: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    visual: torch.Tensor
    protected: torch.Tensor | None
    lost: torch.Tensor
    merged: torch.Tensor | None = None

    def gather(self, slots: torch.Tensor, renumber: bool) -> LayerView:
        """The view of slots [B, C'] of this one (-1 = padding)."""

        def take(x: torch.Tensor | None, fill) -> torch.Tensor | None:
            if x is None:
                return None
            return x.gather(1, slots.clamp(min=0)).masked_fill(slots < 0, fill)

        mask = take(self.mask, 0)
        positions = take(self.positions, 0)
        if renumber:  # contiguous from each row's first real position
            start = self.positions.gather(1, (self.mask != 0).long().argmax(1, keepdim=True))
            positions = (start + mask.long().cumsum(1) - 1).clamp(min=0).masked_fill(mask == 0, 0)
        lost = self.lost + self.mask.long().sum(1) - mask.long().sum(1)
        return LayerView(take(self.column, -1), mask, positions, take(self.visual, False),
                         take(self.protected, False), lost, take(self.merged, False))  # fmt: skip

    def slots_of(self, other: LayerView) -> torch.Tensor:
        """[B, C'] slots of this view holding the columns of `other` (a subset of this view's columns)."""
        return self.slots_of_columns(other.column)

    def slots_of_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """[B, R] slots of this view holding prompt columns `columns` [B, R] (-1: padding, and not held)."""
        width = int(max(self.column.max(), columns.max())) + 2
        lookup = torch.full((self.column.shape[0], width), -1, dtype=torch.long, device=self.column.device)
        slots = torch.arange(self.column.shape[1], device=self.column.device).expand_as(self.column)
        lookup.scatter_(1, self.column.clamp(min=-1) + 1, slots)
        found = lookup.gather(1, columns.clamp(min=-1) + 1)
        return found.masked_fill(columns < 0, -1)


def _left_packed(keep: torch.Tensor, right: bool = False, order: torch.Tensor | None = None) -> torch.Tensor:
    """[B, C] bool -> [B, C'] indices of the kept slots of each row, left-padded with -1 (C' = most kept), or
    right-padded with `right`; kept slots in ascending slot order, or ascending `order` [B, C] (ties: by slot)."""
    counts = keep.sum(1)
    width = int(counts.max()) if keep.shape[0] else 0
    if order is None:
        order = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    key = order.masked_fill(~keep, int(order.max()) + 1 if order.numel() else 0)
    order = torch.sort(key, dim=1, stable=True).indices[:, :width]  # kept slots first, in order
    rank = torch.arange(width, device=keep.device)
    if right:
        return order.masked_fill(rank >= counts[:, None], -1)
    shift = (width - counts)[:, None]
    slots = torch.full_like(order, -1)
    valid = rank < counts[:, None]
    rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(order)
    slots[rows[valid], (rank + shift).expand_as(order)[valid]] = order[valid]
    return slots


def _text_after_image(view: LayerView) -> torch.Tensor:
    """[B, C] bool: real, non-visual slots after each row's first visual slot."""
    return (view.mask != 0) & ~view.visual & (view.visual.long().cumsum(1) > 0)


def _with_merged(
    view: LayerView, hidden: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor, merged: Merged
) -> tuple[LayerView, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`view`, `hidden` [B, C, D] and `keep` [B, C] extended by M slots holding the merged tokens, and the order
    [B, C + M] that puts them right after each row's last visual slot. A merged token takes its anchor's prompt
    column (a token dropped here), so columns stay unique in every view."""
    batch, width = keep.shape
    count = merged.valid.shape[1]
    real = merged.valid
    anchors = slots.gather(1, merged.anchors.clamp(min=0))  # [B, M] slots of the anchors
    column = view.column.gather(1, anchors).masked_fill(~real, -1)
    extended = LayerView(
        torch.cat([view.column, column], 1),
        torch.cat([view.mask, real.to(view.mask.dtype)], 1),
        torch.cat([view.positions, view.positions.gather(1, anchors).masked_fill(~real, 0)], 1),
        torch.cat([view.visual, real], 1),
        None if view.protected is None else torch.cat([view.protected, torch.zeros_like(real)], 1),
        view.lost - real.long().sum(1),  # merged tokens come back: later positions move less far
        torch.cat([view.merged if view.merged is not None else torch.zeros_like(keep), real], 1),
    )
    features = merged.features.to(hidden.dtype).masked_fill(~real[:, :, None], 0.0)
    slot = torch.arange(width, device=keep.device).expand(batch, -1)
    last_visual = slot.masked_fill(~view.visual, -1).amax(1, keepdim=True)  # [B, 1]
    order = torch.cat([slot * (count + 1), last_visual * (count + 1) + 1 + torch.arange(count, device=keep.device)], 1)
    return extended, torch.cat([hidden, features], 1), torch.cat([keep, real], 1), order


class QueryKeyProbe:
    """Captures one attention layer's queries and keys (as its attention sees them before rotary) and its rotary
    tables, to compute chosen rows afterwards while the layer itself runs SDPA/flash.

    Queries and keys are read where the layer finishes them: at the outputs of `q_norm`/`k_norm` where the layer
    has those modules (QK-norm: Qwen3, Qwen3-VL, Qwen3.5, Gemma 3, OLMo 2; an `Identity` where it is off), else at
    `q_proj`/`k_proj`, or split from a fused `qkv_proj` (Phi-3). A gated `q_proj` (Qwen3.5: query and gate
    interleaved per head, 2 x head_dim each) is de-gated; its `q_norm` already sees the query half. Rotary comes
    from the modelling module's own `apply_rotary_pos_emb`, so partial rotary (Qwen3.5, Phi-3) is the model's own.
    """

    def __init__(self, attention: nn.Module, capture: bool = True):
        self.check(attention)  # before any hook: a refused probe leaves nothing behind
        self.attention = attention
        self._rotary = _rotary_function(attention)
        self.head_dim = int(attention.head_dim)
        self.heads = _heads(attention)
        self._captures = PerThread(_Captures)  # per thread: hooks run in the calling thread
        fused = _module(attention, "q_proj") is None  # fused: [B, S, (H + 2 Hkv) * d], queries first, then keys
        self._fused = (self.heads * self.head_dim, _kv_heads(attention) * self.head_dim) if fused else None
        hooks = []
        if capture:  # else only `replay` fills the store (the layer is scored before it runs)
            hooks.append(attention.register_forward_pre_hook(self._on_input, with_kwargs=True))
            if fused:
                hooks.append(attention.qkv_proj.register_forward_hook(self._on_fused))
            for name in ("q", "k"):
                source = _module(attention, f"{name}_norm") or _module(attention, f"{name}_proj")
                if source is not None:  # bound methods and partials, never closures: a patched model pickles
                    hooks.append(source.register_forward_hook(functools.partial(self._on_output, name)))
        self._hooks = hooks
        proj = _module(attention, "q_proj")
        # a gated q_proj: query and gate interleaved per head (Qwen3.5)
        self._gated_proj = proj is not None and getattr(proj, "out_features", 0) == 2 * self.heads * self.head_dim
        self._gated = _module(attention, "q_norm") is None and self._gated_proj  # what the capture hook sees

    @staticmethod
    def missing(attention: nn.Module) -> list[str]:
        """What `attention` lacks for the probe (empty if nothing)."""
        missing = []
        projections = _module(attention, "q_proj") is not None and _module(attention, "k_proj") is not None
        if not projections and _module(attention, "qkv_proj") is None:
            missing.append("q_proj and k_proj modules (or a fused qkv_proj)")
        if not isinstance(getattr(attention, "head_dim", None), int):
            missing.append("an integer `head_dim`")
        if not isinstance(getattr(attention, "scaling", None), float):
            missing.append("a float `scaling`")
        try:
            _heads(attention)
            if _module(attention, "q_proj") is None:
                _kv_heads(attention)
        except AttributeError:
            missing.append("its head counts (`config.num_attention_heads` / `num_key_value_heads`)")
        if _rotary_function(attention) is None:
            missing.append(f"an `apply_rotary_pos_emb` in its module {type(attention).__module__}")
        return missing

    @classmethod
    def check(cls, attention: nn.Module | None, where: str = "") -> None:
        """Raise a VTokenError naming the attention class and what it lacks, if the probe cannot read it."""
        if attention is None:
            raise VTokenError(f"{where or 'this layer'} has no `self_attn` (softmax attention) to score tokens with")
        missing = cls.missing(attention)
        if missing:
            raise VTokenError(
                f"cannot read attention rows from {type(attention).__name__}{' (' + where + ')' if where else ''}: "
                f"it needs {'; '.join(missing)}"
            )

    @property
    def active(self) -> bool:
        return self._captures.get().active

    @active.setter
    def active(self, value: bool) -> None:
        self._captures.get().active = value

    @property
    def _store(self) -> dict[str, Any]:
        return self._captures.get().store

    @eager
    def _on_output(self, name: str, module, args, output) -> None:
        self._keep(name, output)

    @eager
    def _on_fused(self, module, args, output) -> None:
        """A fused qkv_proj's output [B, S, (H + 2 Hkv) * d]: queries first, then keys."""
        queries, keys = self._fused
        self._keep("q", output[..., :queries])
        self._keep("k", output[..., queries : queries + keys])

    def _keep(self, name: str, value: Any) -> None:
        if self.active:
            self._store[name] = value

    @eager
    def _on_input(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self._keep("length", None if hidden is None else hidden.shape[1])
        self._keep("rotary", kwargs.get("position_embeddings"))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _per_head(self, x: torch.Tensor, seq: int, gated: bool = False) -> torch.Tensor:
        """x as [B, S, heads, d], from [B, S, heads * d] (or [B, S, heads * 2d] gated), [B, S, heads, d] or
        [B, heads, S, d] (QK-norm after the transpose, as Gemma 3 does)."""
        if x.dim() == 3:
            x = x.view(x.shape[0], seq, -1, (2 if gated else 1) * self.head_dim)
            return x[..., : self.head_dim] if gated else x
        sequence_first = x.shape[1] == seq
        if x.shape[1] == seq and x.shape[2] == seq:  # heads == seq: the sequence axis is the outer one in memory
            sequence_first = x.stride(1) >= x.stride(2)
        return x if sequence_first else x.transpose(1, 2)

    def replay(self, hidden: torch.Tensor, rotary: Any) -> None:
        """Compute the queries and keys this attention would compute from its (normed) input `hidden` [B, S, D],
        with rotary tables `rotary`, into the store, as its forward would (for `attention_rows` / `keys`)."""
        attention, (batch, seq) = self.attention, hidden.shape[:2]
        if self._fused is not None:
            queries, keys = self._fused
            fused = attention.qkv_proj(hidden)
            q, k = fused[..., :queries], fused[..., queries : queries + keys]
        else:
            q, k = attention.q_proj(hidden), attention.k_proj(hidden)
        q = q.view(batch, seq, -1, (2 if self._gated_proj else 1) * self.head_dim)[..., : self.head_dim]
        k = k.view(batch, seq, -1, self.head_dim)
        norms = _module(attention, "q_norm"), _module(attention, "k_norm")
        q, k = (x if norm is None else norm(x) for x, norm in zip((q, k), norms, strict=True))
        self._store.update(q=q, k=k, rotary=rotary, length=seq)

    def _take(self, key_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The stored queries [B, S, H, d] and keys [B, S, Hkv, d] (before rotary) and rotary tables, removed."""
        store = self._store
        q, k, rotary = store.pop("q"), store.pop("k"), store.pop("rotary", None)
        seq = store.pop("length", None) or key_valid.shape[1]
        return self._per_head(q, seq, self._gated), self._per_head(k, seq), rotary  # replayed: already per head

    def _rotated_keys(self, k: torch.Tensor, rotary: Any) -> torch.Tensor:
        """[B, S, Hkv, d] keys -> [B, Hkv, S, d] with rotary applied."""
        k = k.transpose(1, 2)
        if rotary is None:
            return k
        cos, sin = (t.expand(k.shape[0], *t.shape[1:]) for t in rotary)
        return self._rotary(k, k, cos, sin)[1]

    def attention_rows(self, rows: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """[B, H, R, S] causal attention of query rows `rows` [B, R] (sequence indices) over the S keys, padding
        (`key_valid` [B, S] False) excluded."""
        q, k, rotary = self._take(key_valid)
        batch = k.shape[0]
        q = q.gather(1, rows[:, :, None, None].expand(-1, -1, *q.shape[2:])).transpose(1, 2)  # [B, H, R, d]
        if rotary is not None:
            cos, sin = (t.expand(batch, *t.shape[1:]) for t in rotary)
            row_cos, row_sin = (t.gather(1, rows[:, :, None].expand(-1, -1, t.shape[-1])) for t in (cos, sin))
            q = self._rotary(q, q, row_cos, row_sin)[0]
        return causal_rows_probs(q, self._rotated_keys(k, rotary), rows, key_valid, self.attention.scaling)

    def cached_rows(self, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """[B, H, S', S] attention of the S' tokens of this decoding step (their captured queries, rotary applied)
        over `keys` [B, Hkv, S, d], the layer's cache after the step (post-rotary, the new tokens last), padding
        (`key_valid` [B, S] False) excluded."""
        q, _, rotary = self._take(key_valid)
        q = q.transpose(1, 2)  # [B, H, S', d]
        if rotary is not None:
            cos, sin = (t.expand(q.shape[0], *t.shape[1:]) for t in rotary)
            q = self._rotary(q, q, cos, sin)[0]
        total, steps = keys.shape[2], q.shape[2]
        rows = torch.arange(total - steps, total, device=q.device).expand(q.shape[0], -1)
        return causal_rows_probs(q, keys, rows, key_valid, self.attention.scaling)

    def keys(self, key_valid: torch.Tensor) -> torch.Tensor:
        """[B, S, H * d] post-rotary keys of every token, heads concatenated, GQA key heads repeated (as
        `repeat_kv` groups them) so that each query head has its key.

        Each row's keys are rotated as the row alone would have them, its first real token (`key_valid` [B, S])
        at position 0: a left-padded row numbered from its padding (plain `model(**inputs)` on LLaVA-style models)
        is rotated back by that token's position. Attention is blind to the shift (RoPE is relative); a key's own
        norm is not, and DART ranks by it."""
        _, k, rotary = self._take(key_valid)
        k = self._rotated_keys(k, rotary)
        if rotary is not None:
            first = key_valid.long().argmax(1)[:, None, None]  # [B, 1, 1] each row's first real column
            cos, sin = (t.expand(k.shape[0], *t.shape[1:]) for t in rotary)
            cos, sin = (t.gather(1, first.expand(-1, -1, t.shape[-1])) for t in (cos, sin))  # [B, 1, d]
            k = self._rotary(k, k, cos, -sin)[1]  # R(-p) R(p + i) = R(i)
        k = k.repeat_interleave(self.heads // k.shape[1], dim=1)
        return k.transpose(1, 2).flatten(2)


class _Captures:
    """One thread's captures of a `QueryKeyProbe`."""

    def __init__(self) -> None:
        self.active = False
        self.store: dict[str, Any] = {}


def _module(owner: nn.Module, name: str) -> nn.Module | None:
    found = getattr(owner, name, None)
    return found if isinstance(found, nn.Module) else None


def _rotary_function(attention: nn.Module):
    return hf.modeling_function(attention, "apply_rotary_pos_emb")


def _heads(attention: nn.Module) -> int:
    heads = getattr(attention, "num_heads", None)
    return int(heads) if isinstance(heads, int) else int(attention.config.num_attention_heads)


def _kv_heads(attention: nn.Module) -> int:
    heads = getattr(attention, "num_key_value_heads", None)
    return int(heads) if isinstance(heads, int) else int(attention.config.num_key_value_heads)


@dataclass
class _Overrides:
    """Keyword arguments a group of layers gets instead of the LLM's own (None: keep the LLM's)."""

    attention_mask: Any
    position_ids: Any
    position_embeddings: Any


@dataclass
class _Prefill:
    """State of one prefill: the current view, the prompt's own rotary tables and positions, what each layer ran on."""

    view: LayerView
    cache: Any
    rotary: Any = None
    position_ids: Any = None
    views: list[LayerView] = field(default_factory=list)
    overrides: _Overrides | None = None
    records: list[Record] = field(default_factory=list)
    right: bool = False  # the batch is right-padded: rows that keep fewer tokens are re-padded on the right
    visual_rank: Any = None  # [B, L] rank of each prompt column among its row's visual tokens
    row_columns: Any = None  # query_rows="chosen": [B, R] prompt columns of the chosen rows (-1: padding)


class _Elapsed:
    """Several steps' stopwatches read as one (`Record.timer`)."""

    def __init__(self) -> None:
        self.watches: list[Stopwatch] = []

    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.watches)


@dataclass
class DecodeSelection:
    """A decode-time selection's state over one cache (left on the cache: `conversation.remember_selection`).

    visual: [B, P] bool, the prompt columns it chooses among; previous: [B, V] the last step's attention over them
    (None: the next step is a first step); records: one per row, updated every step (`timer` sums the steps).
    Under beam search (`beams`), which reorders the cache's rows between steps, `keys` [B, Hkv, S, d] is a copy of
    layer L - 1's cache after the last step: each row's parent is the row whose keys it now starts with, and
    `previous` follows it."""

    visual: torch.Tensor
    previous: torch.Tensor | None
    records: list[Record]
    timer: _Elapsed
    beams: bool = False
    keys: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> DecodeSelection:
        """A copied cache (a branched conversation) continues with the same state and records of its own; the
        steps timed so far stay with the original (CUDA events do not copy)."""
        timer = _Elapsed()
        records = [dataclasses.replace(r, kept=None if r.kept is None else r.kept.clone(), extra=dict(r.extra),
                                       timer=timer) for r in self.records]  # fmt: skip
        previous = None if self.previous is None else self.previous.clone()
        keys = None if self.keys is None else self.keys.clone()
        return DecodeSelection(self.visual.clone(), previous, records, timer, self.beams, keys)

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


@dataclass
class _Step:
    """One decoding step of a decode-time selection, from the LLM's input to the hook after layer `L - 1`."""

    selection: DecodeSelection
    embeds: torch.Tensor
    mask: torch.Tensor  # [B, S] the step's 2-D mask (prompt, every token since, the new ones)
    positions: torch.Tensor
    cache: Any


def _take_columns(x: torch.Tensor, column: torch.Tensor, dim: int) -> torch.Tensor:
    """x with its sequence axis `dim` (batch axis just before it, maybe broadcast) gathered by column [B, C]."""
    x = x.expand(*x.shape[: dim - 1], column.shape[0], *x.shape[dim:])
    index = column.clamp(min=0).view(*[1] * (dim - 1), *column.shape, *[1] * (x.dim() - dim - 1))
    return x.gather(dim, index.expand(*x.shape[: dim - 1], *column.shape, *x.shape[dim + 1 :]))


class LanguageModelStages:
    """Prefill drops and the decode-stage cache policy of one method, on one model's language model."""

    def __init__(self, adapter, method: PrefillMethod):
        self.adapter = adapter
        self.method = method
        self.lm = adapter.language_model
        self.layers = self.lm.layers
        self.drop_layers = method.drop_layers(len(self.layers))
        # hybrid LLMs (Qwen3.5): per-layer types, linear-attention layers holding a recurrent state, not keys
        self.layer_types = list(getattr(self.lm.config, "layer_types", None) or [])
        self.recurrent = {i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"}
        # the first attention layer's cache is never cut: transformers reads the cache length (and so the next
        # position and mask size) from it (layer 0 unless the LLM is hybrid); recurrent layers have no such cache
        first = min((i for i in range(len(self.layers)) if i not in self.recurrent), default=0)
        self.cut_layers = [i for i in method.cut_layers(self.drop_layers) if i > first and i not in self.recurrent]
        self.renumber = method.positions == "renumber"
        self.select_layer = method.select_layer(len(self.layers))  # decode-time selection (None: none)
        self._hooks: list = []
        self._probes: dict[int, QueryKeyProbe] = {}
        self._row_probe: QueryKeyProbe | None = None
        # per call, in the adapter's per-thread `CallState`: `prefill` (a `_Prefill` while one runs), `decode` (per
        # layer, its overrides in a decoding step), `prompt_length`, and `final_columns` (the prompt columns the
        # last layers ran on). What each layer's cache holds (per layer a view; None: the prompt) is left on the
        # cache itself (`conversation.remember_views`): a later call on that cache reads it there

    @property
    def _call(self):
        """The calling thread's call state (hooks run in the thread that called the model)."""
        return self.adapter._state

    # ----------------------------------------------------------------- install / remove
    def install(self) -> None:
        unknown = sorted(set(self.layer_types) - {"full_attention", "linear_attention"}) if self.recurrent else []
        if unknown:
            raise VTokenError(f"{self.method.name}: hybrid LLM with layer types {unknown} is not supported")
        if "normed" in self.method.reads and not isinstance(getattr(self.lm, "norm", None), nn.Module):
            raise VTokenError(f"{self.method.name}: {type(self.lm).__name__} has no final `norm` to read")
        for index in self.drop_layers:  # every drop layer is checked before anything is registered
            scored = self._scored_layer(index)
            if scored is not None:
                layer = self.layers[scored]
                QueryKeyProbe.check(getattr(layer, "self_attn", None), f"{type(layer).__name__} {scored}")
                if scored != index and not isinstance(getattr(layer, "input_layernorm", None), nn.Module):
                    raise VTokenError(f"{self.method.name}: {type(layer).__name__} {scored} has no input_layernorm")
        if self.select_layer is not None:
            read = self.layers[self.select_layer - 1]
            where = f"{type(read).__name__} {self.select_layer - 1}"
            QueryKeyProbe.check(getattr(read, "self_attn", None), where)
        try:
            if self.select_layer is not None:  # the new token's row, after layer L - 1 ran
                self._row_probe = QueryKeyProbe(self.layers[self.select_layer - 1].self_attn)
                self._hooks.append(self.layers[self.select_layer - 1].register_forward_hook(self._select_step))
            self._hooks.append(self.lm.register_forward_pre_hook(self._before_lm, with_kwargs=True))
            self._hooks.append(self.lm.register_forward_hook(self._after_lm))
            for index, layer in enumerate(self.layers):
                hook = functools.partial(self._layer_input, index)
                self._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            for index in self.drop_layers:
                scored = self._scored_layer(index)
                if scored is not None:  # the next layer is scored before it runs: replayed, not captured
                    self._probes[index] = QueryKeyProbe(self.layers[scored].self_attn, capture=scored == index)
                hook = functools.partial(self._layer_output, index)
                self._hooks.append(self.layers[index].register_forward_hook(hook))
        except BaseException:
            self.remove()
            raise

    def _scored_layer(self, drop: int) -> int | None:
        """The layer whose queries/keys the method reads at drop point `drop` (None: none)."""
        scored = dict(zip(self.drop_layers, self.method.scored_layers(len(self.layers)), strict=False))
        return scored.get(drop)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for probe in self._probes.values():
            probe.remove()
        if self._row_probe is not None:
            self._row_probe.remove()
        self._hooks, self._probes, self._row_probe = [], {}, None

    def prefill_columns(self) -> torch.Tensor | None:
        """[B, C] prompt column of every slot of the sequence the decoder layers run on now (-1 = padding slot),
        during a prefill; None outside one. For model code that indexes the prompt after layers (DeepStack)."""
        prefill = self._call.prefill
        return None if prefill is None else prefill.view.column

    # ----------------------------------------------------------------- the LLM call
    @eager
    def _before_lm(self, module, args, kwargs) -> None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None and kwargs.get("input_ids") is not None:
            embeds = self.lm.embed_tokens(kwargs["input_ids"])  # its shape, dtype and device are read
        cache = hf.cache_in(kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        call = self._call
        call.prefill, call.decode, call.step = None, {}, None
        if self._row_probe is not None:
            self._row_probe.active = False
        if embeds is None:
            return
        if past == 0:
            call.final_columns = None
            remember_views(cache, None)
            visual = self.adapter.visual_mask_for(tuple(embeds.shape[:2]))
            if visual is not None and bool(visual.any()):
                self._start_prefill(embeds, kwargs, visual, cache)
            return
        held = views_of(cache)  # what each layer's cache holds, left there by the prefill that filled it
        if held is not None:
            self._start_decode(embeds, kwargs, cache, past, *held)

    def _start_prefill(self, embeds, kwargs, visual, cache) -> None:
        if cache is not None:
            layers = hf.cache_layers(cache)
            odd = [f"{i}: {type(layer).__name__}" for i, layer in enumerate(layers or [])
                   if not hasattr(layer, "keys") and i not in self.recurrent]  # fmt: skip
            if layers is None or odd:
                raise InputError(
                    f"{self.method.name} needs a cache of per-layer keys and values (a DynamicCache of attention "
                    f"layers); got {type(cache).__name__} with "
                    + (f"layers without keys/values ({', '.join(odd)})" if odd else "no per-layer caches")
                )
        batch, length = visual.shape
        device = embeds.device
        mask = kwargs.get("attention_mask")
        mask = torch.ones(batch, length, dtype=torch.long, device=device) if mask is None else mask.long()
        if mask.dim() != 2:
            raise InputError(f"{self.method.name} needs the usual 2-D [batch, seq] attention_mask; got {mask.dim()}-D")
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row's own numbering, for renumbered views
        column = torch.arange(length, device=device).expand(batch, length)
        protected = self.adapter.protected_mask_for((batch, length))
        view = LayerView(column, mask, positions, visual.to(device) & (mask != 0),
                         None if protected is None else protected.to(device),
                         torch.zeros(batch, dtype=torch.long, device=device))  # fmt: skip
        self._call.prompt_length = length
        right = bool((mask[:, -1] == 0).any())  # right-padded: keep the padding on that side
        state = _Prefill(view, cache, right=right, visual_rank=view.visual.long().cumsum(1) - 1)
        if self.method.query_rows == "chosen":
            state.row_columns = self._chosen_rows(embeds, view)
        self._call.prefill = state
        for probe in self._probes.values():
            probe.active = True

    def _start_decode(self, embeds, kwargs, cache, past, views, prompt_length) -> None:
        batch, steps = embeds.shape[:2]
        mask = kwargs.get("attention_mask")
        full = past + steps
        if past < prompt_length:
            raise InputError(
                f"the cache ({hf.CACHE_KWARG}) holds {past} tokens, fewer than the {prompt_length} of the prompt "
                f"{self.method.name} pruned into it (was it cropped?); its layers hold different lengths, so it can "
                "only grow: continue from the whole cache, or start again without one"
            )
        if mask is None:
            mask = torch.ones(batch, full, dtype=torch.long, device=embeds.device)
        call = self._call
        if mask.dim() != 2 or mask.shape[1] != full:
            raise InputError(
                f"a decoding step after {self.method.name}'s pruned prefill needs a 2-D attention_mask covering "
                f"the prompt and every token since ({full} columns here, as generate() passes it); got "
                f"{tuple(mask.shape)}"
            )
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(past, full, device=embeds.device).expand(batch, -1)
        new_columns = mask[:, prompt_length:].long()
        done: dict[int, _Overrides] = {}
        for index, view in enumerate(views):
            if view is None:
                continue
            if id(view) not in done:
                view_mask = torch.cat([view.mask, new_columns], dim=1)
                shifted = positions - view.lost.view(*[1] * (positions.dim() - 2), -1, 1)
                view_positions = shifted if self.renumber else positions
                done[id(view)] = _Overrides(
                    self._mask(embeds, view_mask, view_positions, cache, index),
                    view_positions,
                    self.lm.rotary_emb(embeds, position_ids=view_positions) if self.renumber else None,
                )
            call.decode[index] = done[id(view)]
        if self.select_layer is not None:
            self._start_step(embeds, mask, positions, cache)

    # ----------------------------------------------------------------- decode-time selection (DyCoke)
    def new_call(self, cache: Any) -> list[Record]:
        """A `generate` call continuing from `cache`: its first step is a first step again; returns the records
        its steps will fill (new ones: the earlier call's stay as they were)."""
        selection = selection_of(cache)
        if selection is None:
            return []
        selection.previous, selection.timer, selection.keys = None, _Elapsed(), None
        selection.beams = bool(getattr(self._call, "beams", False))  # this call's own decoding strategy
        selection.records = [
            dataclasses.replace(r, kept=None, timer=selection.timer, extra={"steps": 0, "selections": 0})
            for r in selection.records
        ]
        return selection.records

    def _start_step(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> None:
        """A decoding step on a cache a prefill of this stage filled: one new token selects (in the hook after
        layer L - 1); several (a new turn's text) attend to everything and start the selection afresh."""
        selection = selection_of(cache)
        if selection is None:
            return
        batch, steps = embeds.shape[:2]
        if selection.visual.shape[0] != batch:
            raise InputError(
                f"{self.method.name}: the cache was filled by a call with {selection.visual.shape[0]} rows; this "
                f"step has {batch}; continue each conversation with its own cache"
            )
        if steps != 1:
            selection.previous = None
            return
        self._call.step = _Step(selection, embeds, mask, positions, cache)
        self._row_probe.active = True

    @eager
    def _select_step(self, module, args, output) -> None:
        """Hook after layer L - 1 in a decoding step: the new token's attention row (head mean) over the visual
        tokens decides what layers L and later attend to in this step."""
        call = self._call
        step, call.step = getattr(call, "step", None), None
        if step is None:
            return
        probe = self._row_probe
        probe.active = False
        selection = step.selection
        timer = Stopwatch(step.embeds.device).start()
        keys = hf.cache_layers(step.cache)[self.select_layer - 1].keys  # [B, Hkv, S, d], the new token last
        total = keys.shape[2]
        key_valid = step.mask[:, -total:] != 0
        with torch.no_grad():
            if selection.beams:
                selection.follow_beams(keys)
            row = probe.cached_rows(keys, key_valid).mean(dim=1)[:, -1]  # [B, S]
            visual = torch.nn.functional.pad(selection.visual, (0, total - selection.visual.shape[1]))
            slots = _left_packed(visual.to(row.device), right=True)  # [B, V] each row's visual columns
            valid = slots >= 0
            attention = row.gather(1, slots.clamp(min=0)) * valid
            keep, reselect = self.method.decode_keep(attention, valid, selection.previous)
            keep, reselect = keep.bool() & valid, reselect.bool()
        selection.previous = attention
        drop = torch.zeros_like(visual)
        drop.scatter_(1, slots.clamp(min=0), valid & ~keep & reselect[:, None])
        timer.stop()
        selection.timer.watches.append(timer)
        flags = reselect.tolist()
        for index, record in enumerate(selection.records):
            record.extra["steps"] += 1
            if flags[index]:
                record.extra["selections"] += 1
                record.kept = keep[index][valid[index]].nonzero().squeeze(1)
        if not any(flags):
            return
        mask = step.mask.masked_fill(drop.to(step.mask.device), 0)
        overrides = _Overrides(self._mask(step.embeds, mask, step.positions, step.cache, self.select_layer),
                               step.positions, None)  # fmt: skip
        for index in range(self.select_layer, len(self.layers)):
            call.decode[index] = overrides

    def _start_selection(self, state: _Prefill) -> list[Record]:
        """After a prefill with a cache: the state the decoding steps select with, left on the cache; one record
        per row (tokens_in: the visual tokens chosen among; tokens_out: what a selecting step keeps of them)."""
        first = state.views[0]
        visual = first.visual.clone()
        trailer = getattr(self.adapter, "video_run_trailer", 0)  # separators closing a run (OneVision's newline)
        if trailer:
            for row, _, end in placeholder_runs(visual):
                visual[row, max(end - trailer, 0) : end] = False
        timer = _Elapsed()
        counts = visual.sum(1).tolist()
        stage = f"decode.layer{self.select_layer}"
        records = [
            Record(stage, self.method.name, image=row, crop=0, tokens_in=n, tokens_out=self.method.decode_count(n),
                   kept=None, grid=(1, n), timer=timer, share=1 / len(counts), extra={"steps": 0, "selections": 0})
            for row, n in enumerate(counts)
        ]  # fmt: skip
        beams = bool(getattr(self._call, "beams", False))
        remember_selection(state.cache, DecodeSelection(visual, None, records, timer, beams))
        return records

    def _mask(self, hidden, mask, positions, cache, layer) -> Any:
        """The causal + padding mask of the layers from `layer` on, in their attention implementation's format; for
        a hybrid LLM a dict by layer type (linear-attention layers take the 2-D padding mask, or None)."""
        attention = next((i for i in range(layer, len(self.layers)) if i not in self.recurrent), layer)
        position_ids = positions if positions.dim() == 2 else positions[0]
        causal = hf.causal_mask(self.lm.config, hidden, mask, cache, position_ids, attention)
        if not self.recurrent:
            return causal
        recurrent = hf.recurrent_mask(self.lm.config, hidden, mask, cache)
        return {"linear_attention": recurrent, "full_attention": causal}

    @eager
    def _layer_input(self, index: int, module, args, kwargs):
        """Pre-hook of decoder layer `index`: the mask, positions and rotary tables of the sequence it runs on."""
        call = self._call
        state = call.prefill
        if state is not None:
            if state.rotary is None:  # the first layer sees the prompt's own tables
                state.rotary, state.position_ids = kwargs.get("position_embeddings"), kwargs.get("position_ids")
            state.views.append(state.view)
            overrides = state.overrides
        else:
            overrides = call.decode.get(index)
        if overrides is None:
            return None
        mask = overrides.attention_mask
        kwargs = dict(kwargs, attention_mask=mask[self.layer_types[index]] if isinstance(mask, dict) else mask)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = overrides.position_ids
        if overrides.position_embeddings is not None:
            kwargs["position_embeddings"] = overrides.position_embeddings
        return args, kwargs

    @eager
    def _layer_output(self, index: int, module, args, output):
        """Hook after drop layer `index`: the hidden states of the kept tokens."""
        if self._call.prefill is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = self._drop(index, hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    # ----------------------------------------------------------------- one drop point
    def _chosen_rows(self, embeds: torch.Tensor, view: LayerView) -> torch.Tensor:
        """query_rows="chosen": [B, R] prompt columns of the text tokens the method picks from the LLM's input
        embeddings (left-packed, -1 padded)."""
        visual, text = _left_packed(view.visual), _left_packed(_text_after_image(view))
        with torch.no_grad():
            chosen = self.method.choose_rows(
                _take_columns(embeds, visual, 1), visual >= 0, _take_columns(embeds, text, 1), text >= 0
            ).bool() & (text >= 0)
        if not bool(chosen.any()):
            return torch.full((embeds.shape[0], 1), -1, dtype=torch.long, device=embeds.device)
        picked = _left_packed(chosen)  # [B, R] indices into each row's text tokens
        return text.gather(1, picked.clamp(min=0)).masked_fill(picked < 0, -1)

    def _query_rows(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] sequence indices of the method's query rows and [B, R] which are real."""
        batch, length = view.mask.shape
        if self.method.query_rows == "last":  # each row's own last real token (right padding: not the last column)
            columns = torch.arange(length, device=view.mask.device).expand(batch, -1)
            last = columns.masked_fill(view.mask == 0, -1).amax(1, keepdim=True)
            return last.clamp(min=0), last >= 0
        if self.method.query_rows == "chosen":  # text tokens are never dropped: their columns are still there
            slots = view.slots_of_columns(self._call.prefill.row_columns)
            return slots.clamp(min=0), slots >= 0
        text = _text_after_image(view)
        if not bool(text.any()):
            return torch.zeros(batch, 1, dtype=torch.long, device=text.device), torch.zeros_like(text[:, :1])
        slots = _left_packed(text)
        return slots.clamp(min=0), slots >= 0

    def _layer_tokens(self, layer: int, hidden: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> LayerTokens:
        """What the method reads at drop point `layer` (see `PrefillMethod.reads`); slots / valid: [B, V] each
        row's visual slots in the current view."""
        state = self._call.prefill
        view, reads = state.view, self.method.reads
        key_valid = view.mask != 0
        rows = row_valid = attention = keys = None
        if "attention" in reads or "next_attention" in reads:
            rows, row_valid = self._query_rows(view)
            probe = self._probes[layer]
            if "next_attention" in reads:  # the next layer's own input norm and the rotary tables it will get
                rotary = state.overrides.position_embeddings if state.overrides is not None else state.rotary
                probe.replay(self.layers[layer + 1].input_layernorm(hidden), rotary)
            probs = probe.attention_rows(rows, key_valid).mean(dim=1)  # [B, R, S]
            attention = probs.gather(2, slots[:, None, :].expand(-1, probs.shape[1], -1))
            attention = attention * row_valid[:, :, None] * valid[:, None, :]
        if "keys" in reads:
            keys = self._probes[layer].keys(key_valid)  # [B, S, H * d]
        normed = self.lm.norm(hidden) if "normed" in reads else None
        first = view.column.gather(1, (view.mask != 0).long().argmax(1, keepdim=True))
        index = view.column - first  # each slot's index in its row's unpadded LLM input

        def visual_part(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else _take_columns(x, slots, 1)

        text = None
        if keys is not None or normed is not None:
            text_slots = _left_packed(_text_after_image(view))
            text_valid, text_slots = text_slots >= 0, text_slots.clamp(min=0)
            text = TextTokens(text_valid, index.gather(1, text_slots),
                              None if keys is None else _take_columns(keys, text_slots, 1),
                              None if normed is None else _take_columns(normed, text_slots, 1))  # fmt: skip
        protected = view.protected.gather(1, slots) & valid if view.protected is not None else None
        received = state.views[0].visual.sum(1).tolist()
        hidden_visual = visual_part(hidden) if "hidden" in reads else None
        return LayerTokens(layer, attention, row_valid, valid, protected, received, index.gather(1, slots),
                           visual_part(keys), visual_part(normed), hidden_visual, text)  # fmt: skip

    def _drop(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        state = self._call.prefill
        view = state.view
        timer = Stopwatch(hidden.device).start()
        slots = _left_packed(view.visual)  # [B, V] each row's visual slots
        valid = slots >= 0
        slots = slots.clamp(min=0)
        with torch.no_grad():  # a selection: nothing to differentiate
            tokens = self._layer_tokens(layer, hidden, slots, valid)
            merged = None
            if slots.shape[1] == 0:  # no row has visual tokens left
                keep_visual = valid
            else:
                keep_visual = self.method.keep_mask(tokens).bool() & valid
                if tokens.protected is not None:
                    keep_visual |= tokens.protected
                merged = self.method.merge(tokens, keep_visual)
        keep = (view.mask != 0) & ~view.visual
        keep.scatter_(1, slots, keep.gather(1, slots) | keep_visual)
        # kept: each row's kept tokens as ranks among the visual tokens the LLM received in that row (merged
        # tokens are none of those)
        ranks = state.visual_rank.gather(1, view.column.gather(1, slots).clamp(min=0))
        if view.merged is not None:
            ranks = ranks.masked_fill(view.merged.gather(1, slots), -1)
        order = None
        if merged is not None:
            view, hidden, keep, order = _with_merged(view, hidden, keep, slots, merged)
        new_slots = _left_packed(keep, right=state.right, order=order)
        new_view = view.gather(new_slots, self.renumber)
        timer.stop()
        state.records += self._records(layer, tokens, keep_visual, ranks, timer, merged)
        state.view = new_view
        hidden = _take_columns(hidden, new_slots, 1).masked_fill((new_slots < 0)[:, :, None], 0.0)
        state.overrides = self._overrides_for(hidden, new_view, state, layer + 1)
        return hidden

    def _overrides_for(self, hidden: torch.Tensor, view: LayerView, state: _Prefill, layer: int) -> _Overrides:
        """Mask, positions and rotary tables of the layers running on `view` from `layer` on, in the prefill."""
        if self.renumber:
            positions = view.positions
            rotary = self.lm.rotary_emb(hidden, position_ids=positions)
        else:  # the prompt's own positions and tables, sliced
            positions = state.position_ids if state.position_ids is not None else state.views[0].positions
            positions = _take_columns(positions, view.column, positions.dim() - 1)
            rotary = tuple(_take_columns(t, view.column, 1) for t in state.rotary)
        mask = self._mask(hidden, view.mask, positions, state.cache, layer)
        return _Overrides(mask, positions, rotary)

    def _records(
        self,
        layer: int,
        tokens: LayerTokens,
        keep: torch.Tensor,
        ranks: torch.Tensor,
        timer: Stopwatch,
        merged: Merged | None = None,
    ) -> list[Record]:
        """One record per row; keep / ranks: [B, V] over each row's (left-packed) visual slots. Merged tokens
        count in tokens_out (extra["merged"]), not in `kept`."""
        counts, kept = tokens.counts, keep.sum(1).tolist()
        added = merged.counts if merged is not None else [0] * len(counts)
        return [
            Record(
                f"prefill.layer{layer}",
                self.method.name,
                image=row,
                crop=0,
                tokens_in=counts[row],
                tokens_out=kept[row] + added[row],
                kept=ranks[row][keep[row] & tokens.valid[row] & (ranks[row] >= 0)],
                grid=(1, counts[row]),
                timer=timer,
                share=1 / len(counts),
                extra={"merged": added[row]} if merged is not None else {},
            )
            for row in range(len(counts))
        ]

    # ----------------------------------------------------------------- after the prefill: the decode stage
    @eager
    def _after_lm(self, module, args, output) -> None:
        call = self._call
        state = call.prefill
        if state is None:
            return
        call.prefill = None
        for probe in self._probes.values():
            probe.active = False
        first = state.views[0]
        views: list[LayerView | None] = [None if v is first else v for v in state.views]
        visual_per_layer = torch.stack([v.visual.sum(1) for v in state.views], dim=1)  # [B, layers]
        records = state.records
        # the LLM makes its own cache when called with use_cache and none given: take the one it returns
        cache = hf.cache_out(output)
        state.cache = cache if cache is not None else state.cache
        if self.cut_layers and state.cache is not None:
            records += self._cut(state, views)
        if self.select_layer is not None and state.cache is not None:
            records += self._start_selection(state)
        if records:
            average = (visual_per_layer.float().mean(1)).tolist()
            for record in records:
                if record.stage.startswith("prefill"):
                    record.extra["layer_average"] = average[record.image]
        self.adapter.records = self.adapter.records + records
        remember_views(state.cache, (views, call.prompt_length))
        call.final_columns = state.view.column

    def _cut(self, state: _Prefill, views: list[LayerView | None]) -> list[Record]:
        """Cut the caches of `cut_layers` to the visual tokens in the final view (output-aware KV cut)."""
        final = state.view
        before = sum(state.views[i].visual.sum(1) for i in self.cut_layers)
        cut_views: dict[int, tuple[LayerView, torch.Tensor]] = {}  # per view held: its cut view, final's slots
        for index in self.cut_layers:
            held = state.views[index]
            if id(held) not in cut_views:
                cut = LayerView(final.column, final.mask, final.positions, final.visual, final.protected, held.lost)
                cut_views[id(held)] = cut, held.slots_of(final)
            views[index], slots = cut_views[id(held)]
            layer_cache = hf.cache_layers(state.cache)[index]
            for name in ("keys", "values"):
                tensor = getattr(layer_cache, name)
                index_ = slots.clamp(min=0)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
                setattr(layer_cache, name, tensor.gather(2, index_))
        after = final.visual.sum(1) * len(self.cut_layers)
        lengths = [v.mask.sum(1) if v is not None else state.views[0].mask.sum(1) for v in views]
        lengths = torch.stack(lengths, dim=1).tolist()  # [B, layers] real tokens each layer's cache holds
        timer = Stopwatch(final.mask.device).start().stop()
        return [
            Record(
                "decode.kv",
                self.method.name,
                image=row,
                crop=0,
                tokens_in=int(before[row]),
                tokens_out=int(after[row]),
                kept=None,
                grid=(1, 0),
                timer=timer,
                share=0.0,
                extra={"cache_lengths": lengths[row]},
            )
            for row in range(final.mask.shape[0])
        ]
