"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): anyres crops, CLIP ViT with [CLS], learned `image_newline`.

Each image is a base view plus rows x cols sub-image crops of 24 x 24 tokens. The model's own ("native") packing,
which the checkpoints were trained on: the base view's tokens, then the sub-images stitched into a
(rows*24) x (cols*24) grid, unpadded to the image's aspect ratio, read in raster order with `image_newline` after
every row. After selection the same packing is kept: the base view's kept tokens in ascending order, then the
kept sub-image tokens in raster order of the unpadded grid with a newline after every row that still has
tokens. Newlines are not visual tokens: budgets and records never count them.

Every crop keeps its budget of its *valid* tokens: sub-image tokens in the padded border that unpadding removes
never reach the LLM, so they are never picked (the records say how many valid tokens each crop had).

`layout="official"` packs as the official FasterVLM code does for LLaVA-NeXT (also used for MMTok and the
baselines): no unpadding and no newlines; every crop keeps its budget of all its tokens, and the sequence is the
base view's kept tokens, then the kept sub-image tokens in raster order of the full stitched grid. For HiRED it
packs as HiRED's official code does: the same, except that the kept sub-image tokens are then unpadded, so picks
in the padded border are dropped and a crop can end below its budget (records report the realised count in
`tokens_out` and the picks in `selected`). HiRED's official packing swaps rows and columns for non-square crop
grids; tiles here sit at their true positions. The LLM then sees a sequence the checkpoint was not trained on,
so use these layouts to reproduce published numbers, not for best accuracy.

Tower stage: PixelPrune drops patches of every crop before the tower; in either layout the dropped patches are
invalid cells of their crop (native: unpadded, newlines after rows that keep tokens). ToMe merges inside the tower,
so its tokens have no grid: `layout="official"` only, every crop alike and flat (base crop, then the grid crops, no
unpadding, no newline: MustDrop's packing); the native layout is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.anyres import AnyresGrid, anyres_grid, crop_valid, pack, sequence_index
from vtoken.geometry.tables import on_device, repeated
from vtoken.records import LazyRecords
from vtoken.registry import available_methods, method_class
from vtoken.tokens import VisualTokens

from ..base import EncodedImages, Modality, output_places
from ..tower import TowerPlan
from .llava import LlavaAdapter

# an image's crops (kept for the name tests and tools know; the geometry lives in `vtoken.geometry.anyres`)
AnyresLayout = AnyresGrid


class LlavaNextAdapter(LlavaAdapter):
    family = "llava-next"
    model_types = ("llava_next",)
    model_classes = ("LlavaNextForConditionalGeneration", "LlavaNextModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id",
                 ("image_sizes", "vision_feature_layer", "vision_feature_select_strategy"), host=("image_sizes",)),
    )  # fmt: skip

    # official layouts (the methods declare theirs: `Method.layouts`, `Method.official_packing`): FasterVLM's (also
    # MMTok's and the baselines'), HiRED's, which unpads after selecting, and MustDrop's (every crop merged on its
    # own, crops concatenated flat)
    layouts = ("native", "official")

    def validate(self) -> None:
        super().validate()
        unsupported = [m.name for m in self.methods if "encoder" in m.stages and "official" not in m.layouts]
        placed = [m.name for m in self.methods if "encoder" in m.stages and m.acts_on == "placed"]
        if self.layout == "official" and placed:
            raise VTokenError(
                f"{placed[0]} selects among the tokens as the model packs them (newlines included), which is what "
                f"its official code does on {self.family}: use layout='native'"
            )
        if self.layout == "official" and unsupported:
            raise VTokenError(
                f"layout='official' on {self.family} is implemented for {', '.join(official_layout_methods())}; "
                f"{unsupported} have no official LLaVA-NeXT layout here; use layout='native'"
            )
        tower = self.tower_method
        if tower is not None and tower.acts == "layers" and self.layout == "native":
            raise VTokenError(
                f"{tower.name} merges tokens inside the vision tower, so they no longer sit on the crop grid that "
                f"{self.family}'s native layout unpads and ends with newlines; use layout='official' (every crop "
                "merged alike, crops concatenated flat: base crop, then the grid crops, no unpadding, no newline)"
            )
        if self.layout == "native" and "tower_merge" in getattr(self.encoder_method, "requires", ()):
            raise VTokenError(
                f"{self.encoder_method.name} merges tokens inside the vision tower, so they no longer sit on the "
                f"crop grid that {self.family}'s native layout unpads and ends with newlines; use "
                "layout='official' (every crop merged on its own, crops concatenated flat, as its official code)"
            )

    def available_signals(self) -> set[str]:
        # native sub-image crops are grids with a rectangular valid part; a resized grid would need its own
        # stitching and unpadding
        return super().available_signals() - {"resized_grid"}

    def crop_layout(self, image_size: Any) -> AnyresGrid:
        """The crop grid and unpadded token window of an image of `image_size` (height, width)."""
        config = self.model.config
        size = image_size.tolist() if isinstance(image_size, torch.Tensor) else list(image_size)
        return anyres_grid(size, config.image_grid_pinpoints, config.vision_config.image_size, self.grid)

    def _layouts(self, pixel_values: torch.Tensor, image_sizes: Any) -> list[AnyresGrid]:
        if image_sizes is None:
            raise InputError(
                f"{type(self.model).__name__} needs `image_sizes` next to pixel_values (its processor makes both)"
            )
        sizes = self.on_host("image_sizes", image_sizes)  # read once per call, with the prompt's layout
        layouts = [self.crop_layout(size) for size in sizes]
        if pixel_values.dim() == 5:
            self._check_crops(pixel_values[0], "[num_images, num_crops, 3, H, W]")
            if pixel_values.shape[0] != len(layouts) or any(lay.num_crops > pixel_values.shape[1] for lay in layouts):
                raise InputError(
                    f"pixel_values of shape {tuple(pixel_values.shape)} do not hold the crops of "
                    f"{len(layouts)} image(s) of sizes {[list(map(int, s)) for s in sizes]}"
                )
        else:
            self._check_crops(pixel_values, "[num_images, num_crops, 3, H, W] or [total_crops, 3, H, W]")
            needed = sum(lay.num_crops for lay in layouts)
            if pixel_values.shape[0] != needed:
                raise InputError(f"{pixel_values.shape[0]} crops given; the image sizes need {needed}")
        return layouts

    def plan(
        self, modality: Modality, pixel_values: torch.Tensor, image_sizes: Any = None, **encoder_kwargs: Any
    ) -> list[int]:
        return [layout.native_length() for layout in self._layouts(pixel_values, image_sizes)]

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        plan = self.tower_plan(modality)
        if plan is not None and self.flat_after_tower(plan):  # every crop's count, crops concatenated
            per_crop = [self.encoder_method.planned_count(n) for n in plan.counts]
            if None not in per_crop:
                return plan.item_counts(per_crop)
        return [None] * len(run_lengths)  # newlines follow which rows keep tokens: known only after selection

    def flat_after_tower(self, plan: TowerPlan) -> bool:
        """The layout packs every crop's kept tokens flat after the tower stage (no unpadding, no newline): ToMe's
        tokens always; PixelPrune's in the official layout of a method that unpads nowhere."""
        packing = {"unpad after selection", "unpad before selection", "newline after base-only image"}
        return plan.selected is None or (
            self.layout == "official" and not packing & set(self.encoder_method.official_packing)
        )

    def image_crops(
        self, modality: Modality, pixel_values: torch.Tensor, image_sizes: Any = None, **encoder_kwargs: Any
    ) -> tuple[torch.Tensor, list[int], list[int]] | None:
        if modality.name != "image":
            return None
        layouts = self._layouts(pixel_values, image_sizes)
        if pixel_values.dim() == 5:
            pixel_values = torch.cat([p[: lay.num_crops] for p, lay in zip(pixel_values, layouts, strict=True)])
        images = [i for i, layout in enumerate(layouts) for _ in range(layout.num_crops)]
        return pixel_values, images, [c for layout in layouts for c in range(layout.num_crops)]

    def encode_flat(
        self, plan: TowerPlan, pixel_values: torch.Tensor, vision_feature_layer: Any,
        vision_feature_select_strategy: str | None,
    ) -> EncodedImages:  # fmt: skip
        """After ToMe: every crop's merged tokens to the encoder method, its kept ones concatenated flat per image
        (base crop first, no newline)."""
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy,
                                               plan=plan)  # fmt: skip
        features, signals, grid, _, _ = self.tower_tokens(plan, features, signals)
        device = features.device
        images = plan.images
        tokens = VisualTokens(features, grid, signals, on_device(images, device), None, on_device(plan.crops, device),
                              image_of_crop=images)  # fmt: skip
        selection, timer = self.select(tokens)
        per_image = plan.item_counts(selection.counts_per_crop())  # host counts: crops concatenated per image
        records = self.encoder.crop_records(tokens, selection, timer, plan.crops, images=images)
        return EncodedImages(list(self.kept_flat(tokens, selection).split(per_image)), None, records)

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        image_sizes: Any = None,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> EncodedImages:
        layouts = self._layouts(pixel_values, image_sizes)
        if pixel_values.dim() == 5:
            pixel_values = torch.cat([p[: lay.num_crops] for p, lay in zip(pixel_values, layouts, strict=True)])
        if "tower_merge" in self.encoder_method.requires:  # MustDrop's official packing: crops flat
            groups = [layout.num_crops for layout in layouts]
            return self.encode_merged(pixel_values, vision_feature_layer, vision_feature_select_strategy, groups)
        plan = self.tower_plan(modality)
        if plan is not None and plan.selected is None:  # merged inside the tower: flat
            return self.encode_flat(plan, pixel_values, vision_feature_layer, vision_feature_select_strategy)
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy,
                                               plan=plan)  # fmt: skip
        features, signals, _, kept, kept_counts = self.tower_tokens(plan, features, signals)
        device = features.device
        official = self.layout == "official"
        method = self.encoder_method
        # host facts of every crop (image after image, base view first), from the image sizes alone
        crops = [layout.num_crops for layout in layouts]
        images = [i for i, n in enumerate(crops) for _ in range(n)]
        crop_index = [c for n in crops for c in range(n)]
        valid_counts = [n for layout in layouts for n in layout.valid_counts()]
        # the native packing unpads before any method; the official ones as the method's code does
        unpads = not official or "unpad before selection" in method.official_packing
        unpads_after = official and "unpad after selection" in method.official_packing
        unpadded = crop_valid(layouts, device) if unpads or unpads_after else None
        valid, counts = (unpadded, valid_counts) if unpads else (None, None)
        if kept is not None:  # PixelPrune's dropped patches: invalid cells of their crops
            valid = kept if valid is None else valid & kept
            counts = kept_counts if counts is None else _kept_valid_counts(layouts, plan)
        crop_grid = {i: (layout.rows, layout.cols) for i, layout in enumerate(layouts)}
        if "sequence_index" in method.uses:  # the image's tokens as packed: base view, then the stitched grid
            signals["sequence_index"] = sequence_index(layouts, device)
        tokens = VisualTokens(
            features, self.grid, signals, repeated(list(range(len(crops))), crops, device),
            valid, on_device(crop_index, device), crop_grid, image_of_crop=images, valid_counts=counts,
        )  # fmt: skip
        selection, timer = self.select(tokens)
        places = output_places(selection)
        drop = None
        if unpads_after:  # HiRED's official packing selects over the padded crops, then unpads: border picks drop
            drop = ~unpadded.gather(1, places.clamp(max=tokens.num_tokens - 1))
        packed = pack(layouts, places, selection.counts_per_crop(), self.kept_flat(tokens, selection),
                      self.inner.image_newline, native=not official, origin=selection.origin, drop=drop,
                      base_newline="newline after base-only image" in method.official_packing,
                      whole=method.acts_on == "placed")  # fmt: skip
        records = self.encoder.crop_records(tokens, selection, timer, crop_index, images=images)
        if drop is not None:
            records = _after_unpadding(records, packed.reached, places, drop)
        return EncodedImages(packed.per_image(), None, records)


def _kept_valid_counts(layouts: list[AnyresGrid], plan: TowerPlan) -> list[int]:
    """Per crop, its patches that both survive unpadding and were kept by the tower stage, counted on the host
    (the unpadding windows from the image sizes, the kept patches from the plan's host selection)."""
    unpadded = crop_valid(layouts, "cpu").numpy()  # host work: no device read
    kept = np.zeros(unpadded.size, dtype=bool)
    kept[plan.selected.kept] = True
    return (unpadded & kept.reshape(unpadded.shape)).sum(1).tolist()


def _after_unpadding(records: Any, reached: list[int], places: torch.Tensor, drop: torch.Tensor) -> Any:
    """Crop records of a layout that unpads after selecting (HiRED's official one): `tokens_out` is what reached
    the LLM, `selected` what the method picked, `kept` the picks that stayed (built when read)."""

    def build() -> list:
        out = list(records)
        for c, record in enumerate(out):
            if reached[c] != record.tokens_out:
                picks = places[c, : record.tokens_out]
                record.selected, record.tokens_out = record.tokens_out, reached[c]
                record.kept = picks[~drop[c, : len(picks)]]
        return out

    return LazyRecords(build)


def official_layout_methods() -> list[str]:
    """The registered methods that declare an official anyres layout (`"official" in Method.layouts`)."""
    return [name for name in available_methods() if "official" in method_class(name).layouts]
