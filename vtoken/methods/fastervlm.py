"""FasterVLM: keep the patches the [CLS] token attends to most (Zhang et al., "[CLS] Attention is All You Need
for Training-Free Visual Token Pruning"; official code Theia-4869/FasterVLM).

Score of patch j = post-softmax attention of the [CLS] query to patch key j in the layer whose output is the
feature (layer 22 of CLIP-L/14-336 for LLaVA's `vision_feature_layer=-2`), mean over heads, patch keys only,
no renormalisation. Top-k per crop (per frame for video), kept in ascending order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tokens import VisualTokens
from .base import ScoreMethod


@dataclass
class FasterVLM(ScoreMethod):
    """[CLS]-attention top-k. `budget`: fraction kept or tokens per crop (official runs: 288/144/58/29 of 576)."""

    name = "fastervlm"
    requires = ("cls_attention",)
    layouts = ("native", "official")

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        return tokens.signals["cls_attention"]
