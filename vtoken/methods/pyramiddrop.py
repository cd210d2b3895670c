"""PyramidDrop: visual tokens dropped in stages, more at each (Xing et al., "PyramidDrop: Accelerating Your Large
Vision-Language Models via Pyramid Visual Redundancy Reduction", CVPR 2025; official code Cooperx521/PyramidDrop).

Before each layer l in `layers` (after layer l - 1) a row keeps int(N * ratio) of the N visual tokens it brought
into the LLM (`ratios`, one per stage, non-increasing). Score of a visual token: the attention of the last prompt
token (the last instruction token) to it in layer l itself, recomputed from layer l - 1's output with layer l's
input norm, q/k projections and rotary at the current positions, softmax over its whole causal row in fp32, mean
over heads (GQA key heads repeated, so every query head reads its own key head). Kept tokens stay in order; later
layers get contiguous renumbered positions (official) and decoding continues, layer by layer, right after that
layer's own prompt; `positions="original"` keeps the kept tokens' own (e.g. M-RoPE) positions instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import VTokenError
from ..params import Choice, Fractions, Layers
from ..tokens import LayerTokens
from ..validation import real
from .base import PrefillMethod, keep_top, nearest_layers, padding_excluded

POSITIONS = ("renumber", "original")


@dataclass
class PyramidDrop(PrefillMethod):
    """`layers`: the layers before which each stage drops (the paper's 8, 16, 24 on a 32-layer LLM); `ratios`: the
    share of the row's visual tokens each stage keeps, counted on the tokens it brought into the LLM."""

    layers: tuple[int, ...] = (8, 16, 24)
    ratios: tuple[float, ...] = (0.5, 0.25, 0.125)
    positions: str = "renumber"

    name = "pyramiddrop"
    query_rows = "last"
    reads = ("next_attention",)
    params = {
        "layers": Layers("(8, 16, 24)", hint="a stage drops before each, scored by it"),
        "ratios": Fractions(hint="non-increasing, in (0, 1]: the share each stage keeps"),
        "positions": Choice(POSITIONS),
    }

    @classmethod
    def fit(cls, model) -> dict:
        """The official layers on a 32+-layer LLM, else scaled to its depth; each stage scored by the
        softmax-attention layer it drops before, after the first one (a hybrid LLM reads its cache length there);
        positions='original' on multi-axis (M-RoPE) positions."""
        depth, attention, official = model.llm_layers, model.attention_layers, cls.defaults()
        if depth < 2:
            return {}
        first = min(attention, default=0)
        fits = [k for k in range(1, depth) if k in attention and k - 1 >= first]
        layers = nearest_layers(fits, official["layers"], depth) if fits else [1]
        fitted = {"layers": tuple(layers), "ratios": official["ratios"][: len(layers)]}
        if model.multi_axis_positions:  # M-RoPE: renumbering is not defined, the kept tokens keep their own
            fitted["positions"] = "original"
        return fitted

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layers[0] < 1:
            raise VTokenError(
                f"pyramiddrop: layers={self.layers}; a stage drops before a layer and is scored by it, after the "
                "layer before it, so every layer must be >= 1"
            )
        expected = f"{len(self.layers)} non-increasing fractions in (0, 1], one per layer, e.g. (0.5, 0.25, 0.125)"
        ratios = self.ratios
        if isinstance(ratios, (str, bytes)) or not isinstance(ratios, Sequence) or len(ratios) != len(self.layers):
            raise VTokenError(f"pyramiddrop: ratios={ratios!r}; expected {expected}")
        self.ratios = tuple(real(self.name, "ratios", r, "(0, 1]", hint=expected) for r in ratios)
        if list(self.ratios) != sorted(self.ratios, reverse=True):
            raise VTokenError(f"pyramiddrop: ratios={ratios!r} are not non-increasing; expected {expected}")

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layers[-1] > num_layers - 1:
            raise VTokenError(
                f"pyramiddrop: layers={self.layers} drop before layers this LLM does not have: it has {num_layers} "
                f"layers (0..{num_layers - 1}), so every layer must be at most {num_layers - 1}"
            )
        return tuple(layer - 1 for layer in self.layers)

    def keep_counts(self, tokens: LayerTokens) -> list[int]:
        """Visual tokens each row keeps at this stage: int(N * ratio) of the N it brought into the LLM."""
        ratio = self.ratios[self.layers.index(tokens.layer + 1)]
        return [min(int(received * ratio), n) for received, n in zip(tokens.received, tokens.counts, strict=True)]

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        scores = padding_excluded(tokens.attention[:, -1].float(), tokens)  # the last query row
        return keep_top(scores, self.keep_counts(tokens))

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        return self.keep_counts(tokens)
