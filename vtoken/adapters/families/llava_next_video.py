"""LLaVA-NeXT-Video (`LlavaNextVideoForConditionalGeneration`): LLaVA-NeXT images plus per-frame video tokens.

Images are handled exactly as LLaVA-NeXT (anyres, native packing). Video frames go through the CLIP tower, then
the model's spatial resampler (stride-2 pooling: 24 x 24 -> 12 x 12), then the projector, with no newline. The
visual tokens of a frame are the resampler's outputs, and budgets apply per frame. A [CLS] score for a pooled
token is the mean [CLS] attention of the patches it pools: an extension, since FasterVLM's official code has no
resampler.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vtoken.geometry.tables import repeated
from vtoken.tokens import VisualTokens

from ..base import EncodedImages, Modality, flat_kept
from .llava_next import LlavaNextAdapter

FEATURE_KWARGS = ("vision_feature_layer", "vision_feature_select_strategy")


class LlavaNextVideoAdapter(LlavaNextAdapter):
    family = "llava-next-video"
    model_types = ("llava_next_video",)
    model_classes = ("LlavaNextVideoForConditionalGeneration", "LlavaNextVideoModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id", ("image_sizes", *FEATURE_KWARGS)),
        Modality("video", "pixel_values_videos", "video_token_id", FEATURE_KWARGS),
    )

    def available_signals(self) -> set[str]:
        # video frames: plain grids, no newlines; no merge inside the tower (frames are pooled on the grid after it)
        return (super().available_signals() | {"resized_grid"}) - {"tower_merge"}

    @property
    def stride(self) -> int:
        return self.model.config.spatial_pool_stride

    @property
    def frame_grid(self) -> tuple[int, int]:
        return self.grid[0] // self.stride, self.grid[1] // self.stride

    def _pooled(self, values: torch.Tensor) -> torch.Tensor:
        """[C, N] or [C, N, d] per-patch values -> per pooled token, averaged as the resampler pools."""
        flat = values.dim() == 2
        maps = values[..., None] if flat else values
        maps = maps.transpose(1, 2).reshape(maps.shape[0], maps.shape[2], *self.grid)
        pooled = F.avg_pool2d(maps, self.stride).flatten(2).transpose(1, 2)
        return pooled[..., 0] if flat else pooled

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        if modality.name == "image":
            return super().plan(modality, pixel_values, **encoder_kwargs)
        self._check_crops(pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values,
                          "[num_videos, num_frames, 3, H, W]")  # fmt: skip
        return [pixel_values.shape[1] * self.frame_grid[0] * self.frame_grid[1]] * pixel_values.shape[0]

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        if modality.name == "image":
            return super().planned_counts(modality, run_lengths)
        per_frame = self.frame_grid[0] * self.frame_grid[1]
        kept = self.encoder_method.planned_count(per_frame)
        return [None if kept is None else run // per_frame * kept for run in run_lengths]

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        image_sizes: Any = None,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> EncodedImages:
        if modality.name == "image":
            self.refuse_resized_grids("anyres images")
            return super().encode(modality, pixel_values, image_sizes, vision_feature_layer,
                                  vision_feature_select_strategy)  # fmt: skip
        videos, frames = pixel_values.shape[:2]
        patches, signals = self.vision_tokens(pixel_values.flatten(0, 1), vision_feature_layer,
                                              vision_feature_select_strategy)  # fmt: skip
        pooled = self.inner.vision_resampler(patches)  # [videos * frames, 144, Dv]
        # per-patch signals pooled like the features: a pooled token's score (key) is its patches' mean
        signals = {name: (lambda read=read: self._pooled(read())) if callable(read) else read
                   for name, read in signals.items()}  # fmt: skip
        owners = [v for v in range(videos) for _ in range(frames)]
        index = repeated(list(range(videos)), [frames] * videos, pooled.device)
        tokens = VisualTokens(pooled, self.frame_grid, signals, index, image_of_crop=owners)
        selection, timer = self.select(tokens)
        embeds = self.inner.multi_modal_projector(flat_kept(selection, pooled))
        per_frame = selection.counts_per_crop()
        per_video = list(embeds.split([sum(per_frame[v * frames : (v + 1) * frames]) for v in range(videos)]))
        records = self.encoder.crop_records(tokens, selection, timer, list(range(frames)) * videos, "video", owners)
        return EncodedImages(per_video, None, records)
