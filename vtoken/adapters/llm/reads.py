"""What a method reads at a drop point (`PrefillMethod.reads`), gathered into `LayerTokens`: the attention of its
query rows to the visual tokens (one fused op), post-RoPE keys, final-normed and raw hidden states, each for the
row's visual tokens and its text after the image; counts from the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vtoken.tokens import LayerTokens, TextTokens

from .. import hf
from .views import packed, take_columns, text_after_image

if TYPE_CHECKING:
    from .prefill import PrefillState


def query_rows(state: PrefillState, rows: str) -> torch.Tensor:
    """[B, R] sequence indices of the method's query rows in the current view (-1: none)."""
    view, layout = state.view, state.layout
    if rows == "last":  # each row's own last real token: the last column unless the batch is padded on the right
        if not layout.right:
            return torch.full((view.column.shape[0], 1), view.width - 1, dtype=torch.long, device=view.column.device)
        return view.mask.sum(1, keepdim=True) - 1
    text = packed(text_after_image(view.mask, view.visual), max(max(layout.text, default=0), 1), layout.text)
    if rows == "chosen":  # text tokens are never dropped: the chosen ones keep their place among them
        return text.masked_fill(~state.chosen, -1)
    return text


def layer_tokens(stages, state: PrefillState, layer: int, hidden: torch.Tensor, slots: torch.Tensor) -> LayerTokens:
    """What the method reads at drop point `layer`; slots: [B, V] each row's visual slots (-1: padding)."""
    view, reads, method = state.view, stages.method.reads, stages.method
    key_valid = view.mask != 0
    valid = slots >= 0
    rows = row_valid = attention = keys = None
    if "attention" in reads or "next_attention" in reads:
        rows = query_rows(state, method.query_rows)
        row_valid = rows >= 0
        probe = stages.probes[layer]
        cached = None
        if "next_attention" in reads:  # the next layer's own input norm and the rotary tables it will get
            rotary = state.overrides.position_embeddings if state.overrides is not None else state.rotary
            probe.replay(stages.layers[layer + 1].input_layernorm(hidden), rotary)
        else:
            cached = cached_keys(state, layer, view.width)
        attention = probe.visual_attention(rows, key_valid, slots, cached)
    if "keys" in reads:
        shifted = not state.layout.right and view.padded  # a left-padded row may be numbered from its padding
        keys = stages.probes[layer].keys(key_valid, cached_keys(state, layer, view.width), shifted)  # [B, S, H*d]
    normed = stages.lm.norm(hidden) if "normed" in reads else None
    index = text = None
    if keys is not None or normed is not None:
        first = view.column.gather(1, view.mask.argmax(1, keepdim=True))
        index = view.column - first  # each slot's index in its row's unpadded LLM input
        counts = state.layout.text
        text_slots = packed(text_after_image(view.mask, view.visual), max(counts, default=0), counts)
        text_valid, text_slots = text_slots >= 0, text_slots.clamp(min=0)
        text = TextTokens(text_valid, index.gather(1, text_slots),
                          None if keys is None else take_columns(keys, text_slots, 1),
                          None if normed is None else take_columns(normed, text_slots, 1), known=counts)  # fmt: skip
        index = index.gather(1, slots.clamp(min=0))

    def visual_part(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else take_columns(x, slots, 1)

    protected = view.protected.gather(1, slots.clamp(min=0)) & valid if view.protected is not None else None
    hidden_visual = visual_part(hidden) if "hidden" in reads else None
    received = state.views[0].visual_counts
    return LayerTokens(layer, attention, row_valid, valid, protected, received, index, visual_part(keys),
                       visual_part(normed), hidden_visual, text, known=view.visual_counts)  # fmt: skip


def cached_keys(state: PrefillState, layer: int, width: int) -> torch.Tensor | None:
    """Layer `layer`'s rotated keys [B, Hkv, S, d] as its cache holds them after it ran in this prefill (the
    prefill starts from an empty cache), or None without a cache (they are rotated from the capture then)."""
    layers = hf.cache_layers(state.cache) if state.cache is not None else None
    if not layers or layer >= len(layers):
        return None
    keys = getattr(layers[layer], "keys", None)
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[2] == width else None
