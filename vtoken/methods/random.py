"""`random` baseline: keep k tokens per crop uniformly at random (seeded, reproducible)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register_method
from ..tokens import Selection, VisualTokens
from .base import Method


@register_method
@dataclass
class Random(Method):
    """Uniform random keep-k per crop.

    The subset depends only on `seed`, N and k, never on a crop's place in the batch, so a padded batch gives the
    same result as running its samples one by one; every crop of a call keeps the same random positions.
    """

    seed: int = 0

    name = "random"

    def select(self, tokens: VisualTokens) -> Selection:
        n, k = tokens.num_tokens, self.keep_count(tokens.num_tokens)
        generator = torch.Generator().manual_seed(self.seed)
        kept = torch.randperm(n, generator=generator)[:k].sort().values
        return Selection(kept=kept.expand(tokens.num_crops, -1).to(tokens.features.device))
