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

Every video of a call is scored at once on the device (a video's sums over its frames are masked sums over all
frames, so they do not depend on the other videos); the frame budgets are read back once, the one host sync the
definition costs (`video_scores` is the per-video reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..errors import VTokenError
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, image_slots, topk_per_crop

SCALES = (1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)
TEMPERATURE = 0.01


def gaussian_similarity(tokens: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """sum over SCALES of exp(-|x - c|^2 / (2a)): tokens [..., D], centre broadcastable -> [...]."""
    squared = ((tokens - centre) ** 2).sum(-1)
    # 1 / (2a) for a = 1/8 .. 2 are the powers of two 4 .. 1/4: multiplying by them is dividing by 2a, exactly
    inverse = torch.pow(2.0, 2 - torch.arange(len(SCALES), device=squared.device, dtype=squared.dtype))
    return torch.exp(-squared[..., None] * inverse).sum(-1)


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
        projected = tokens.signals["projected"].float()  # [F, tpf, D], the frames of every video
        frames, per_frame, dim = projected.shape
        device = projected.device
        # a video's frames share its first frame's index (no `image_index`: all frames are one video)
        slot = image_slots(tokens, device) if tokens.image_index is not None else projected.new_zeros(frames).long()
        member = slot[None, :] == torch.arange(frames, device=device)[:, None]  # [video slot, frame]

        def over_video(values: torch.Tensor) -> torch.Tensor:
            """[F, ...] per-frame values -> [F, ...] their sum over each frame's video (frames in order)."""
            mask = member.view(frames, frames, *([1] * (values.dim() - 1)))
            return torch.where(mask, values[None], 0).sum(1)[slot]

        tokens_of_video = over_video(torch.full((frames,), per_frame, device=device)).float()  # [F]
        mean = over_video(projected.sum(1)) / tokens_of_video[:, None]
        variance = over_video(((projected - mean[:, None]) ** 2).sum(1)) / tokens_of_video[:, None]
        channels = variance.argsort(dim=-1, stable=True)[:, : dim // 2]  # the lowest-variance half (ties: lower)
        unit = F.normalize(projected.gather(2, channels[:, None].expand(-1, per_frame, -1)), dim=-1)
        to_video = gaussian_similarity(unit, (over_video(unit.sum(1)) / tokens_of_video[:, None])[:, None])
        to_frame = gaussian_similarity(unit, unit.mean(dim=1, keepdim=True))
        uniqueness = -to_video.mean(-1)  # [F]
        top = torch.where(member, uniqueness[None], float("-inf")).amax(1)[slot]
        weight = torch.exp((uniqueness - top) / TEMPERATURE)
        p = weight / over_video(weight)
        frames_of_video = over_video(torch.ones_like(p))
        scale = (self.rate(per_frame) * (1 + p - over_video(p) / frames_of_video)).clamp(max=1.0)
        kept = (scale * per_frame).round().long().clamp(min=1)
        # rank by ascending similarity, the lower index first on ties (topk keeps the largest rank)
        order = (to_video + to_frame).argsort(dim=-1, stable=True)
        rank = torch.arange(per_frame, 0, -1, device=device, dtype=torch.float).expand_as(order)
        scores = torch.empty_like(rank).scatter_(1, order, rank)
        return topk_per_crop(scores, kept.tolist(), kept)  # the one read: frame budgets follow the data
