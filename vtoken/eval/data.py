"""The task pack's data: vtoken-mini's procedural VQA (`vtoken.mini.vqa`), written on first use into a cache.

Everything is a pure function of the scene index, so the cache can be deleted at any time: questions are written
once per dataset (a JSONL file), images and video clips one by one when a sample first asks for them. Writes are
atomic (a temporary file renamed into place), so ranks of a multi-process run can share the cache.

Cache: $VTOKEN_CACHE, else $XDG_CACHE_HOME/vtoken, else ~/.cache/vtoken; below it `eval/<dataset>-v<version>/`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from ..mini import vqa

VERSION = 1
SPLIT = "test"
IMAGE_QUESTIONS = 1000  # scenes 0..999 of the test split, scene i asks question type i mod 5: 200 of each
VIDEO_QUESTIONS = 100
VIDEO_FRAMES = 8
VIDEO_FPS = 4


def cache_root() -> Path:
    """Where generated data lives (see the module docstring)."""
    if os.environ.get("VTOKEN_CACHE"):
        return Path(os.environ["VTOKEN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vtoken"


def dataset_dir(modality: str) -> Path:
    """The cache directory of the image ("image") or video ("video") dataset."""
    return cache_root() / "eval" / f"vtoken_mini_vqa_{modality}-v{VERSION}"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` then rename tmp to `path`: readers never see a partial file; a concurrent writer's identical
    file simply wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def questions(modality: str) -> list[dict]:
    """The dataset's rows (generated into the cache on first use): index, kind, question, answer, and the file
    name of its image or video (relative to `dataset_dir(modality)`)."""
    if modality not in ("image", "video"):
        raise ValueError(f"modality {modality!r}; accepted: image, video")
    path = dataset_dir(modality) / "questions.jsonl"
    if not path.exists():
        count = IMAGE_QUESTIONS if modality == "image" else VIDEO_QUESTIONS
        ext = "png" if modality == "image" else "mp4"
        rows = [
            {"index": index, "kind": q.kind, "question": q.text, "answer": q.answer, "file": f"{index:05d}.{ext}"}
            for index, q in vqa.question_set(SPLIT, count)
        ]
        text = "".join(json.dumps(row) + "\n" for row in rows)
        _atomic_write(path, lambda tmp: tmp.write_text(text))
    return [json.loads(line) for line in path.read_text().splitlines()]


def image_path(row: dict) -> Path:
    """The PNG of `row`'s scene, rendered into the cache if missing."""
    path = dataset_dir("image") / row["file"]
    if not path.exists():
        image = vqa.render(vqa.scene(SPLIT, row["index"]))
        _atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
    return path


def clip_frames(index: int) -> list[Image.Image]:
    """The frames of clip `index`: its scene under a brightness that drifts from frame to frame (the objects stay
    put, so every question about the scene holds in every frame)."""
    import numpy as np

    base = np.asarray(vqa.render(vqa.scene(SPLIT, index)), dtype=np.int16)
    shifts = np.linspace(-12, 12, VIDEO_FRAMES).round().astype(np.int16)
    return [Image.fromarray(np.clip(base + s, 0, 255).astype(np.uint8)) for s in shifts]


def write_mp4(frames: list[Image.Image], path: Path, fps: int = VIDEO_FPS) -> None:
    """Encode RGB `frames` as an H.264 MP4 (PyAV)."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10"}  # near-lossless: colour questions stay answerable
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())


def video_path(row: dict) -> Path:
    """The MP4 of `row`'s clip, encoded into the cache if missing."""
    path = dataset_dir("video") / row["file"]
    if not path.exists():
        frames = clip_frames(row["index"])
        _atomic_write(path, lambda tmp: write_mp4(frames, tmp))
    return path
