"""`random` baseline: keep k tokens per crop uniformly at random (seeded, reproducible)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..params import Int
from ..tokens import VisualTokens
from .base import ScoreMethod


@dataclass
class Random(ScoreMethod):
    """Uniform random keep-k per crop: the top-k of seeded uniform noise, i.e. a uniformly random k-subset.

    The noise depends only on `seed`, N and the crop's index within its image (or frame within its video), never
    on where the image sits in the batch, so a padded batch gives the same result as running samples one by one.
    """

    seed: int = 0

    name = "random"
    # the noise of crop w is seeded with seed + 7919 * w, which torch.Generator takes below 2**64
    params = {"seed": Int(0, 2**62)}
    layouts = ("native", "official")

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        # noise per crop index *within its image*: independent of where the image sits in the batch
        images = tokens.image_index if tokens.image_index is not None else torch.arange(tokens.num_crops)
        first = {int(i): int((images == i).nonzero()[0]) for i in images.unique()}
        within = [c - first[int(i)] for c, i in enumerate(images.tolist())]
        noise = {w: torch.rand(tokens.num_tokens, generator=torch.Generator().manual_seed(self.seed + 7919 * w))
                 for w in set(within)}  # fmt: skip
        return torch.stack([noise[w] for w in within]).to(tokens.features.device)
