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

from ..tokens import Selection, VisualTokens
from .base import EncoderMethod


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
@torch.inference_mode(False)  # cached across calls: never an inference tensor, whatever mode the first call ran in
def pool_weights(height: int, width: int, k: int) -> torch.Tensor:
    """[k, height*width] averaging weights, rows in raster order of the pooled cells."""
    weights = torch.zeros(k, height, width)
    for cell, (r0, r1, c0, c1) in enumerate(_cells(height, width, k)):
        weights[cell, r0:r1, c0:c1] = 1.0 / ((r1 - r0) * (c1 - c0))
    return weights.flatten(1)


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def pool_anchors(height: int, width: int, k: int) -> torch.Tensor:
    """[k] raster index of the patch at the centre of each pooled cell (ascending)."""
    return torch.tensor(
        [((r0 + r1 - 1) // 2) * width + (c0 + c1 - 1) // 2 for r0, r1, c0, c1 in _cells(height, width, k)]
    )


@dataclass
class Pool(EncoderMethod):
    """Average-pool the H x W grid of every crop to k tokens (merging: no kept indices)."""

    name = "pool"
    scopes = ("crop",)  # pools each crop to its own budget
    requires = ("grid",)  # tokens on an H x W grid whose valid part is a rectangle
    layouts = ("native", "official")
    merges = True

    def merged_cells(self, height: int, width: int, k: int) -> list[list[int]]:
        """The grid cells (raster indices) averaged into each of the k output tokens of an H x W crop."""
        return [
            [r * width + c for r in range(r0, r1) for c in range(c0, c1)] for r0, r1, c0, c1 in _cells(height, width, k)
        ]

    def select(self, tokens: VisualTokens) -> Selection:
        if tokens.valid is not None:
            return self._select_valid_rectangles(tokens)
        h, w = tokens.grid
        k = self.keep_count(tokens.num_tokens)
        feats = tokens.features
        weights = pool_weights(h, w, k).to(device=feats.device, dtype=torch.float32)
        pooled = torch.einsum("kn,cnd->ckd", weights, feats.float()).to(feats.dtype)
        anchors = pool_anchors(h, w, k).to(feats.device).expand(tokens.num_crops, -1)
        return Selection(features=pooled, anchors=anchors)

    def _select_valid_rectangles(self, tokens: VisualTokens) -> Selection:
        """Crops whose valid tokens form a rectangle (e.g. LLaVA-NeXT sub-images cut by unpadding): pool that
        rectangle to the budget of its valid tokens; cells anchor at their centre in the full crop grid."""
        h, w = tokens.grid
        feats, valid = tokens.features, tokens.valid.view(-1, h, w)
        pooled, anchors = [], []
        for crop in range(tokens.num_crops):
            rows = valid[crop].any(1).nonzero().squeeze(1)
            cols = valid[crop].any(0).nonzero().squeeze(1)
            if len(rows) == 0:
                pooled.append(feats.new_zeros(0, feats.shape[-1]))
                anchors.append(torch.zeros(0, dtype=torch.long, device=feats.device))
                continue
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            if int(valid[crop, r0:r1, c0:c1].sum()) != (r1 - r0) * (c1 - c0):
                raise ValueError("pool needs each crop's valid tokens to form a rectangle")
            k = self.keep_count((r1 - r0) * (c1 - c0))
            region = feats[crop].view(h, w, -1)[r0:r1, c0:c1].reshape((r1 - r0) * (c1 - c0), -1)
            weights = pool_weights(r1 - r0, c1 - c0, k).to(device=feats.device, dtype=torch.float32)
            pooled.append((weights @ region.float()).to(feats.dtype))
            local = pool_anchors(r1 - r0, c1 - c0, k).to(feats.device)
            anchors.append((r0 + local // (c1 - c0)) * w + c0 + local % (c1 - c0))
        counts = [len(a) for a in anchors]
        width = max(counts)
        features = feats.new_zeros(tokens.num_crops, width, feats.shape[-1])
        anchor_rows = torch.full((tokens.num_crops, width), tokens.num_tokens, dtype=torch.long, device=feats.device)
        for crop, (f, a) in enumerate(zip(pooled, anchors, strict=True)):
            features[crop, : len(f)], anchor_rows[crop, : len(a)] = f, a
        return Selection(features=features, anchors=anchor_rows, counts=counts)
