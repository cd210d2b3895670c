"""FastVLM (`FastVlmForConditionalGeneration`): a timm FastViTHD tower (`TimmWrapperModel` around `fastvit_mci3`,
conv stages then attention stages, no [CLS]) whose stride-64 feature map is flattened, then an MLP projector.

Visual tokens = the final feature map's H/64 x W/64 cells in raster order, selected before the projector. The
model takes only `vision_feature_layer=-1` and `vision_feature_select_strategy="full"`, and its features as one
stacked tensor. Positions are the LLM's 1-D RoPE, renumbered, so a method may hand back a smaller grid.
"""

from __future__ import annotations

from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.tokens import VisualTokens

from ..base import EncodedImages, Modality
from .llava import LlavaAdapter


class FastVlmAdapter(LlavaAdapter):
    family = "fastvlm"
    clip_tower = False  # FastViTHD, not a CLIP checkpoint's tower
    model_types = ("fast_vlm",)
    model_classes = ("FastVlmForConditionalGeneration", "FastVlmModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id", ("vision_feature_layer", "vision_feature_select_strategy")),
    )
    stacked_features = frozenset({"image"})

    @property
    def stride(self) -> int:
        """Pixels per token side of the tower's final feature map (64 for FastViTHD)."""
        return self.tower.timm_model.feature_info[-1]["reduction"]

    def available_signals(self) -> set[str]:
        return {"grid", "resized_grid"}  # no [CLS]: FastViTHD is a hybrid conv/attention tower

    def _grid_of(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        stride = self.stride
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3 or any(s % stride for s in pixel_values.shape[2:]):
            raise InputError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"[num_images, 3, H, W] with H and W multiples of the tower's stride {stride}, as its processor makes "
                "them"
            )
        return pixel_values.shape[2] // stride, pixel_values.shape[3] // stride

    @staticmethod
    def _check_feature_kwargs(
        vision_feature_layer: Any = None, vision_feature_select_strategy: str | None = None
    ) -> None:
        if vision_feature_layer not in (None, -1) or vision_feature_select_strategy not in (None, "full"):
            raise InputError(
                f"vision_feature_layer={vision_feature_layer!r}, vision_feature_select_strategy="
                f"{vision_feature_select_strategy!r}: FastVLM takes only -1 and 'full'"
            )

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        self._check_feature_kwargs(**encoder_kwargs)
        height, width = self._grid_of(pixel_values)
        return [height * width] * pixel_values.shape[0]

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> EncodedImages:
        self._check_feature_kwargs(vision_feature_layer, vision_feature_select_strategy)
        grid = self._grid_of(pixel_values)
        feature_map = self.tower(pixel_values, return_dict=True).last_hidden_state  # [B, C, H/64, W/64]
        features = feature_map.flatten(2).transpose(1, 2)  # raster order, as the model flattens it
        num_images = features.shape[0]
        tokens = VisualTokens(
            features, grid, {}, torch.arange(num_images, device=features.device), image_of_crop=list(range(num_images))
        )
        selection, timer = self.select(tokens)
        embeds = self.kept_embeddings(tokens, selection)
        records = self.encoder.crop_records(tokens, selection, timer, [0] * num_images, images=list(range(num_images)))
        return EncodedImages(embeds, None, records)
