"""LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP ViT with [CLS], MLP projector, one 24x24 crop per image."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.records import Record
from vtoken.registry import register_adapter
from vtoken.timing import Stopwatch
from vtoken.tokens import Selection, VisualTokens

from .base import Adapter, EncodedImages, Modality
from .probes import ClsAttentionProbe


@register_adapter
class LlavaAdapter(Adapter):
    """Visual tokens = the patch tokens of `vision_feature_layer` (no [CLS]), selected before the projector."""

    family = "llava-1.5"
    model_types = ("llava",)
    model_classes = ("LlavaForConditionalGeneration", "LlavaModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id",
                 ("vision_feature_layer", "vision_feature_select_strategy", "image_sizes")),
    )  # fmt: skip

    @property
    def inner(self):
        """The inner model holding the vision tower, the projector and the language model."""
        return self.model.model if hasattr(self.model, "lm_head") else self.model

    @property
    def tower(self):
        return self.inner.vision_tower

    @property
    def grid(self) -> tuple[int, int]:
        config = self.tower.config
        side = config.image_size // config.patch_size
        return side, side

    def _feature_layers(self, vision_feature_layer: Any = None) -> list[int]:
        layer = self.model.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        return list(layer) if isinstance(layer, (list, tuple)) else [layer]

    def _attention_layer(self, hidden_state_index: int) -> int | None:
        """Index of the encoder layer whose output is `hidden_states[hidden_state_index]` (None = embeddings)."""
        num_layers = len(self.tower.encoder.layers)
        layer = hidden_state_index % (num_layers + 1) - 1
        return None if layer < 0 else layer

    def available_signals(self) -> set[str]:
        signals = {"patch_features", "full_grid"}
        has_cls = self.model.config.vision_feature_select_strategy == "default"  # a [CLS] token that LLaVA drops
        layer = self._attention_layer(self._feature_layers()[-1])
        attention = getattr(self.tower.encoder.layers[layer], "self_attn", None) if layer is not None else None
        if has_cls and attention is not None and hasattr(attention, "q_proj") and hasattr(attention, "k_proj"):
            signals.add("cls_attention")
        return signals

    def _check_crops(self, crops: torch.Tensor, what: str) -> None:
        size = self.tower.config.image_size
        if crops.dim() != 4 or crops.shape[1] != 3 or tuple(crops.shape[2:]) != (size, size):
            raise InputError(
                f"pixel_values of shape {tuple(crops.shape)}; {type(self.model).__name__} expects {what} with "
                f"H = W = {size}, as its processor makes them"
            )

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        self._check_crops(pixel_values, "[num_images, 3, H, W]")
        height, width = self.grid
        return [height * width] * pixel_values.shape[0]

    # ----------------------------------------------------------------- shared with the LLaVA-NeXT adapter
    def vision_tokens(
        self,
        crops: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the CLIP tower on crops [C, 3, H, W]: patch features [C, N, Dv] and the signals methods need."""
        strategy = vision_feature_select_strategy or self.model.config.vision_feature_select_strategy
        if strategy != "default":
            raise InputError(
                f"vision_feature_select_strategy={strategy!r} is not supported by the {self.family} adapter; "
                "expected 'default' (patch tokens without [CLS])"
            )
        layers = self._feature_layers(vision_feature_layer)
        needs_cls = "cls_attention" in self.encoder_method.requires
        probe = (
            ClsAttentionProbe(self.tower.encoder.layers[self._attention_layer(layers[-1])].self_attn)
            if needs_cls
            else nullcontext()
        )
        with probe:
            out = self.tower(crops, output_hidden_states=layers, return_dict=True)
        features = torch.cat([out.hidden_states[i][:, 1:] for i in layers], dim=-1)
        # the [CLS] row is computed here, inside the selection timer of `select`
        signals = {"cls_attention": probe} if needs_cls else {}
        return features, signals

    def select(self, tokens: VisualTokens) -> tuple[Selection, Stopwatch]:
        """Score and select with the encoder method; the stopwatch covers scores and selection."""
        timer = Stopwatch(tokens.features.device).start()
        tokens.signals = {k: v.scores if isinstance(v, ClsAttentionProbe) else v for k, v in tokens.signals.items()}
        selection = self.encoder_method.select(tokens)
        timer.stop()
        return selection, timer

    def crop_records(
        self, tokens: VisualTokens, selection: Selection, timer: Stopwatch, crop_index: list[int]
    ) -> list[Record]:
        """One record per crop; `crop_index[c]` is crop c's index within its image."""
        num_crops = tokens.num_crops
        valid = tokens.valid.sum(1).tolist() if tokens.valid is not None else [tokens.num_tokens] * num_crops
        kept_counts = selection.counts or [selection.num_kept] * num_crops
        images = tokens.image_index.tolist()
        return [
            Record(
                "encoder",
                self.encoder_method.name,
                image=images[c],
                crop=crop_index[c],
                tokens_in=valid[c],
                tokens_out=kept_counts[c],
                kept=selection.kept_of(c),
                grid=self.grid,
                timer=timer,
                share=1 / num_crops,
            )
            for c in range(num_crops)
        ]

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        image_sizes: Any = None,
    ) -> EncodedImages:
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy)
        num_images = features.shape[0]
        tokens = VisualTokens(features, self.grid, signals, torch.arange(num_images))
        selection, timer = self.select(tokens)
        embeds = self.inner.multi_modal_projector(selection.gather(features))  # [B, k, D]
        k = selection.num_kept
        keep_offsets = list(selection.kept) if selection.kept is not None else [torch.arange(k)] * num_images
        records = self.crop_records(tokens, selection, timer, [0] * num_images)
        return EncodedImages(list(embeds), keep_offsets, records)
