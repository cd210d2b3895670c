"""Video-LLaVA (`VideoLlavaForConditionalGeneration`): separate CLIP image and video towers, one projector.

Images: the image tower's patch tokens ([CLS] dropped), as LLaVA-1.5. Videos: each frame goes through the video
tower, and transformers feeds the LLM the frame's [CLS] token followed by its patch tokens. Methods choose among
the frame's patch tokens, per frame, which is what the official FasterVLM video code scores and prunes. The frame's
[CLS] token is passed through unchanged and, like a newline, never counted as a visual token.
"""

from __future__ import annotations

from typing import Any

import torch

from vtoken.geometry.tables import on_device, repeated
from vtoken.tokens import VisualTokens

from ..base import EncodedImages, Modality, flat_kept
from .llava import LlavaAdapter

IMAGE_KWARGS = ("vision_feature_layer", "vision_feature_select_strategy")


class VideoLlavaAdapter(LlavaAdapter):
    family = "video-llava"
    clip_tower = False  # LanguageBind's towers: not an OpenAI CLIP checkpoint
    model_types = ("video_llava",)
    model_classes = ("VideoLlavaForConditionalGeneration", "VideoLlavaModel")
    modalities = (
        Modality("image", "pixel_values_images", "image_token_id", IMAGE_KWARGS),
        Modality("image", "pixel_values", "image_token_id", IMAGE_KWARGS),
        Modality("video", "pixel_values_videos", "video_token_id", ("vision_feature_layer",)),
    )
    stacked_features = frozenset({"image", "video"})  # its forward masked-scatters `pooler_output` tensors
    frame_leading = 1  # a frame's [CLS] token before its patches

    def available_signals(self) -> set[str]:
        # no merge inside the towers: frames are packed as full grids (each frame keeps its [CLS] slot)
        return super().available_signals() - {"tower_merge"}

    @property
    def tower(self):
        return self.inner.image_tower

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        if modality.name == "image":
            return super().plan(modality, pixel_values)
        self._check_crops(pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values,
                          "[num_videos, num_frames, 3, H, W]")  # fmt: skip
        height, width = self.grid
        return [pixel_values.shape[1] * (1 + height * width)] * pixel_values.shape[0]

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        if modality.name == "image":
            return super().planned_counts(modality, run_lengths)
        patches = self.grid[0] * self.grid[1]
        method = self.encoder_method
        kept = method.planned_count(patches)
        if kept is None:
            return [None] * len(run_lengths)
        # a frame sends its [CLS] token and its kept patches; a method that sends [CLS] itself counts it
        per_frame = kept if "cls_token" in method.uses and kept < patches else 1 + kept
        return [run // (1 + patches) * per_frame for run in run_lengths]

    def encode(self, modality: Modality, pixel_values: torch.Tensor, vision_feature_layer: Any = None,
               vision_feature_select_strategy: str | None = None) -> EncodedImages:  # fmt: skip
        if modality.name == "image":
            return super().encode(modality, pixel_values, vision_feature_layer, vision_feature_select_strategy)
        videos, frames = pixel_values.shape[:2]
        hidden, signals = self.vision_tokens(
            pixel_values.flatten(0, 1), vision_feature_layer, tower=self.inner.video_tower, with_cls=True
        )
        cls, patches = hidden[:, 0], hidden[:, 1:]
        owners = [v for v in range(videos) for _ in range(frames)]
        device = patches.device
        tokens = VisualTokens(
            patches, self.grid, signals, repeated(list(range(videos)), [frames] * videos, device), image_of_crop=owners
        )
        selection, timer = self.select(tokens)
        # each frame: its [CLS] token, then its kept patches; a method that sends [CLS] itself (VisionZip, keeping
        # fewer than all patches: what `planned_counts` sized the prompt for) sends its own rows only
        counts, patches_per_frame = selection.counts_per_crop(), tokens.num_tokens
        sends_cls = selection.origin is not None and "cls_token" in self.encoder_method.uses
        lead = [0 if sends_cls and k < patches_per_frame else 1 for k in counts]  # [CLS] rows put before a frame
        before = [sum(lead[: f + 1]) for f in range(len(lead))]
        starts = [sum(lead[:f]) + sum(counts[:f]) for f in range(len(lead)) if lead[f]]
        rows = flat_kept(selection, patches)
        out = rows.new_empty(len(rows) + sum(lead), rows.shape[-1])
        out[torch.arange(len(rows), device=device) + repeated(before, counts, device)] = rows
        if starts:
            with_cls = [f for f in range(len(lead)) if lead[f]]
            out[on_device(starts, device)] = cls[on_device(with_cls, device)] if len(with_cls) < len(lead) else cls
        embeds = self.inner.multi_modal_projector(out)
        sizes = [n + c for n, c in zip(counts, lead, strict=True)]
        per_video = list(embeds.split([sum(sizes[v * frames : (v + 1) * frames]) for v in range(videos)]))
        records = self.encoder.crop_records(tokens, selection, timer, list(range(frames)) * videos, "video", owners)
        return EncodedImages(per_video, None, records)
