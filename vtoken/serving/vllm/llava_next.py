"""LLaVA-NeXT in vLLM: served where an image's placeholder count is known before its crops are encoded.

LLaVA-NeXT's native packing (base view, then the stitched sub-images unpadded, a newline after every row that
still has tokens) makes the count of a crop-level selection depend on which rows keep tokens: known only after
selection, so refused. Served instead:
- `layout="official"` (as `vtoken.patch(model, method, layout="official")`: the seed methods' own LLaVA-NeXT
  packing): every crop keeps its budget of all its tokens, no unpadding, no newlines; the base view's kept tokens,
  then the kept sub-image tokens in raster order of the full stitched grid (VisionZip: then every sub-image's
  [CLS] row, then every sub-image's merged rows). Count: crops x the method's count per crop.
- methods acting on the tokens as placed (DivPrune), on the native layout: they choose among the image's run as
  vLLM's own LLaVA-NeXT packs it (newlines included), whose length follows from the image size.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
)

from vtoken.adapters.families.llava_next import official_layout_methods
from vtoken.geometry.anyres import anyres_grid, crop_grid, pack
from vtoken.geometry.kept import kept_rows, output_places
from vtoken.geometry.tables import on_device, repeated
from vtoken.stages.encoder import EncoderStage, SignalSources
from vtoken.tokens import VisualTokens

from . import tower
from .config import ServingConfig, error, serving_config
from .llava import (
    LlavaFamily,
    PrunedImagePlaceholders,
    PruningModel,
    check_clip,
    check_counts,
    check_modality,
    check_signals_served,
    encode_crops,
    placed_rows,
    why_counts,
)

LAYOUTS = ("native", "official")


class LlavaNextFamily(LlavaFamily):
    """What vtoken knows about a LLaVA-NeXT config in vLLM: crop grids, signals, counts per image."""

    name = "llava-next"

    def signals(self, method=None) -> set[str]:
        return super().signals(method) - {"resized_grid"}  # crops are stitched back on the grid: no smaller grids

    def crops(self, image_size: Any) -> tuple[int, int]:
        """(rows, cols) of sub-image crops of an image of `image_size` (height, width)."""
        config = self.hf_config
        size = [int(x) for x in image_size]
        return crop_grid(size, config.image_grid_pinpoints, config.vision_config.image_size)

    def anyres(self, image_size: Any):
        """The `vtoken.geometry.anyres.AnyresGrid` of an image of `image_size` (height, width)."""
        config = self.hf_config
        size = [int(x) for x in image_size]
        return anyres_grid(size, config.image_grid_pinpoints, config.vision_config.image_size, self.grid)

    def image_count(self, method, image_size: Any, native_length: int) -> int:
        """Placeholders of one image (known before the encoder); `native_length`: its stock run (vLLM's count)."""
        if EncoderStage(method).placed:
            count = method.count_before_encoding(native_length, (1, native_length), 1)
        else:
            rows, cols = self.crops(image_size)
            crops = 1 + rows * cols
            per_crop = method.count_before_encoding(self.side * self.side, self.grid, crops)
            count = None if per_crop is None else per_crop * crops + _base_newline(method, crops)
        if count is None:
            raise error(f"{method.name}'s token count on {self.name} depends on the data; {why_counts()}")
        return count

    def check(self, config: ServingConfig) -> None:
        tower.check(config, self.name)  # a tower method: refused, naming why
        method, layout = config.method, config.layout
        check_modality(method, self.name)  # first: a method for videos only is refused for that, not its signals
        check_signals_served(method, self.signals(method), self.name)
        check_clip(method, self.hf_config)
        if layout not in LAYOUTS:
            raise error(f"layout={layout!r} is not available for {self.name}; it has: {', '.join(LAYOUTS)}")
        placed = EncoderStage(method).placed
        if placed and layout == "official":
            raise error(
                f"{method.name} selects among the tokens as {self.name} packs them (newlines included), which is "
                "what its official code does: use layout='native'"
            )
        if not placed and layout == "native":
            raise error(
                f"{method.name} on {self.name}'s native layout: that packing ends every row that still keeps "
                "tokens with a newline, so an image's token count is known only after selection, and vLLM sizes "
                "the prompt before the encoder runs. Use layout='official' (every crop keeps its budget of all its "
                "tokens, no unpadding or newlines, as the seed methods' own LLaVA-NeXT code; what "
                "vtoken.patch(model, method, layout='official') does)"
            )
        if layout == "official" and "official" not in method.layouts:
            raise error(
                f"layout='official' on {self.name} is implemented for {', '.join(official_layout_methods())}; "
                f"{method.name!r} declares no official layout (its `layouts` are {method.layouts})"
            )
        n = self.side * self.side
        grid, crops = ((1, n), 1) if placed else (self.grid, 2)  # anyres: at least a base view and one sub-image
        counted = method.count_before_encoding(n, grid, crops)
        if counted is None:
            raise error(
                f"{method.name} ({method!r}) decides its token count on {self.name} from the data; {why_counts()}"
            )


def _base_newline(method, crops: int) -> int:
    """1 where the official packing ends a base-only image with a newline (VisionZip's), else 0."""
    return int(crops == 1 and "newline after base-only image" in method.official_packing)


def checked_config(hf_config: Any) -> ServingConfig | None:
    config = serving_config(hf_config)
    if config is not None:
        LlavaNextFamily(hf_config).check(config)
    return config


class LlavaNextProcessor(PrunedImagePlaceholders, LlavaNextMultiModalProcessor):
    """LLaVA-NeXT's processor with placeholder runs of the kept count."""

    def serving_entry(self, hf_config: Any) -> ServingConfig | None:
        return checked_config(hf_config)

    def kept_count(self, hf_config, method, images, item, out_mm_kwargs) -> int:
        size = images.get_image_size(item)
        native = self.info.get_num_image_tokens(image_width=size.width, image_height=size.height)
        return LlavaNextFamily(hf_config).image_count(method, (size.height, size.width), native)


def build_processor(info, dummy_inputs):
    return LlavaNextProcessor(info, dummy_inputs)


class LlavaNext(PruningModel, LlavaNextForConditionalGeneration):
    """`LlavaNextForConditionalGeneration` that prunes visual tokens when the config carries a `vtoken` entry (and
    is the stock model otherwise)."""

    serving_entry = staticmethod(checked_config)

    def pruned(self, image_input: dict[str, Any], asked: Any) -> tuple[torch.Tensor, ...]:
        method, family = self.vtoken.method, LlavaNextFamily(self.config)
        sizes = image_input["image_sizes"]
        if EncoderStage(method).placed:  # DivPrune: among vLLM's own packing of each image
            placed = list(self._process_image_input(image_input))
            embeds = placed_rows(EncoderStage(method), placed)
            native = [len(p) for p in placed]
        else:
            embeds = self.official_images(image_input["pixel_values"], sizes, asked)
            native = [0] * len(embeds)
        planned = [family.image_count(method, size, n) for size, n in zip(sizes, native, strict=True)]
        check_counts(method, [len(e) for e in embeds], planned, "image")
        return tuple(embeds)

    def official_images(self, pixel_values: torch.Tensor | list[torch.Tensor], image_sizes: torch.Tensor,
                        asked: Any) -> list[torch.Tensor]:  # fmt: skip
        """[k_i, D] per image: every crop's kept tokens, packed as vtoken's official LLaVA-NeXT layout (the same
        `vtoken.geometry.anyres.pack` as `vtoken.patch(model, method, layout="official")`)."""
        method, family = self.vtoken.method, LlavaNextFamily(self.config)
        sizes = image_sizes.tolist() if isinstance(image_sizes, torch.Tensor) else image_sizes
        grids = [family.anyres(size) for size in sizes]
        counts = [grid.num_crops for grid in grids]
        crops = torch.cat([p[:n] for p, n in zip(pixel_values, counts, strict=True)])  # vLLM pads crops per batch
        features, signals = encode_crops(self, family, method, crops)  # [C, N, Dv]
        device = features.device
        image_index = repeated(list(range(len(counts))), counts, device)
        crop_index = on_device([c for n in counts for c in range(n)], device)
        crop_grid = {i: (grid.rows, grid.cols) for i, grid in enumerate(grids)}
        tokens = VisualTokens(features, family.grid, signals, image_index, None, crop_index, crop_grid)
        sources = SignalSources(self.multi_modal_projector, self.text_query(asked, family.name))
        selection, _ = EncoderStage(method).select(tokens, sources)
        rows = kept_rows(selection, tokens.features, tokens.signals, self.multi_modal_projector)
        packed = pack(grids, output_places(selection), selection.counts_per_crop(), rows, self.image_newline,
                      native=False, origin=selection.origin,
                      base_newline="newline after base-only image" in method.official_packing)  # fmt: skip
        return packed.per_image()


PROCESSOR = dict(processor=build_processor, info=LlavaNextProcessingInfo)
