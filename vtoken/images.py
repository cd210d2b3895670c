"""Images and video frames from files, plus a generated example scene (no files or network needed)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageSequence

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
    if isinstance(path, (str, Path)) and not Path(path).is_file():
        raise InputError(f"cannot read image {str(path)!r}: no such file")
    try:
        return Image.open(path).convert("RGB")
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read image {str(path)!r}: {err}; expected a PNG/JPEG/GIF/... file") from err


def example_clip(frames: int = 8, size: int = 224) -> list[Image.Image]:
    """A deterministic clip: the example scene panned sideways, one step per frame."""
    scene = example_image(size * 2)
    step = size // max(frames, 1)
    return [scene.crop((i * step, size // 2, i * step + size, size // 2 + size)) for i in range(frames)]


def load_video(path: str | Path, frames: int = 8) -> list[Image.Image]:
    """`frames` RGB frames sampled uniformly from a GIF/animated image (Pillow) or a video file (PyAV)."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise InputError(f"frames={frames!r}; expected an int >= 1")
    if isinstance(path, (str, Path)) and not Path(path).is_file():  # before blaming a missing decoder
        raise InputError(f"cannot read video {str(path)!r}: no such file")
    try:
        with Image.open(path) as clip:
            decoded = [frame.convert("RGB") for frame in ImageSequence.Iterator(clip)]
    except (OSError, ValueError):
        try:
            import av
        except ImportError as err:
            raise InputError(f"cannot read {str(path)!r} as an animated image; for MP4 and other video files "
                             "install PyAV (pip install av)") from err  # fmt: skip
        try:
            with av.open(str(path)) as container:
                decoded = [frame.to_image().convert("RGB") for frame in container.decode(video=0)]
        except (OSError, ValueError, av.error.FFmpegError) as err:
            raise InputError(f"cannot read video {str(path)!r}: {err}") from err
    if not decoded:
        raise InputError(f"video {str(path)!r} has no frames")
    picks = [round(i * (len(decoded) - 1) / max(frames - 1, 1)) for i in range(min(frames, len(decoded)))]
    return [decoded[i] for i in picks]
