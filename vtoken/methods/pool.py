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


def _cells(height: int, width: int, k: int) -> list[tuple[int, int, int, int]]:
    """The k pooling cells (row0, row1, col0, col1) in raster order."""
    rows = max(1, min(height, k, round(math.sqrt(k * height / width))))
    while -(-k // rows) > width:  # a band cannot hold more cells than the grid has columns
        rows += 1
    cells = []
    for i in range(rows):
        cols = k // rows + (1 if i < k % rows else 0)
        r0, r1 = _bounds(height, rows, i)
        cells += [(r0, r1, *_bounds(width, cols, j)) for j in range(cols)]
    return cells


@lru_cache(maxsize=64)
def pool_weights(height: int, width: int, k: int) -> torch.Tensor:
    """[k, height*width] averaging weights, rows in raster order of the pooled cells."""
    weights = torch.zeros(k, height, width)
    for cell, (r0, r1, c0, c1) in enumerate(_cells(height, width, k)):
        weights[cell, r0:r1, c0:c1] = 1.0 / ((r1 - r0) * (c1 - c0))
    return weights.flatten(1)


@lru_cache(maxsize=64)
def pool_anchors(height: int, width: int, k: int) -> torch.Tensor:
    """[k] raster index of the patch at the centre of each pooled cell (ascending)."""
    return torch.tensor(
        [((r0 + r1 - 1) // 2) * width + (c0 + c1 - 1) // 2 for r0, r1, c0, c1 in _cells(height, width, k)]
    )


@register_method
@dataclass
class Pool(Method):
    """Average-pool the H x W grid of every crop to k tokens (merging: no kept indices)."""

    name = "pool"
    scopes = ("crop",)  # pools each crop to its own budget
    requires = ("full_grid",)  # pools complete H x W crops; crops cut by unpadding are not grids

    def select(self, tokens: VisualTokens) -> Selection:
        h, w = tokens.grid
        k = self.keep_count(tokens.num_tokens)
        feats = tokens.features
        weights = pool_weights(h, w, k).to(device=feats.device, dtype=torch.float32)
        pooled = torch.einsum("kn,cnd->ckd", weights, feats.float()).to(feats.dtype)
        anchors = pool_anchors(h, w, k).to(feats.device).expand(tokens.num_crops, -1)
        return Selection(features=pooled, anchors=anchors)
