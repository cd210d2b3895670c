"""Where a prompt's video frames sit, for attention patterns that follow frames (sparse prefill's "grid").

A family's videos reach the LLM as placeholder runs: one run per video cut into equal frames (LLaVA-NeXT-Video,
Video-LLaVA, OneVision, Qwen2-VL), one run per frame with text between the runs (Qwen3-VL's `<t seconds>`
timestamps: `frame_runs`), or image runs labelled "FrameN:" (InternVL, whose adapter overrides `frame_spans`).
Pure functions of the prompt; the adapter (`Adapter.frame_spans`) says which placeholders are its videos'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def placeholder_runs(is_placeholder: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every contiguous run of True in [B, L], in row-major order."""
    flags = torch.nn.functional.pad(is_placeholder.long().cpu(), (1, 1))
    edges = flags.diff(dim=1)
    starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()
    return [(row, start, end) for (row, start), (_, end) in zip(starts, ends, strict=True)]


def host_placeholder_runs(rows: list[list[int]], placeholder_id: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every contiguous run of `placeholder_id` in a prompt read to the host, row-major."""
    runs = []
    for row, ids in enumerate(rows):
        start = None
        for column, token in enumerate([*ids, None]):
            if token == placeholder_id and start is None:
                start = column
            elif token != placeholder_id and start is not None:
                runs.append((row, start, column))
                start = None
    return runs


def video_frames(kwargs: dict[str, Any]) -> list[int] | None:
    """Frames (temporal units) of every video of a call's inputs, in order; None: no video."""
    grid = kwargs.get("video_grid_thw")
    if grid is not None:
        return [int(t) for t in torch.as_tensor(grid)[:, 0].tolist()]
    pixels = kwargs.get("pixel_values_videos")
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 5:
        return [pixels.shape[1]] * pixels.shape[0]
    return None


def frame_spans(is_video: torch.Tensor, frames: list[int], frame_runs: bool) -> list[list[torch.Tensor]] | None:
    """Per row of a prompt whose video placeholders are `is_video` [B, L], per video, [F, 2] (start, end) columns
    of its frames; None when the prompt's video runs do not match `frames` (the call's videos' frames, in order; a
    batch expanded for beams repeats them). `frame_runs`: every frame is its own run (Qwen3-VL), else each video is
    one run cut into equal frames."""
    runs = placeholder_runs(is_video)
    spans: list[list[torch.Tensor]] = [[] for _ in range(is_video.shape[0])]
    taken, item = 0, 0
    while taken < len(runs):
        count = frames[item % len(frames)]
        if frame_runs:  # `count` runs, one frame each, in one row
            mine = runs[taken : taken + count]
            if len(mine) < count or len({row for row, _, _ in mine}) != 1:
                return None
            columns = torch.tensor([[start, end] for _, start, end in mine])
            taken += count
        else:  # one run cut into `count` equal frames
            row, start, end = runs[taken]
            step = (end - start) // count
            if step < 1:
                return None
            first = torch.arange(count) * step + start
            columns = torch.stack([first, first + step], 1)
            mine = [runs[taken]]
            taken += 1
        spans[mine[0][0]].append(columns)
        item += 1
    return spans if item % len(frames) == 0 else None


def slot_table(spans: Sequence[Sequence[torch.Tensor]], batch: int, length: int, device: torch.device | str):
    """Where the frames' tokens are: spans[b][v] the [F, 2] (start, end) columns of the frames of row b's video v
    (`frame_spans`). Returns (slots [B, L] int64: a token's index inside its frame, -1 outside every
    frame: text, timestamps, InternVL's frame labels, OneVision's newline; videos [B, L] int64: its video, -1
    outside; counts: candidates per row, host). Built on the host from host facts (a few ops per video), copied
    to `device` once."""
    table = torch.full((2, batch, length), -1, dtype=torch.long)
    for row, items in enumerate(spans):
        for video, frames in enumerate(items):
            frames = frames.cpu().long()
            sizes = frames[:, 1] - frames[:, 0]
            first = frames[:, 0].repeat_interleave(sizes)
            slot = torch.arange(int(sizes.sum())) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
            table[0, row, first + slot] = slot
            table[1, row, first + slot] = video
    counts = (table[0] >= 0).sum(1).tolist()
    device = torch.device(device)
    moved = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
    return moved[0], moved[1], counts
