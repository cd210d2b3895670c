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
