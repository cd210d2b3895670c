"""Where a prompt's video frames sit, for attention patterns that follow frames (sparse prefill's "grid").

A family's videos reach the LLM as placeholder runs: one run per video cut into equal frames (LLaVA-NeXT-Video,
Video-LLaVA, OneVision, Qwen2-VL), one run per frame with text between the runs (Qwen3-VL's `<t seconds>`
timestamps: `frame_runs`), or image runs labelled "FrameN:" (InternVL, whose adapter overrides `frame_spans`).
Pure functions of the prompt; the adapter (`Adapter.frame_spans`) says which placeholders are its videos'.

A stage that runs at every call (FrameFusion's call points) finds them without a read of its own: `run_edges`
puts every row's video runs in a fixed-shape [B, 1 + 2W] tensor the call path reads with the prompt's layout (its
one read, `CallPath.note_layout`), `frame_columns` cuts them into frames on the host, and `slot_table` builds the
frames' slot table there and moves it to the device in one copy.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import torch

from vtoken.geometry.tables import on_device

# per row, per video, per frame: its (start, end) columns, on the host
Columns = list[list[list[tuple[int, int]]]]


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
    if isinstance(grid, torch.Tensor):  # one read (the model's own code reads it too)
        return [int(t) for t in grid[:, 0].tolist()]
    if grid is not None:
        return [int(row[0]) for row in grid]
    pixels = kwargs.get("pixel_values_videos")
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 5:
        return [pixels.shape[1]] * pixels.shape[0]
    return None


def run_edges(is_placeholder: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1 + 2 width] int64 on the mask's device, without a sync: per row of `is_placeholder` [B, L], its number
    of runs of True, then the (start) and (end) columns of its first `width` runs, -1 past them (a fixed burst of
    kernels: the runs' count per row is read with the table, never before)."""
    batch, length = is_placeholder.shape
    edges = torch.nn.functional.pad(is_placeholder.long(), (1, 1)).diff(dim=1)  # [B, L + 1]: +1 start, -1 end
    found = []
    for flags in (edges == 1, edges == -1):
        rank = flags.long().cumsum(1) - 1
        target = torch.where(flags & (rank < width), rank, width)  # runs past `width`: the spare column
        slots = torch.full((batch, width + 1), -1, dtype=torch.long, device=edges.device)
        found.append(slots.scatter_(1, target, torch.arange(length + 1, device=edges.device).expand(batch, -1)))
    return torch.cat([(edges == 1).sum(1, keepdim=True), found[0][:, :width], found[1][:, :width]], 1)


def runs_of_edges(rows: Sequence[Sequence[int]]) -> list[tuple[int, int, int]] | None:
    """(row, start, end) of every run, row-major, from `run_edges` rows read to the host; None where a row holds
    more runs than the table's width (more than the call's videos make: no match)."""
    runs = []
    for row, values in enumerate(rows):
        width = (len(values) - 1) // 2
        count = values[0]
        if count > width:
            return None
        runs += [(row, values[1 + k], values[1 + width + k]) for k in range(count)]
    return runs


def frame_columns(runs: list[tuple[int, int, int]], batch: int, frames: list[int], frame_runs: bool) -> Columns | None:
    """Per row of a prompt whose video placeholder runs are `runs` ((row, start, end), row-major), per video, the
    (start, end) columns of its frames, on the host; None when the runs do not match `frames` (the call's videos'
    frames, in order; a batch expanded for beams repeats them). `frame_runs`: every frame is its own run (Qwen3-VL),
    else each video is one run cut into equal frames."""
    spans: Columns = [[] for _ in range(batch)]
    taken, item = 0, 0
    while taken < len(runs):
        count = frames[item % len(frames)]
        if frame_runs:  # `count` runs, one frame each, in one row
            mine = runs[taken : taken + count]
            if len(mine) < count or len({row for row, _, _ in mine}) != 1:
                return None
            columns = [(start, end) for _, start, end in mine]
            taken += count
        else:  # one run cut into `count` equal frames
            row, start, end = runs[taken]
            step = (end - start) // count
            if step < 1:
                return None
            columns = [(start + k * step, start + (k + 1) * step) for k in range(count)]
            mine = [runs[taken]]
            taken += 1
        spans[mine[0][0]].append(columns)
        item += 1
    return spans if item % len(frames) == 0 else None


def frame_spans(is_video: torch.Tensor, frames: list[int], frame_runs: bool) -> list[list[torch.Tensor]] | None:
    """Per row of a prompt whose video placeholders are `is_video` [B, L], per video, [F, 2] (start, end) columns
    of its frames (`frame_columns` of its placeholder runs, read here); None when they do not match `frames`."""
    columns = frame_columns(placeholder_runs(is_video), is_video.shape[0], frames, frame_runs)
    return None if columns is None else [[torch.tensor(video) for video in row] for row in columns]


def slot_table(spans: Sequence[Sequence[Any]], batch: int, length: int, device: torch.device | str):
    """Where the frames' tokens are: spans[b][v] the (start, end) columns of the frames of row b's video v (host
    pairs, `frame_columns`, or an [F, 2] host tensor). Returns (slots [B, L] int64: a token's index inside its
    frame, -1 outside every frame: text, timestamps, InternVL's frame labels, OneVision's newline; videos [B, L]
    int64: its video, -1 outside; counts: candidates per row, host). Built on the host from host integers (a slice
    per frame, no tensor op), moved to `device` in one copy (`on_device`: non-blocking from pinned memory on CUDA)."""
    plane = batch * length
    table = array.array("q", [-1]) * (2 * plane)  # [2, B, L]: slots, then videos
    counts = [0] * batch
    for row, items in enumerate(spans):
        for video, frames in enumerate(items):
            pairs = frames.tolist() if isinstance(frames, torch.Tensor) else frames
            for start, end in pairs:
                size, first = end - start, row * length + start
                table[first : first + size] = array.array("q", range(size))
                table[plane + first : plane + first + size] = array.array("q", [video]) * size
                counts[row] += size
    moved = on_device(table, device).view(2, batch, length)
    return moved[0], moved[1], counts
