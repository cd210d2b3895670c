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

from ..budget import Budget, tokens_to_keep, tokens_to_keep_tensor
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


@lru_cache(maxsize=64)
@torch.inference_mode(False)
def pool_constants(height: int, width: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`pool_weights` (fp32) and `pool_anchors` kept on `device`: copied there once, not at every call."""
    return pool_weights(height, width, k).to(device), pool_anchors(height, width, k).to(device)


def device_cells(height: torch.Tensor, width: torch.Tensor, k: torch.Tensor, count: int) -> torch.Tensor:
    """`_cells` of C rectangles at once, on their device: height, width, k [C] (int64, >= 0) -> [C, count, 4] (row0,
    row1, col0, col1) of every rectangle's first `count` cells in raster order (cells past k[c] are empty: row0 =
    row1).

    The same integer and IEEE double arithmetic as `_cells`: rows = max(1, min(h, k, round(sqrt(k * h / w)))), then
    the fewest rows >= that for which no band holds more cells than the grid has columns (ceil(k / w)). Integer
    division of non-negative integers (`//` floors, a ceiling is (a + b - 1) // b) matches Python's.
    """
    h, w, k = height[:, None], width[:, None].clamp(min=1), k[:, None]
    rows = torch.round(torch.sqrt((k * h).double() / w)).long()
    rows = torch.maximum(rows.minimum(h).minimum(k).clamp(min=1), (k + w - 1) // w)
    per_band = (k // rows).clamp(min=1)  # k >= rows: every band holds per_band or per_band + 1 cells
    wider = k - (k // rows) * rows  # the first `wider` bands hold one cell more
    cell = torch.arange(count, device=height.device)
    in_wider = wider * (per_band + 1)
    first = cell < in_wider
    band = torch.where(first, cell // (per_band + 1), wider + (cell - in_wider) // per_band)
    column = cell - torch.where(first, band * (per_band + 1), in_wider + (band - wider) * per_band)
    columns = per_band + (band < wider)
    row0, row1 = band * h // rows, ((band + 1) * h + rows - 1) // rows
    col0, col1 = column * w // columns, ((column + 1) * w + columns - 1) // columns
    return torch.stack([row0, torch.where(cell < k, row1, row0), col0, col1], dim=-1)


@lru_cache(maxsize=16, typed=True)  # typed: the count 1 and the fraction 1.0 are different budgets
@torch.inference_mode(False)
def rectangle_cells(height: int, width: int, budget: Budget, device: torch.device) -> torch.Tensor:
    """[(height + 1) * (width + 1), K, 4] the cells (`device_cells`) of every h x w rectangle with h <= height and
    w <= width, row h * (width + 1) + w, pooled to its budget (K: the budget of the whole grid): computed on the
    device once per grid and budget, then looked up."""
    h = torch.arange(height + 1, device=device).repeat_interleave(width + 1)
    w = torch.arange(width + 1, device=device).repeat(height + 1)
    return device_cells(h, w, tokens_to_keep_tensor(budget, h * w), tokens_to_keep(budget, height * width))


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
        weights, anchors = pool_constants(h, w, k, feats.device)
        pooled = torch.bmm(weights.expand(tokens.num_crops, -1, -1), feats.float()).to(feats.dtype)
        return Selection(features=pooled, anchors=anchors.expand(tokens.num_crops, -1))

    def _select_valid_rectangles(self, tokens: VisualTokens) -> Selection:
        """Crops whose valid tokens form a rectangle (e.g. LLaVA-NeXT sub-images cut by unpadding): pool that
        rectangle to the budget of its valid tokens; cells anchor at their centre in the full crop grid.

        All crops at once on the device: every rectangle's bounds and cells are computed there (`device_cells`),
        the output width from the host-side valid counts. Without `valid_counts` those are read back once, and
        the rectangles checked with them; an adapter that gives `valid_counts` vouches for its rectangles.
        """
        h, w = tokens.grid
        feats, crops, n = tokens.features, tokens.num_crops, tokens.num_tokens
        device = feats.device
        valid = tokens.valid.to(device).view(crops, h, w)
        ys, xs = torch.arange(h, device=device), torch.arange(w, device=device)
        rows, cols = valid.any(2), valid.any(1)  # [C, H], [C, W]
        r0, c0 = torch.where(rows, ys, h).amin(1), torch.where(cols, xs, w).amin(1)  # the first valid row / column
        r1, c1 = torch.where(rows, ys + 1, 0).amax(1), torch.where(cols, xs + 1, 0).amax(1)  # past the last
        height, width = (r1 - r0).clamp(min=0), (c1 - c0).clamp(min=0)  # 0 x 0 for a crop with no valid token
        if tokens.valid_counts is None:
            sizes, areas = torch.stack([valid.flatten(1).sum(1), height * width]).tolist()  # one read of both
            if sizes != areas:
                raise ValueError("pool needs each crop's valid tokens to form a rectangle")
        else:
            sizes = tokens.valid_counts
        counts = [self.keep_count(v) if v else 0 for v in sizes]
        count = max(counts, default=0)
        cells = rectangle_cells(h, w, self.budget, device)[height * (w + 1) + width, :count]  # local to each
        y0, y1 = r0[:, None] + cells[..., 0], r0[:, None] + cells[..., 1]
        x0, x1 = c0[:, None] + cells[..., 2], c0[:, None] + cells[..., 3]
        in_rows = (ys >= y0[..., None]) & (ys < y1[..., None])  # [C, count, H]
        in_cols = (xs >= x0[..., None]) & (xs < x1[..., None])  # [C, count, W]
        area = ((y1 - y0) * (x1 - x0)).clamp(min=1)
        weights = (in_rows[..., :, None] & in_cols[..., None, :]).flatten(2).float() / area[..., None]
        pooled = torch.bmm(weights, feats.float()).to(feats.dtype)
        anchors = torch.where(cells[..., 0] < cells[..., 1], (y0 + y1 - 1) // 2 * w + (x0 + x1 - 1) // 2, n)
        return Selection(features=pooled, anchors=anchors, counts=counts)
