"""PerceptionLM (`PerceptionLMForConditionalGeneration`): a timm Perception Encoder (`Eva` with [CLS] and 2-D RoPE,
in a `TimmWrapperModel`), an MLP projector followed by 2 x 2 adaptive average pooling, and a Llama LLM.

Images arrive as a thumbnail plus tiles (`pixel_values` [num_images, tiles, 3, H, W]), videos as one tile per
frame (`pixel_values_videos` [num_videos, frames, 3, H, W]). The model drops [CLS], projects and pools every
tile, and concatenates the tiles' tokens. Visual tokens here = each tile's pooled tokens (its (h/2) x (w/2) grid
in raster order, in the LLM's space): methods select per tile (per frame), after the projector and pooling, so
the LLM receives a subset of exactly the tokens it would have received. Positions are 1-D and renumbered.

FasterVLM (extension; its official code does not cover this model): the [CLS] query's attention in the last block
of the tower (whose output is the feature), head-mean at the patch keys, pooled 2 x 2 like the features, so a
pooled token's score is the mean score of the patches it averages.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.tables import repeated
from vtoken.tokens import VisualTokens
from vtoken.towers import TimmRowProbe

from ..base import Adapter, EncodedImages, Modality, flat_kept


class PerceptionLMAdapter(Adapter):
    family = "perception-lm"
    model_types = ("perception_lm",)
    model_classes = ("PerceptionLMForConditionalGeneration", "PerceptionLMModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id"),
        Modality("video", "pixel_values_videos", "video_token_id"),
    )
    stacked_features = frozenset({"image", "video"})

    @property
    def timm_model(self) -> torch.nn.Module:
        return self.inner.vision_tower.timm_model

    @property
    def has_cls(self) -> bool:
        return bool(self.model.config.vision_use_cls_token) and getattr(self.timm_model, "cls_token", None) is not None

    @property
    def ratio(self) -> int:
        return max(1, int(self.model.config.projector_pooling_ratio))

    @property
    def grid(self) -> tuple[int, int]:
        """Pooled token grid of one tile (the tower takes tiles of its configured size only)."""
        height, width = self.timm_model.patch_embed.grid_size
        return height // self.ratio, width // self.ratio

    def available_signals(self) -> set[str]:
        # "resized_grid": 1-D renumbered positions take a smaller grid of any size
        signals = {"grid", "resized_grid"}
        if self.has_cls and hasattr(self.timm_model.blocks[-1].attn, "q_norm"):
            signals |= {"cls_attention", "keys"}
        return signals

    def validate(self) -> None:
        method = self.encoder_method
        if method is not None and getattr(method, "partition", None) is not None:  # HiRED: before its signals
            raise VTokenError(
                f"{method.name} splits each image's budget over its tile grid (rows x columns), which "
                f"{type(self.model).__name__}'s inputs do not give (its processor returns the tiles without their "
                "layout); use a method that selects per tile: fastervlm, random, pool, mmtok or fourier"
            )
        super().validate()

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        size = tuple(self.timm_model.patch_embed.img_size)
        if pixel_values.dim() != 5 or pixel_values.shape[2] != 3 or tuple(pixel_values.shape[3:]) != size:
            what = "[num_images, tiles, 3, H, W]" if modality.name == "image" else "[num_videos, frames, 3, H, W]"
            raise InputError(
                f"{modality.pixel_key} of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"{what} with (H, W) = {size}, as its processor makes them"
            )
        return [pixel_values.shape[1] * math.prod(self.grid)] * pixel_values.shape[0]

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        per_tile = math.prod(self.grid)
        kept = self.encoder_method.planned_count(per_tile)
        return [None if kept is None else run // per_tile * kept for run in run_lengths]

    def tile_tokens(self, tiles: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Tiles [T, 3, H, W] -> the model's own pooled, projected tokens [T, n, D] and the signals methods need
        (callables, so that scores are computed inside the selection timer)."""
        probe = None
        if {"cls_attention", "keys"} & set(self.encoder_method.requires):
            probe = TimmRowProbe(self.timm_model.blocks[-1].attn, 0, self.timm_model.num_prefix_tokens)
            with probe:
                hidden = self.inner.vision_tower(tiles, return_dict=True).last_hidden_state
        else:
            hidden = self.inner.vision_tower(tiles, return_dict=True).last_hidden_state
        if self.model.config.vision_use_cls_token:
            hidden = hidden[:, 1:]
        features = self.inner.multi_modal_projector(hidden)
        signals = {}
        if probe is not None:
            signals["cls_attention"] = lambda: self.pooled_scores(probe.probs().mean(dim=1)[:, 1:])
            # the patch keys before RoPE (their content, not their place), mean over heads, pooled like the features
            prefix = self.timm_model.num_prefix_tokens
            signals["keys"] = lambda: self.pooled_scores(probe._raw_keys.mean(dim=1)[:, prefix:])
        return features, signals

    def pooled_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, N] patch scores (or [T, N, d] values) -> [T, n] ([T, n, d]): averaged over the cells of the model's
        own adaptive pooling."""
        height, width = self.timm_model.patch_embed.grid_size
        values = scores[..., None] if scores.dim() == 2 else scores
        grid = values.transpose(1, 2).reshape(values.shape[0], values.shape[2], height, width)
        pooled = F.adaptive_avg_pool2d(grid, self.grid).flatten(2).transpose(1, 2)
        return pooled[..., 0] if scores.dim() == 2 else pooled

    def encode(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> EncodedImages:
        items, tiles = pixel_values.shape[:2]
        features, signals = self.tile_tokens(pixel_values.flatten(0, 1))
        owners = [i for i in range(items) for _ in range(tiles)]
        index = repeated(list(range(items)), [tiles] * items, features.device)
        tokens = VisualTokens(features, self.grid, signals, index, image_of_crop=owners)
        selection, timer = self.select(tokens)
        per_tile = selection.counts_per_crop()
        kept = flat_kept(selection, features).split([sum(per_tile[i * tiles : (i + 1) * tiles]) for i in range(items)])
        records = self.encoder.crop_records(tokens, selection, timer, list(range(tiles)) * items, modality.name, owners)
        return EncodedImages(list(kept), None, records)
