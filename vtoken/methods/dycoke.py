"""DyCoke: dynamic compression of tokens for video LLMs (Tao et al., "DyCoke: Dynamic Compression of Tokens for
Fast Video Large Language Models", CVPR 2025; official code KD-TAO/DyCoke @dd74634, LLaVA-OneVision).

Two stages in one method:

1. Temporal token merging (encoder stage, on each video's projected, pooled frame tokens, tpf a frame). With
   m = int((1 - k) * tpf): for every pair of frames (2i, 2i + 1), frame 2i + 1 keeps the m tokens whose cosine
   similarity to the token at the same position of frame 2i is the lowest; then, for i in range(0, F - 4, 4),
   frame i + 2 is re-pruned the same way against frame i. Every other frame keeps all its tokens. Kept tokens
   stay in their spatial (ascending) order, frames in order. The counts depend on F and tpf only, so they are known
   before the encoder runs (`frame_counts`).
2. Decode-time KV selection (decode stage, from the first generated token): at each one-token decoding step, the
   new token's attention row at layer `layer - 1` (head mean, softmax over its whole causal row) is read over the
   video's tokens. If its cosine similarity with the previous step's row is below 0.9 (or there is none: the first
   step), layers `layer` and later attend, in this step, only to [prefix, the top int(V * (1 - p)) video tokens by
   that row, text and generated tokens]; otherwise this step attends to the whole cache (the official behaviour).
   The previous row is kept every step. The cache is never shrunk: the selection is a per-step mask.

Differences from the official code (docs/methods-llm-baselines.md says each): videos of <= 4 frames (the official
crashes) and odd frame counts (the official drops the last frame; here it keeps all its tokens) work; kept tokens are in
spatial order (the official: ascending similarity), ties go to the lower index; the state resets at every
`generate` call and every new prompt (the official keeps it across calls); batches, padding and beam search work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import VTokenError
from ..geometry.tables import on_device
from ..params import Layer, Real
from ..tokens import Selection, VisualTokens
from .base import PrefillMethod


def frame_counts(frames: int, per_frame: int, k: float) -> list[int]:
    """Tokens each of a video's `frames` frames keeps (tpf = `per_frame`): known before the encoder runs."""
    pruned = int((1 - k) * per_frame)  # the official float expression, truncated
    counts = [per_frame] * frames
    for i in range(0, frames - 1, 2):
        counts[i + 1] = pruned
    for i in range(0, frames - 4, 4):
        counts[i + 2] = pruned
    return counts


def reference_frames(frames: int) -> list[int]:
    """For every frame of a video of `frames` frames, the frame it is pruned against (-1: it keeps every token):
    frame 2i + 1 against 2i, then frame i + 2 against frame i for i in range(0, F - 4, 4) (host arithmetic)."""
    against = [-1] * frames
    for i in range(0, frames - 1, 2):  # pairs; an odd count's last frame has no partner and keeps all
        against[i + 1] = i
    for i in range(0, frames - 4, 4):  # frame i + 2 once more, against frame i (none for <= 4 frames)
        against[i + 2] = i
    return against


def temporal_merge(projected: torch.Tensor, videos: list[int], k: float) -> tuple[torch.Tensor, list[int]]:
    """DyCoke's stage 1 on every frame of a call at once: projected [C, T, D] (frames in order, `videos` [C] the
    host-side video of each). Returns kept [C, W] (each frame's kept positions ascending, padded with T) and the
    host counts. One cosine similarity over every (frame, reference frame) pair and one sort: no loop over frames
    on the device, no read of it."""
    crops, per_frame = projected.shape[:2]
    pruned = int((1 - k) * per_frame)  # the official float expression, truncated
    against = list(range(crops))  # each frame's reference crop (itself: keeps every token)
    full = [True] * crops
    start = 0
    for length in _run_lengths(videos):
        for frame, reference in enumerate(reference_frames(length)):
            if reference >= 0:
                against[start + frame], full[start + frame] = start + reference, False
        start += length
    counts = [per_frame if keep_all else pruned for keep_all in full]
    device = projected.device
    width = max(max(counts), 1)
    unit = F.normalize(projected.float(), dim=-1)
    against_t = on_device(against, device)  # one copy from pinned memory
    similarity = F.cosine_similarity(unit[against_t], unit, dim=-1)  # [C, T]
    lowest = similarity.argsort(dim=1, stable=True)[:, :pruned].sort(dim=1).values  # ties: the lower position
    lowest = F.pad(lowest, (0, width - pruned), value=per_frame)
    keeps_all = (against_t == torch.arange(crops, device=device))[:, None]  # a frame pruned against itself: none
    return torch.where(keeps_all, torch.arange(width, device=device), lowest), counts


def _run_lengths(videos: list[int]) -> list[int]:
    """Lengths of the runs of equal consecutive values (a video's frames follow each other)."""
    lengths: list[int] = []
    for i, video in enumerate(videos):
        if i and video == videos[i - 1]:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


@dataclass
class DyCoke(PrefillMethod):
    """`k`: the temporal merging ratio (share of a pruned frame's tokens dropped; official 0.7); `layer`: the first
    LLM layer whose attention a decoding step restricts (the row is read from `layer - 1`; official 3); `p`: the
    share of the video's tokens a re-selecting step drops from that attention (official 0.7)."""

    k: float = 0.7
    layer: int = 3
    p: float = 0.7

    name = "dycoke"
    stages = ("encoder", "decode")
    requires = ("projected",)
    modalities = ("video",)
    reads = ()
    positions = "original"  # nothing moves: the cache keeps every token, a step masks some out
    params = {
        "k": Real("[0, 1]", hint="the share of a pruned frame's tokens merged away"),
        "layer": Layer(1, reads=1, hint="an LLM layer index (it reads layer - 1)"),
        "p": Real("[0, 1]", hint="the share of the video's tokens a step drops"),
    }
    threshold: ClassVar[float] = 0.9  # the cosine similarity below which a step re-selects

    # ----------------------------------------------------------------- stage 1: temporal token merging
    def planned_count(self, n: int) -> None:
        """None: the count per frame depends on its place in the video, which `planned_count(n)` is not told; the
        video's count is known before encoding all the same: `video_count(F, tpf)`."""
        return None

    def frame_counts(self, frames: int, per_frame: int) -> list[int]:
        """Tokens each frame of a video of `frames` frames, `per_frame` tokens each, keeps."""
        return frame_counts(frames, per_frame, self.k)

    def video_count(self, frames: int, per_frame: int) -> int:
        """Tokens a whole video keeps, before its frames are encoded (an adapter that knows a video's frame count
        from its placeholders shrinks the prompt first: LLaVA-OneVision)."""
        return sum(self.frame_counts(frames, per_frame))

    def select(self, tokens: VisualTokens) -> Selection:
        """tokens: every frame of the call's videos ([C, tpf, D], `image_index` = the video, a video's frames
        consecutive and in order; no `image_index`: one video); the projected tokens (`signals["projected"]`)
        decide. Counts follow the frame layout on the host (`image_of_crop`; without it `image_index` is read back
        once): no host sync, a fixed burst of kernels whatever the frame count."""
        if tokens.valid is not None:
            raise VTokenError("dycoke takes whole video frames; these crops have tokens that never reach the LLM")
        if tokens.image_of_crop is not None or tokens.image_index is not None:
            videos = tokens.host_image_index()  # the adapter's host list, or one read of `image_index`
        else:
            videos = [0] * tokens.num_crops
        kept, counts = temporal_merge(tokens.signals["projected"], videos, self.k)
        return Selection(kept=kept, counts=counts)

    # ----------------------------------------------------------------- stage 2: decode-time KV selection
    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        return ()  # nothing is dropped in the prefill

    def select_layer(self, num_layers: int) -> int:
        """The first layer whose attention a decoding step restricts (its row comes from `layer - 1`)."""
        if self.layer >= num_layers:
            raise VTokenError(
                f"dycoke: layer={self.layer} is beyond this LLM's {num_layers} layers (0..{num_layers - 1}); it "
                f"restricts layers {self.layer} and later, reading layer {self.layer} - 1, so layer must be 1.."
                f"{num_layers - 1}"
            )
        return self.layer

    def decode_count(self, n: int) -> int:
        return int(n * (1 - self.p))  # the official float expression, truncated

    def decode_keep(
        self,
        attention: torch.Tensor,
        valid: torch.Tensor,
        previous: torch.Tensor | None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step: attention [B, V] of each row's new token over its V video tokens (0 where `valid`
        [B, V] is False), previous [B, V] the last step's (None: the first step), counts [B] what a re-selecting
        row keeps (`decode_count` of its tokens; None: counted here from `valid`, a host sync). Returns which
        tokens the step keeps [B, V] and which rows re-select [B] (the others attend to everything)."""
        attention = attention.float()
        if previous is None:
            reselect = torch.ones(attention.shape[0], dtype=torch.bool, device=attention.device)
        else:  # zero padding changes no dot product or norm
            reselect = F.cosine_similarity(attention, previous.float(), dim=1) < self.threshold
        if counts is None:
            counts = torch.tensor([self.decode_count(n) for n in valid.sum(1).tolist()], device=attention.device)
        order = attention.masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)
        places = torch.arange(order.shape[1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(1, order, places)  # each token's place in that order
        return (rank < counts[:, None]) & valid, reselect
