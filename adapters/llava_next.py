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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vtoken.errors import InputError, VTokenError
from vtoken.registry import available_methods, method_class, register_adapter
from vtoken.tokens import CLS, MERGED, Selection, VisualTokens

from . import hf
from .base import EncodedImages, Modality
from .llava import LlavaAdapter


@dataclass
class AnyresLayout:
    """One image's crops: `rows` x `cols` sub-images after the base view; `unpadded` [h', w'] holds the raster
    indices, in the stitched (rows*H) x (cols*W) grid, of the tokens that survive unpadding."""

    rows: int
    cols: int
    unpadded: torch.Tensor

    @property
    def num_crops(self) -> int:
        return 1 + self.rows * self.cols

    def valid_counts(self, height: int, width: int) -> list[int]:
        """Tokens of every crop (H x W each) that survive unpadding, from the window's shape alone: unpadding
        keeps a centred window of the stitched grid (the base view keeps all)."""
        kept_rows, kept_cols = self.unpadded.shape
        top, left = (self.rows * height - kept_rows) // 2, (self.cols * width - kept_cols) // 2

        def overlap(start: int, size: int, first: int, kept: int) -> int:
            return max(0, min(start + size, first + kept) - max(start, first))

        return [height * width] + [
            overlap(r * height, height, top, kept_rows) * overlap(c * width, width, left, kept_cols)
            for r in range(self.rows)
            for c in range(self.cols)
        ]


@register_adapter
class LlavaNextAdapter(LlavaAdapter):
    family = "llava-next"
    model_types = ("llava_next",)
    model_classes = ("LlavaNextForConditionalGeneration", "LlavaNextModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id",
                 ("image_sizes", "vision_feature_layer", "vision_feature_select_strategy")),
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

    def crop_layout(self, image_size: torch.Tensor) -> AnyresLayout:
        """The crop grid and unpadded token window of an image of `image_size` (height, width)."""
        config = self.model.config
        grid_shape = hf.modeling_function("llava_next", "get_anyres_image_grid_shape")
        unpad = hf.modeling_function("llava_next", "unpad_image")
        rows, cols = grid_shape(image_size, config.image_grid_pinpoints, config.vision_config.image_size)
        height, width = self.grid
        stitched = torch.arange(rows * height * cols * width).view(1, rows * height, cols * width)
        return AnyresLayout(rows, cols, unpad(stitched, image_size)[0])

    def _layouts(self, pixel_values: torch.Tensor, image_sizes: Any) -> list[AnyresLayout]:
        if image_sizes is None:
            raise InputError(
                f"{type(self.model).__name__} needs `image_sizes` next to pixel_values (its processor makes both)"
            )
        layouts = [self.crop_layout(size) for size in image_sizes]
        if pixel_values.dim() == 5:
            self._check_crops(pixel_values[0], "[num_images, num_crops, 3, H, W]")
            if pixel_values.shape[0] != len(layouts) or any(lay.num_crops > pixel_values.shape[1] for lay in layouts):
                raise InputError(
                    f"pixel_values of shape {tuple(pixel_values.shape)} do not hold the crops of "
                    f"{len(layouts)} image(s) of sizes {[list(map(int, s)) for s in image_sizes]}"
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
        height, width = self.grid
        runs = []
        for layout in self._layouts(pixel_values, image_sizes):
            if layout.num_crops == 1:  # base view only: its tokens and one newline
                runs.append(height * width + 1)
            else:
                rows, cols = layout.unpadded.shape
                runs.append(height * width + rows * cols + rows)
        return runs

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        return [None] * len(run_lengths)  # newlines follow which rows keep tokens: known only after selection

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
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy)
        device = features.device
        height, width = self.grid

        # which tokens of each crop survive unpadding; where each sub-image token sits in the stitched grid
        valid, stitched_index, image_index, crop_index = [], [], [], []
        local = torch.arange(height * width)
        y, x = local // width, local % width
        for i, layout in enumerate(layouts):
            keep = torch.zeros(layout.rows * height * layout.cols * width, dtype=torch.bool)
            keep[layout.unpadded.flatten()] = True
            for c in range(layout.num_crops):
                if c == 0:
                    positions = torch.full_like(local, -1)
                else:
                    r, col = divmod(c - 1, layout.cols)
                    positions = (r * height + y) * (layout.cols * width) + col * width + x
                valid.append(keep[positions] if c else torch.ones_like(local, dtype=torch.bool))
                stitched_index.append(positions)
                image_index.append(i)
                crop_index.append(c)
        unpadded = torch.stack(valid).to(device)
        official = self.layout == "official"
        crop_grid = {i: (layout.rows, layout.cols) for i, layout in enumerate(layouts)}
        counts = [n for layout in layouts for n in layout.valid_counts(height, width)]  # host, from the layouts
        tokens = VisualTokens(features, self.grid, signals, torch.tensor(image_index),
                              None if official else unpadded, torch.tensor(crop_index), crop_grid,
                              valid_counts=None if official else counts)  # fmt: skip
        selection, timer = self.select(tokens)
        records = self.crop_records(tokens, selection, timer, crop_index)

        kept = [selection.offsets_of(c) for c in range(tokens.num_crops)]
        if official and "unpad after selection" in self.encoder_method.official_packing:
            # HiRED's official packing selects over the padded crops, then unpads: border picks are dropped
            kept = [k[unpadded[c, k]] for c, k in enumerate(kept)]
            embeds = self.project(torch.cat([features[c, k] for c, k in enumerate(kept)]))
            embeds = embeds.split([len(k) for k in kept])
            for record, k in zip(records, kept, strict=True):
                if len(k) != record.tokens_out:
                    record.selected, record.tokens_out, record.kept = record.tokens_out, len(k), k
        else:
            embeds = self.kept_embeddings(tokens, selection)
        newline = self.inner.image_newline

        per_image, first = [], 0
        for layout in layouts:
            crops = range(first, first + layout.num_crops)
            first += layout.num_crops
            base = embeds[crops[0]]
            if layout.num_crops == 1:
                bare = official and "newline after base-only image" not in self.encoder_method.official_packing
                per_image.append(base if bare else torch.cat([base, newline[None].to(base)]))
                continue
            if selection.origin is not None:  # tokens with no place on the grid ([CLS], merged) follow it
                per_image.append(self._grid_then_extras(selection, embeds, crops, stitched_index, layout, newline))
                continue
            keys = torch.cat([stitched_index[c].to(device)[kept[c]] for c in crops[1:]])
            sub = torch.cat([embeds[c] for c in crops[1:]])
            if official:
                sub = sub[keys.argsort()]
            else:
                sub = _raster_with_newlines(keys, sub, layout.cols * width, newline)
            per_image.append(torch.cat([base, sub]))
        return EncodedImages(per_image, [torch.arange(len(e)) for e in per_image], records)

    def _grid_then_extras(
        self, selection: Selection, embeds: list[torch.Tensor], crops: range, stitched_index: list[torch.Tensor],
        layout: AnyresLayout, newline: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """One image's sequence for a method whose output rows say where they come from (`Selection.origin`,
        VisionZip), packed as VisionZip's official LLaVA-NeXT code does: the base view's rows as they are; the
        sub-images' unchanged tokens on the stitched grid (official layout: raster order of the full grid; native:
        unpadded, a newline after every row that has tokens); then every sub-image's [CLS] row, then every
        sub-image's merged rows, crop after crop."""
        device = embeds[crops[0]].device
        keys, grid, cls, merged = [], [], [], []
        for c in crops[1:]:
            origin = selection.origin_of(c).to(device)
            on_grid = origin >= 0
            keys.append(stitched_index[c].to(device)[origin[on_grid]])
            grid.append(embeds[c][on_grid])
            cls.append(embeds[c][origin == CLS])
            merged.append(embeds[c][origin == MERGED])
        keys, grid = torch.cat(keys), torch.cat(grid)
        if self.layout == "official":
            grid = grid[keys.argsort()]
        else:
            grid = _raster_with_newlines(keys, grid, layout.cols * self.grid[1], newline)
        return torch.cat([embeds[crops[0]], grid, *cls, *merged])


def official_layout_methods() -> list[str]:
    """The registered methods that declare an official anyres layout (`"official" in Method.layouts`)."""
    return [name for name in available_methods() if "official" in method_class(name).layouts]


def _raster_with_newlines(keys: torch.Tensor, embeds: torch.Tensor, row_length: int, newline: torch.Tensor):
    """Tokens at stitched raster positions `keys` [M] with embeddings [M, D], in raster order, each row that
    holds tokens followed by `newline` [D]: returns [M + rows, D]."""
    order = keys.argsort()
    keys, embeds = keys[order], embeds[order]
    rows = keys // row_length
    if len(rows) == 0:
        return embeds
    starts_row = torch.ones_like(rows, dtype=torch.bool)
    starts_row[1:] = rows[1:] != rows[:-1]
    ends_row = torch.ones_like(rows, dtype=torch.bool)
    ends_row[:-1] = rows[1:] != rows[:-1]
    rows_before = starts_row.long().cumsum(0) - 1  # newlines emitted before each token
    out = embeds.new_empty(len(keys) + int(starts_row.sum()), embeds.shape[-1])
    token_slots = torch.arange(len(keys), device=keys.device) + rows_before
    out[token_slots] = embeds
    out[token_slots[ends_row] + 1] = newline.to(embeds)
    return out
