"""Where a prompt's video frames sit, for attention patterns that follow frames (sparse prefill's "grid").

A family's videos reach the LLM as placeholder runs: one run per video cut into equal frames (LLaVA-NeXT-Video,
Video-LLaVA, OneVision, Qwen2-VL), one run per frame with text between the runs (Qwen3-VL's `<t seconds>`
timestamps: `frame_runs`), or image runs labelled "FrameN:" (InternVL, which overrides `frame_spans`).
"""

from __future__ import annotations

from typing import Any, ClassVar

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


class FrameLayout:
    """Adapter mixin: the frames of a call's videos, and where they sit in the LLM's input."""

    # every frame (temporal unit) of a video is its own placeholder run, with text between runs (Qwen3-VL)
    frame_runs: ClassVar[bool] = False

    @property
    def takes_video(self) -> bool:
        """A video modality of its own, or videos as labelled image runs (`videos_as_image_runs`: InternVL)."""
        return any(m.name == "video" for m in self.modalities) or getattr(self, "videos_as_image_runs", False)

    def check_frame_layout(self) -> None:
        """Raise a VTokenError when this model's frames cannot be found in its prompts (see InternVL)."""

    def video_frames(self, kwargs: dict[str, Any]) -> list[int] | None:
        """Frames (temporal units) of every video of a call's inputs, in order; None: no video."""
        grid = kwargs.get("video_grid_thw")
        if grid is not None:
            return [int(t) for t in torch.as_tensor(grid)[:, 0].tolist()]
        pixels = kwargs.get("pixel_values_videos")
        if isinstance(pixels, torch.Tensor) and pixels.dim() == 5:
            return [pixels.shape[1]] * pixels.shape[0]
        return None

    def frame_spans(self, input_ids: torch.Tensor, frames: list[int] | None) -> list[list[torch.Tensor]] | None:
        """Per row of `input_ids` [B, L], per video, [F, 2] (start, end) columns of its frames; None when the
        prompt's video runs do not match `frames` (the call's videos, in order; a batch expanded for beams repeats
        them)."""
        video = next((m for m in self.modalities if m.name == "video"), None)
        if not frames or video is None:
            return None
        runs = placeholder_runs(input_ids == self.placeholder_id(video))
        spans: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
        taken, item = 0, 0
        while taken < len(runs):
            count = frames[item % len(frames)]
            if self.frame_runs:  # `count` runs, one frame each, in one row
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
