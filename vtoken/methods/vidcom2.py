"""VidCom2: video token compression by frame uniqueness and token distinctiveness (Liu et al., "Video Compression
Commander: Plug-and-Play Inference Acceleration for Video Large Language Models", EMNLP 2025; official code
xuyang-liu16/VidCom2).

For one video's projected tokens, F frames of tpf tokens each, and the retention ratio R (`budget`):

1. Keep the 50 % of channels (int(D / 2)) with the lowest variance over all the video's tokens; L2-normalise
   every token over those channels.
2. Centres: the video mean and each frame's mean. Similarity of token x to centre c:
   g(x, c) = sum over a in {1/8, 1/4, 1/2, 1, 2} of exp(-|x - c|^2 / (2a)).
3. Frame budgets: u_f = -mean of g(x, video centre) over frame f; p = softmax((u - max u) / 0.01);
   scale_f = min(1, R * (1 + p_f - mean p)); k_f = max(1, round(scale_f * tpf)) with `torch.round` (half to
   even, as the official code: 2.5 -> 2).
4. Frame f keeps its k_f tokens with the *smallest* g(x, video centre) + g(x, frame centre) (the most distinct),
   ascending (ties: the lower index), frames in order.

The count depends on the data (the frame budgets); planned_count is None. Videos only: images are refused when
the call starts. A count budget is tokens per frame on average: R = count / tpf (at most 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..errors import VTokenError
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop

SCALES = (1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)
TEMPERATURE = 0.01


def gaussian_similarity(tokens: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """sum over SCALES of exp(-|x - c|^2 / (2a)): tokens [..., D], centre broadcastable -> [...]."""
    squared = ((tokens - centre) ** 2).sum(-1)
    return sum(torch.exp(-squared / (2 * a)) for a in SCALES)


def video_scores(tokens: torch.Tensor, rate: float) -> tuple[torch.Tensor, list[int]]:
    """One video's tokens [F, tpf, D] -> (scores [F, tpf], lower is kept first; tokens kept per frame)."""
    frames, per_frame, dim = tokens.shape
    flat = tokens.float().reshape(frames * per_frame, dim)
    variance = flat.var(dim=0, unbiased=False)
    channels = variance.argsort(stable=True)[: dim // 2]  # the lowest-variance half (ties: lower channel)
    unit = F.normalize(flat[:, channels], dim=-1).view(frames, per_frame, -1)
    to_video = gaussian_similarity(unit, unit.mean(dim=(0, 1), keepdim=True))
    to_frame = gaussian_similarity(unit, unit.mean(dim=1, keepdim=True))
    uniqueness = -to_video.mean(-1)
    p = torch.softmax((uniqueness - uniqueness.max()) / TEMPERATURE, dim=0)
    scale = (rate * (1 + p - p.mean())).clamp(max=1.0)
    kept = (scale * per_frame).round().long().clamp(min=1).tolist()
    return to_video + to_frame, kept


@dataclass
class VidCom2(EncoderMethod):
    """`budget`: the retention ratio R of each video (official default 0.25), or tokens per frame on average."""

    budget: Budget = 0.25
    scope: str = "image"

    name = "vidcom2"
    requires = ("projected",)
    modalities = ("video",)
    scopes = ("image",)  # frame budgets are shared out over each video

    def planned_count(self, n: int) -> int | None:
        return None  # frame budgets follow the frames' uniqueness

    def rate(self, per_frame: int) -> float:
        return self.budget if isinstance(self.budget, float) else min(1.0, self.budget / per_frame)

    def select(self, tokens: VisualTokens) -> Selection:
        if tokens.valid is not None:
            raise VTokenError("vidcom2 takes whole video frames; these crops have tokens that never reach the LLM")
        projected = tokens.signals["projected"]
        videos = tokens.image_index if tokens.image_index is not None else torch.zeros(tokens.num_crops)
        scores = torch.empty(tokens.num_crops, tokens.num_tokens, device=projected.device)
        counts = [0] * tokens.num_crops
        for video in videos.unique().tolist():
            frames = (videos == video).nonzero().squeeze(1).tolist()  # in order
            score, kept = video_scores(projected[frames], self.rate(tokens.num_tokens))
            # rank by ascending similarity, the lower index first on ties (topk keeps the largest rank)
            order = score.argsort(dim=-1, stable=True)
            rank = torch.arange(tokens.num_tokens, 0, -1, device=score.device, dtype=torch.float).expand_as(order)
            scores[frames] = torch.empty_like(score).scatter_(1, order, rank)
            for frame, k in zip(frames, kept, strict=True):
                counts[frame] = k
        return topk_per_crop(scores, counts)
