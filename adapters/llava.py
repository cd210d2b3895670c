"""LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP ViT with [CLS], MLP projector, one 24x24 crop per image."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from vtoken.errors import InputError
from vtoken.records import Record
from vtoken.registry import register_adapter
from vtoken.timing import Stopwatch
from vtoken.tokens import VisualTokens

from .base import Adapter, EncodedImages
from .probes import ClsAttentionProbe


@register_adapter
class LlavaAdapter(Adapter):
    """Visual tokens = the patch tokens of `vision_feature_layer` (no [CLS]), selected before the projector."""

    family = "llava-1.5"
    model_types = ("llava",)
    model_classes = ("LlavaForConditionalGeneration", "LlavaModel")
    encoder_kwargs = ("vision_feature_layer", "vision_feature_select_strategy", "image_sizes")

    @property
    def inner(self):
        """The `LlavaModel` (vision tower, projector, language model)."""
        return self.model.model if hasattr(self.model, "lm_head") else self.model

    @property
    def tower(self):
        return self.inner.vision_tower

    def _feature_layers(self, vision_feature_layer: Any = None) -> list[int]:
        layer = self.model.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        return list(layer) if isinstance(layer, (list, tuple)) else [layer]

    def _attention_layer(self, hidden_state_index: int) -> int | None:
        """Index of the encoder layer whose output is `hidden_states[hidden_state_index]` (None = embeddings)."""
        num_layers = len(self.tower.encoder.layers)
        layer = hidden_state_index % (num_layers + 1) - 1
        return None if layer < 0 else layer

    def available_signals(self) -> set[str]:
        signals = {"patch_features"}
        config = self.model.config
        has_cls = config.vision_feature_select_strategy == "default"  # a [CLS] token that LLaVA drops
        layer = self._attention_layer(self._feature_layers()[-1])
        attention = getattr(self.tower.encoder.layers[layer], "self_attn", None) if layer is not None else None
        if has_cls and attention is not None and hasattr(attention, "q_proj") and hasattr(attention, "k_proj"):
            signals.add("cls_attention")
        return signals

    @property
    def grid(self) -> tuple[int, int]:
        config = self.tower.config
        side = config.image_size // config.patch_size
        return side, side

    def plan(self, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        size = self.tower.config.image_size
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3 or tuple(pixel_values.shape[2:]) != (size, size):
            raise InputError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"[num_images, 3, {size}, {size}] as its processor makes them"
            )
        height, width = self.grid
        return [height * width] * pixel_values.shape[0]

    def encode(
        self,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        image_sizes: Any = None,
    ) -> EncodedImages:
        config = self.model.config
        strategy = vision_feature_select_strategy or config.vision_feature_select_strategy
        if strategy != "default":
            raise InputError(
                f"vision_feature_select_strategy={strategy!r} is not supported by the {self.family} adapter; "
                "expected 'default' (patch tokens without [CLS])"
            )
        method = self.encoder_method
        layers = self._feature_layers(vision_feature_layer)
        needs_cls = "cls_attention" in method.requires
        probe = (
            ClsAttentionProbe(self.tower.encoder.layers[self._attention_layer(layers[-1])].self_attn)
            if needs_cls
            else nullcontext()
        )
        with probe:
            out = self.tower(pixel_values, output_hidden_states=layers, return_dict=True)
        features = torch.cat([out.hidden_states[i][:, 1:] for i in layers], dim=-1)  # [B, N, Dv]
        num_images, num_tokens = features.shape[:2]

        timer = Stopwatch(features.device).start()
        signals = {"cls_attention": probe.scores} if needs_cls else {}
        tokens = VisualTokens(features, self.grid, signals, torch.arange(num_images))
        selection = method.select(tokens)
        timer.stop()

        embeds = self.inner.multi_modal_projector(selection.gather(features))  # [B, k, D]
        k = selection.num_kept
        keep_offsets = list(selection.kept) if selection.kept is not None else [torch.arange(k)] * num_images
        records = [
            Record(
                "encoder",
                method.name,
                image=i,
                crop=0,
                tokens_in=num_tokens,
                tokens_out=k,
                kept=selection.kept[i] if selection.kept is not None else None,
                grid=self.grid,
                timer=timer,
                share=1 / num_images,
            )
            for i in range(num_images)
        ]
        return EncodedImages(list(embeds), keep_offsets, records)
