"""Pictures of what a method kept: the image as the model saw it, dropped patches dimmed."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def model_view(pixel_values: torch.Tensor, mean, std) -> Image.Image:
    """Undo the processor's normalisation of one image: pixel_values [3, H, W] -> RGB PIL image."""
    mean = torch.as_tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32).view(3, 1, 1)
    rgb = (pixel_values.detach().float().cpu() * std + mean).clamp(0, 1)
    return Image.fromarray((rgb.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


def kept_overlay(
    image: Image.Image, kept: torch.Tensor | None, grid: tuple[int, int], dim: float = 0.25
) -> Image.Image:
    """`image` with the patches not in `kept` (raster indices into a grid[0] x grid[1] grid) darkened.

    kept=None (a merging method) returns the image unchanged.
    """
    if kept is None:
        return image.copy()
    rows, cols = grid
    keep = torch.zeros(rows * cols, dtype=torch.bool)
    keep[kept.cpu()] = True
    mask = keep.view(rows, cols).numpy().astype(np.float32)
    # index each pixel by the patch it falls in
    ys = (np.arange(image.height) * rows) // image.height
    xs = (np.arange(image.width) * cols) // image.width
    scale = mask[ys][:, xs]
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    shaded = pixels * (dim + (1 - dim) * scale[..., None])
    return Image.fromarray(shaded.round().astype(np.uint8))
