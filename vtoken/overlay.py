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


# a few distinct tints for merged groups (neighbouring groups differ)
GROUP_TINTS = np.array([(230, 80, 60), (60, 140, 230), (240, 200, 40), (90, 200, 110), (190, 90, 220)], np.float32)


def _cell_of_pixel(size: int, cells: int) -> np.ndarray:
    return (np.arange(size) * cells) // size


def token_picture(
    image: Image.Image,
    grid: tuple[int, int],
    keep: np.ndarray | None = None,
    groups: list[np.ndarray] | None = None,
    dim: float = 0.25,
    tint: float = 0.35,
) -> Image.Image:
    """`image` seen as a grid[0] x grid[1] token grid: cells where `keep` [rows * cols] is False darkened; cells of
    each of `groups` (raster cell indices merged into one token) tinted, one colour per group, with a line where
    neighbouring cells belong to different groups."""
    rows, cols = grid
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32).copy()
    ys, xs = _cell_of_pixel(image.height, rows), _cell_of_pixel(image.width, cols)
    cell = ys[:, None] * cols + xs[None, :]  # [H, W] token index of every pixel
    if groups:
        group_of = np.full(rows * cols, -1)
        for g, members in enumerate(groups):
            group_of[np.asarray(members, dtype=np.int64)] = g
        owner = group_of[cell]
        colour = GROUP_TINTS[_colour_groups(group_of.reshape(rows, cols), len(groups))]
        inside = owner >= 0
        pixels[inside] = (1 - tint) * pixels[inside] + tint * colour[owner[inside]]
        edge = np.zeros_like(inside)
        edge[1:, :] |= (owner[1:, :] != owner[:-1, :]) & (inside[1:, :] | inside[:-1, :])
        edge[:, 1:] |= (owner[:, 1:] != owner[:, :-1]) & (inside[:, 1:] | inside[:, :-1])
        pixels[edge] = 255.0
    if keep is not None:
        scale = np.where(np.asarray(keep, dtype=bool)[cell], 1.0, dim)
        pixels *= scale[..., None]
    return Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8))


def mosaic(tiles: list[list[Image.Image]], gap: int = 4, background=(255, 255, 255)) -> Image.Image:
    """Rows of images side by side (top-aligned), `gap` pixels apart."""
    tiles = [row for row in tiles if row]
    width = max(sum(t.width for t in row) + gap * (len(row) - 1) for row in tiles)
    height = sum(max(t.height for t in row) for row in tiles) + gap * (len(tiles) - 1)
    out = Image.new("RGB", (width, height), background)
    y = 0
    for row in tiles:
        x = 0
        for tile in row:
            out.paste(tile, (x, y))
            x += tile.width + gap
        y += max(t.height for t in row) + gap
    return out


def _colour_groups(owner: np.ndarray, count: int) -> np.ndarray:
    """A palette index per group such that groups sharing an edge on the [rows, cols] `owner` grid differ
    (greedy colouring in group order; -1 cells belong to no group)."""
    neighbours: list[set[int]] = [set() for _ in range(count)]
    for a, b in ((owner[1:, :], owner[:-1, :]), (owner[:, 1:], owner[:, :-1])):
        touching = (a != b) & (a >= 0) & (b >= 0)
        for x, y in zip(a[touching].tolist(), b[touching].tolist(), strict=True):
            neighbours[x].add(y)
            neighbours[y].add(x)
    colours = np.zeros(count, dtype=np.int64)
    for g in range(count):
        used = {int(colours[n]) for n in neighbours[g] if n < g}
        colours[g] = next(c for c in range(len(GROUP_TINTS)) if c not in used) if len(used) < len(GROUP_TINTS) else 0
    return colours
