"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL geometry: an image or video of `grid_thw` = (t, h, w) patches reaches the LLM
as t frames (temporal patches) of (h / merge) x (w / merge) tokens, frame after frame, after the 2x2 patch merger.

Shared by the transformers adapters and the vLLM plugin: the token grid and count of an item, the offsets in an
item's placeholder run of the tokens a selection keeps (frame after frame), and the `grid_thw` of the smaller grid
a resizing method (Fourier-VLM) hands back, whose stock (t, h, w) positions the kept tokens then take.
"""

from __future__ import annotations

import torch

from .tables import padded_rows


def token_grid(grid_thw: tuple[int, int, int], merge: int) -> tuple[int, int]:
    """(rows, cols) of tokens of every frame of an item of `grid_thw` patches, after a merge x merge merger."""
    _, height, width = grid_thw
    return height // merge, width // merge


def item_tokens(grid_thw: tuple[int, int, int], merge: int) -> int:
    """Placeholders (tokens) of an item: frames x rows x cols."""
    rows, cols = token_grid(grid_thw, merge)
    return grid_thw[0] * rows * cols


def resized_grid_thw(frames: int, grid: tuple[int, int], merge: int) -> tuple[int, int, int]:
    """The `grid_thw` whose stock positions a smaller token grid (rows, cols) of `frames` frames takes."""
    return frames, grid[0] * merge, grid[1] * merge


def run_offsets(offsets: torch.Tensor, counts: list[int] | None, per_frame: int) -> torch.Tensor:
    """[sum of kept] offsets in an item's run of the tokens every frame keeps: `offsets` [F, k] within each frame
    of `per_frame` tokens (rows padded past `counts[f]`; None: every frame keeps k), frame after frame, in a fixed
    few kernels."""
    frames, width = offsets.shape
    shifted = offsets + torch.arange(frames, device=offsets.device)[:, None] * per_frame
    if counts is None:
        return shifted.flatten()
    return shifted.flatten()[padded_rows(counts, width, offsets.device)]


def window_index(grids: list[tuple[int, int, int]], merge: int, window: int, patch: int,
                 device: torch.device | str) -> torch.Tensor:  # fmt: skip
    """[sum of tokens] Qwen2.5-VL's window order of merge groups: the raster index (over all items, item after
    item) of each group as its encoder visits them, frame by frame, window by window (windows of
    `window // merge // patch` groups a side), row by row within a window; what transformers'
    `get_vision_window_index` returns, built from the host grids in a fixed few kernels."""
    side = window // merge // patch
    sizes, values, big = [], [], 1
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        windows = (rows // side + 1) * (cols // side + 1)
        sizes.append(t * rows * cols)
        big = max(big, t * windows * side * side)
    start = 0
    for (_, h, w), size in zip(grids, sizes, strict=True):
        rows, cols = h // merge, w // merge
        values += [start, rows * cols, cols, rows // side + 1, cols // side + 1]
        start += size
    from .tables import on_device, repeated

    item = repeated(list(range(len(grids))), sizes, device)
    first, frame, cols, window_rows, window_cols = on_device(values, device).view(-1, 5)[item].unbind(1)
    local = torch.arange(sum(sizes), device=device) - first
    y, x = (local % frame).div(cols, rounding_mode="floor"), local % cols
    window_of = local.div(frame, rounding_mode="floor") * window_rows + y.div(side, rounding_mode="floor")
    window_of = window_of * window_cols + x.div(side, rounding_mode="floor")
    key = item * big + window_of * side * side + (y % side) * side + x % side
    return key.argsort()
