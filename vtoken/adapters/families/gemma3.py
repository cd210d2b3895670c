"""Gemma 3 (`Gemma3ForConditionalGeneration`): SigLIP (896 px, no [CLS]), 4 x 4 average pool, soft-token projector.

Every crop (the image, and with pan-and-scan each extra crop, which the processor gives its own image block)
goes through SigLIP (64 x 64 patches at 896 px), the projector's average pool (4 x 4 patches -> one token: a
16 x 16 grid of 256 tokens), an RMS norm and a linear map into the LLM. The visual tokens are the pooled tokens,
per crop, in raster order; methods select before the norm and the linear map, which act on every token alone.
The prompt holds `<start_of_image>` + 256 image soft tokens + `<end_of_image>` per crop; kept tokens are
renumbered (1-D RoPE). `token_type_ids` (1 on soft tokens) make the LLM attend bidirectionally inside each image
block: they shrink with the prompt, so the kept tokens of a block still see each other.

There is no [CLS] token: methods that need [CLS] attention fail at `patch` time. The LLM stages (FastV,
MustDrop's prefill filter) are refused at `patch` too: Gemma 3's decoder interleaves sliding-window and global
attention layers, each type with its own mask (a dict per layer type, bidirectional inside image blocks) and its
own rotary tables, which the shared LLM stages do not rebuild after a drop.
"""

from __future__ import annotations

from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.tokens import VisualTokens

from ..base import Adapter, EncodedImages, Modality, flat_kept
from ..flat_features import FlatFeatures


class Gemma3Adapter(FlatFeatures, Adapter):
    family = "gemma3"
    model_types = ("gemma3",)
    model_classes = ("Gemma3ForConditionalGeneration", "Gemma3Model")
    modalities = (Modality("image", "pixel_values", "image_token_id"),)
    token_columns = {"token_type_ids": 0, "mm_token_type_ids": 0}
    stages = ("encoder",)

    # no LLM stages (FastV, MustDrop): refused at `patch` with this reason
    stages = ("encoder", "sparse")
    stages_note = (
        "Gemma 3's decoder interleaves sliding-window and global attention layers, each with its own mask "
        "(bidirectional inside image blocks) and rotary tables, which vtoken's LLM stages do not rebuild after a "
        "drop (and its per-head QK-norm changes the attention scores they read); use an encoder-stage method "
        "(random, pool, mmtok, fourier)"
    )

    @property
    def projector(self):
        return self.inner.multi_modal_projector

    @property
    def grid(self) -> tuple[int, int]:
        side = self.projector.tokens_per_side
        return side, side

    def available_signals(self) -> set[str]:
        # "resized_grid": positions are renumbered, so a smaller grid only means fewer placeholders
        return {"patch_features", "grid", "resized_grid"}

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The projector after its pooling: RMS norm and the linear map into the LLM ([..., Dv] -> [..., D])."""
        normed = self.projector.mm_soft_emb_norm(features)
        return torch.matmul(normed, self.projector.mm_input_projection_weight).type_as(features)

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        size = self.inner.vision_tower.config.image_size
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3 or tuple(pixel_values.shape[2:]) != (size, size):
            raise InputError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"[num_crops, 3, {size}, {size}] (images and pan-and-scan crops), as its processor makes them"
            )
        return [self.grid[0] * self.grid[1]] * pixel_values.shape[0]

    def pooled(self, crops: torch.Tensor) -> torch.Tensor:
        """Crops [C, 3, H, W] -> [C, N, Dv]: SigLIP's last hidden state average-pooled as the projector pools it."""
        tower = self.inner.vision_tower
        hidden = tower(pixel_values=crops.to(tower.dtype)).last_hidden_state
        side = self.projector.patches_per_image
        maps = hidden.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[-1], side, side)
        return self.projector.avg_pool(maps).flatten(2).transpose(1, 2)

    def encode(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> EncodedImages:
        features = self.pooled(pixel_values)
        crops = features.shape[0]
        tokens = VisualTokens(
            features, self.grid, {}, torch.arange(crops, device=features.device), image_of_crop=list(range(crops))
        )
        selection, timer = self.select(tokens)
        projected = tokens.signals.get("projected")
        if projected is not None and selection.kept is not None:  # a method already projected every token (MMTok)
            embeds = flat_kept(selection, projected)
        else:
            embeds = self.project(flat_kept(selection, features))
        per_crop = list(embeds.split(selection.counts_per_crop()))
        records = self.encoder.crop_records(tokens, selection, timer, [0] * crops, images=list(range(crops)))
        return EncodedImages(per_crop, None, records)
