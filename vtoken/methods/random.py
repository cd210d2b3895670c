"""`random` baseline: keep k tokens per crop uniformly at random (seeded, reproducible)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import register_method
from ..tokens import VisualTokens
from .base import ScoreMethod


@register_method
@dataclass
class Random(ScoreMethod):
    """Uniform random keep-k per crop: the top-k of seeded uniform noise, i.e. a uniformly random k-subset.

    The noise depends only on `seed` and N, never on a crop's place in the batch, so a padded batch gives the
    same result as running its samples one by one; crops of equal size keep the same random positions.
    """

    seed: int = 0

    name = "random"

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        noise = torch.rand(tokens.num_tokens, generator=generator)
        return noise.to(tokens.features.device).expand(tokens.num_crops, -1)
