"""Images and video frames from files, plus a generated example scene (no files or network needed)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from .errors import InputError


def example_image(size: int = 448) -> Image.Image:
    """A deterministic scene: coloured shapes of several sizes on a gradient background."""
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    for y in range(size):  # vertical sky-to-ground gradient
        shade = int(200 * y / size)
        draw.line([(0, y), (size, y)], fill=(40 + shade // 3, 90 + shade // 2, 220 - shade))
    s = size / 448
    draw.ellipse([40 * s, 40 * s, 160 * s, 160 * s], fill=(220, 30, 30))
    draw.rectangle([260 * s, 60 * s, 400 * s, 200 * s], fill=(30, 170, 60))
    draw.polygon([(120 * s, 400 * s), (220 * s, 240 * s), (320 * s, 400 * s)], fill=(240, 210, 40))
    draw.ellipse([360 * s, 330 * s, 390 * s, 360 * s], fill=(250, 250, 250))
    return image


def load_image(path: str | Path) -> Image.Image:
    """An RGB PIL image from a file, with a clear error if it cannot be read."""
    try:
        return Image.open(path).convert("RGB")
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read image {str(path)!r}: {err}; expected a PNG/JPEG/GIF/... file") from err
