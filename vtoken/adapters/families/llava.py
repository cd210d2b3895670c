"""LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP ViT with [CLS], MLP projector, one 24x24 crop per image."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, ClassVar

import torch

from vtoken.errors import InputError
from vtoken.geometry.kept import kept_rows
from vtoken.geometry.llava import encoder_layer, outside_pad_border, token_grid
from vtoken.geometry.tables import on_device
from vtoken.records import LazyRecords, Record
from vtoken.tokens import Selection, VisualTokens

from .. import hf
from ..base import Adapter, EncodedImages, Modality
from ..probes import ClsAttentionProbe


class LlavaAdapter(Adapter):
    """Visual tokens = the patch tokens of `vision_feature_layer` (no [CLS]), selected before the projector."""

    family = "llava-1.5"
    # the tower is a CLIP checkpoint's vision tower whose text tower methods may use (CDPruner's "clip_features")
    clip_tower: ClassVar[bool] = True
    model_types = ("llava",)
    model_classes = ("LlavaForConditionalGeneration", "LlavaModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id",
                 ("vision_feature_layer", "vision_feature_select_strategy", "image_sizes")),
    )  # fmt: skip

    @property
    def tower(self):
        return self.inner.vision_tower

    @property
    def grid(self) -> tuple[int, int]:
        return token_grid(self.tower.config.image_size, self.tower.config.patch_size)

    def _feature_layers(self, vision_feature_layer: Any = None) -> list[int]:
        layer = self.model.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        return list(layer) if isinstance(layer, (list, tuple)) else [layer]

    def _attention_layer(self, hidden_state_index: int) -> int | None:
        """Index of the encoder layer whose output is `hidden_states[hidden_state_index]` (None = embeddings)."""
        return encoder_layer(hidden_state_index, len(self.tower.encoder.layers))

    def validate(self) -> None:
        super().validate()
        if "tower_merge" in getattr(self.encoder_method, "requires", ()):
            self.encoder_method.check_grid(self.grid)  # a merge by windows needs a grid they tile (MustDrop)
        if "clip_features" in getattr(self.encoder_method, "requires", ()):
            self.encoder_method.check_clip_width(self.tower.config.hidden_size)  # CDPruner's CLIP checkpoint

    def available_signals(self) -> set[str]:
        # "resized_grid": positions are renumbered, so a method may hand back a smaller grid of any size
        signals = {"patch_features", "grid", "resized_grid"}
        has_cls = self.model.config.vision_feature_select_strategy == "default"  # a [CLS] token that LLaVA drops
        layer = self._attention_layer(self._feature_layers()[-1])
        attention = getattr(self.tower.encoder.layers[layer], "self_attn", None) if layer is not None else None
        if has_cls and attention is not None and hasattr(attention, "q_proj") and hasattr(attention, "k_proj"):
            # at the feature layer, and "cls_attention@L" at any encoder layer L
            signals |= {"cls_attention", "cls_attention@-1", "keys"}  # keys: the feature layer's
            signals |= {f"cls_attention@{i}" for i in range(len(self.tower.encoder.layers))}
            signals.add("tower_merge")  # a merge inside the tower (MustDrop), with [CLS] kept apart
        if self.clip_tower and hasattr(self.tower, "post_layernorm") and len(self._feature_layers()) == 1:
            signals.add("clip_features")  # the tower's own final norm on the feature layer's patches
        return signals

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.inner.multi_modal_projector(features)

    def kept_embeddings(self, tokens: VisualTokens, selection: Selection) -> list[torch.Tensor]:
        """Per crop, [k_c, D] projected kept tokens (views of `kept_flat`)."""
        return list(self.kept_flat(tokens, selection).split(selection.counts_per_crop()))

    def kept_flat(self, tokens: VisualTokens, selection: Selection) -> torch.Tensor:
        """[sum of kept, D] every crop's projected output rows, crop after crop: gathered from the "projected"
        signal when a method already projected every token (MMTok), else projected now (only the kept ones)."""
        return kept_rows(selection, tokens.features, tokens.signals, self.project)

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
        tower: Any = None,
        with_cls: bool = False,
        key_valid: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the CLIP tower (default: `self.tower`) on crops [C, 3, H, W]: patch features [C, N, Dv] (with the
        [CLS] feature first, [C, 1 + N, Dv], if `with_cls`) and the signals methods need ("cls_token": the [CLS]
        feature, [C, Dv], for methods that send it to the LLM). key_valid: a callable giving [C, S] the tokens
        that are real after a merge inside the tower, for the [CLS] rows' softmax (None: all)."""
        tower = tower or self.tower
        self.check_select_strategy(vision_feature_select_strategy)
        layers = self._feature_layers(vision_feature_layer)
        probes = {}  # layer -> its probe
        wanted = {}  # signal name -> (layer, what to read)
        for name in self.encoder_method.requires:
            if name in ("cls_attention", "keys"):
                layer = self._attention_layer(layers[-1])
            elif name.startswith("cls_attention@"):
                layer = int(name.removeprefix("cls_attention@"))
            else:
                continue
            layer %= len(tower.encoder.layers)
            probes.setdefault(layer, ClsAttentionProbe(tower.encoder.layers[layer].self_attn, key_valid=key_valid))
            wanted[name] = (layer, "patch_keys" if name == "keys" else "scores")
        with ExitStack() as stack:
            for probe in probes.values():
                stack.enter_context(probe)
            states = hf.hidden_states(tower, layers, crops)
        hidden = torch.cat(list(states), dim=-1)
        features = hidden if with_cls else hidden[:, 1:]
        # callables: the [CLS] rows are computed inside the selection timer of `select`
        signals = {name: (lambda probe=probes[layer], read=read: getattr(probe, read))
                   for name, (layer, read) in wanted.items()}  # fmt: skip
        if "cls_token" in self.encoder_method.uses:
            signals["cls_token"] = hidden[:, 0]
        if "clip_features" in self.encoder_method.requires:  # CDPruner: as CLIP's image embedding is made
            signals["clip_features"] = lambda patches=hidden[:, 1:], norm=tower.post_layernorm: norm(patches)
        return features, signals

    def merged_vision_tokens(
        self,
        crops: torch.Tensor,
        vision_feature_layer: Any,
        vision_feature_select_strategy: str | None,
        groups: list[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """`vision_tokens` for a method that merges inside the tower (MustDrop): the method supplies the merge
        (`tower_merge`: what it does to the output of one tower layer, and the key padding of the later ones); every
        crop runs in one tower call (`groups`: crops per image). Returns features [C, N', Dv], signals [C, N'] and
        which tokens are real [C, N']."""
        merge = self.encoder_method.tower_merge(self.grid, groups)
        layers = self.tower.encoder.layers
        thread = threading.get_ident()

        def merged(module, args, output: torch.Tensor) -> torch.Tensor | None:  # [c, 1 + N, D], [CLS] first
            return merge(output) if threading.get_ident() == thread else None  # not another thread's call

        def padded(module, args, kwargs):  # later layers: the key padding of crops that merged less
            if threading.get_ident() != thread or merge.attention_mask is None:
                return None
            if len(args) > 1:
                return (args[0], merge.attention_mask, *args[2:]), kwargs
            return args, {**kwargs, "attention_mask": merge.attention_mask}

        hooks = [layers[merge.after_layer].register_forward_hook(merged)]
        hooks += [
            layer.register_forward_pre_hook(padded, with_kwargs=True) for layer in layers[merge.after_layer + 1 :]
        ]
        try:
            features, signals = self.vision_tokens(
                crops, vision_feature_layer, vision_feature_select_strategy, key_valid=lambda: merge.key_valid
            )
        finally:
            for hook in hooks:
                hook.remove()
        return features, {name: compute() for name, compute in signals.items()}, merge.valid.to(crops.device)

    def encode_merged(
        self,
        crops: torch.Tensor,
        vision_feature_layer: Any,
        vision_feature_select_strategy: str | None,
        groups: list[int],
    ) -> EncodedImages:
        """Encode with a method that merges inside the tower: every crop's merged tokens, the crops of an image
        concatenated flat (base view first for anyres, MustDrop's official packing), the key set per crop."""
        features, signals, valid = self.merged_vision_tokens(
            crops, vision_feature_layer, vision_feature_select_strategy, groups
        )
        image_index = on_device([image for image, n in enumerate(groups) for _ in range(n)], "cpu")
        crop_index = [c for n in groups for c in range(n)]
        tokens = VisualTokens(features, (1, features.shape[1]), signals, image_index, valid,
                              on_device(crop_index, "cpu"))  # fmt: skip
        selection, timer = self.select(tokens)
        records = self.merge_records(self.encoder.crop_records(tokens, selection, timer, crop_index), selection)
        embeds = self.kept_embeddings(tokens, selection)
        counts = selection.counts_per_crop()
        per_image, protected, first = [], [], 0
        for n in groups:
            crops_of_image = range(first, first + n)
            first += n
            per_image.append(torch.cat([embeds[c] for c in crops_of_image]))
            protected.append(torch.cat([selection.protected[c, : counts[c]] for c in crops_of_image]))
        return EncodedImages(per_image, [torch.arange(len(e)) for e in per_image], records, protected)

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        image_sizes: Any = None,
    ) -> EncodedImages:
        if "tower_merge" in self.encoder_method.requires:
            groups = [1] * pixel_values.shape[0]
            return self.encode_merged(pixel_values, vision_feature_layer, vision_feature_select_strategy, groups)
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy)
        num_images, device = features.shape[0], features.device
        valid = None
        if getattr(self.encoder_method, "excludes_pad_border", False):  # read from the pixels: the method counts
            valid = outside_pad_border(pixel_values, self.tower.config.patch_size).to(device)
        tokens = VisualTokens(features, self.grid, signals, torch.arange(num_images, device=device), valid,
                              image_of_crop=list(range(num_images)))  # fmt: skip
        selection, timer = self.select(tokens)
        embeds = self.kept_embeddings(tokens, selection)
        records = self.encoder.crop_records(tokens, selection, timer, [0] * num_images, images=list(range(num_images)))
        return EncodedImages(embeds, None, records)  # renumbered positions: the first placeholders stay

    def merge_records(self, records: Sequence[Record], selection: Selection) -> LazyRecords:
        """A merging method's crop records as two stages: "encoder.merge" (N -> N') and "encoder.keyset" (the
        tokens it protects from later stages); built when read, like the crop records."""
        height, width = self.grid
        protected = selection.protected

        def build() -> list[Record]:
            out = []
            for c, record in enumerate(records):
                keys = protected[c, : record.tokens_out].nonzero().squeeze(1)
                merged = replace(
                    record, stage="encoder.merge", tokens_in=height * width, kept=None, grid=(height, width)
                )
                out += [merged, replace(record, stage="encoder.keyset", tokens_out=len(keys), kept=keys, share=0.0)]
            return out

        return LazyRecords(build)
