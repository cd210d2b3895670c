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
    """Uniform random keep-k per crop. Each call with the same `seed` draws the same subsets."""

    seed: int = 0

    name = "random"

    def select(self, tokens: VisualTokens) -> Selection:
        n, k = tokens.num_tokens, self.keep_count(tokens.num_tokens)
        generator = torch.Generator().manual_seed(self.seed)
        kept = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(tokens.num_crops)])
        return Selection(kept=kept.sort(dim=-1).values.to(tokens.features.device))
