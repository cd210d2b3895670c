"""`random` baseline: keep k tokens per crop uniformly at random (seeded, reproducible)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..params import Int
from ..tokens import VisualTokens
from .base import ScoreMethod, image_slots


@lru_cache(maxsize=64)
@torch.inference_mode(False)  # cached across calls: never an inference tensor, whatever mode the first call ran in
def crop_noise(seed: int, n: int, crops: int, device: torch.device) -> torch.Tensor:
    """[crops, n] the noise of the crops at positions 0..crops-1 within their image, drawn once on the host (so that
    every device draws the same numbers) and kept on `device`."""
    rows = [torch.rand(n, generator=torch.Generator().manual_seed(seed + 7919 * w)) for w in range(crops)]
    return torch.stack(rows).to(device)


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
        # noise per crop index *within its image* (its index minus its image's first crop's), on the device:
        # independent of where the image sits in the batch
        device = tokens.features.device
        within = torch.arange(tokens.num_crops, device=device) - image_slots(tokens, device)
        return crop_noise(self.seed, tokens.num_tokens, tokens.num_crops, device)[within]
