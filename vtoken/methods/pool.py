"""`pool` baseline: spatial average pooling of each crop's token grid down to exactly the budget.

When k = h * w factors with the grid's aspect, this is `adaptive_avg_pool2d` to (h, w). For any other k the grid
is cut into r horizontal bands (r chosen for square cells) and band i into c_i cells, the c_i differing by at most
one, so exactly k cells; each output token is the mean of the patches in its cell (adaptive-pool boundaries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..registry import register_method
from ..tokens import Selection, VisualTokens
from .base import Method


def _bounds(size: int, parts: int, i: int) -> tuple[int, int]:
    """Adaptive-pooling bounds of part i of `parts` over `size` (may overlap, as in adaptive_avg_pool)."""
    return (i * size) // parts, -((-(i + 1) * size) // parts)


@lru_cache(maxsize=64)
def pool_weights(height: int, width: int, k: int) -> torch.Tensor:
    """[k, height*width] averaging weights, rows in raster order of the pooled cells."""
    rows = max(1, min(height, k, round(math.sqrt(k * height / width))))
    while -(-k // rows) > width:  # a band cannot hold more cells than the grid has columns
        rows += 1
    weights = torch.zeros(k, height * width)
    cell = 0
    for i in range(rows):
        cols = k // rows + (1 if i < k % rows else 0)
        r0, r1 = _bounds(height, rows, i)
        for j in range(cols):
            c0, c1 = _bounds(width, cols, j)
            block = torch.zeros(height, width)
            block[r0:r1, c0:c1] = 1.0 / ((r1 - r0) * (c1 - c0))
            weights[cell] = block.flatten()
            cell += 1
    return weights


@register_method
@dataclass
class Pool(Method):
    """Average-pool the H x W grid of every crop to k tokens (merging: no kept indices)."""

    name = "pool"
    requires = ("full_grid",)  # pools complete H x W crops; crops cut by unpadding are not grids

    def select(self, tokens: VisualTokens) -> Selection:
        h, w = tokens.grid
        k = self.keep_count(tokens.num_tokens)
        feats = tokens.features
        weights = pool_weights(h, w, k).to(device=feats.device, dtype=torch.float32)
        pooled = torch.einsum("kn,cnd->ckd", weights, feats.float()).to(feats.dtype)
        return Selection(features=pooled)
