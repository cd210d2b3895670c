"""InternVL 3 / 3.5 (`InternVLForConditionalGeneration`): InternViT with [CLS], pixel shuffle, MLP projector.

An image is cut by `GotOcr2ImageProcessor` into rows x cols tiles plus, when there is more than one tile, a
thumbnail of the whole image (last); a video frame is one tile. Every tile goes through InternViT (448 px, patch
14: 32 x 32 patches after [CLS], which `vision_feature_select_strategy="default"` drops), a 0.5 pixel shuffle
(each 2 x 2 patch group becomes one token: 16 x 16 tokens) and the MLP projector. The visual tokens are the pixel
shuffle's outputs, per crop (a tile, the thumbnail or a video frame); methods select before the projector, which
acts on every token alone. The prompt holds `<img>` + 256 `<IMG_CONTEXT>` per tile + `</img>` per image, and
`FrameN: <img>...</img>` per video frame; the processor merges image tiles and video frames into one
`pixel_values` without saying which tiles belong together, so they are grouped by the placeholder runs. Kept
tokens are renumbered (1-D RoPE: the LLM sees a shorter prompt).

[CLS] signals (extension: FasterVLM and HiRED on InternVL): a token's score is the mean, over its 2 x 2 pixel
shuffle group, of the head-mean attention of the [CLS] query to the group's patches in the layer whose output
is the feature, read from q and k after QK-norm where the tower has it. For HiRED the thumbnail plays the base
view. Records number an image's crops in the processor's order (the tiles in raster order, then the thumbnail).
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F

from vtoken.errors import InputError, VTokenError
from vtoken.question import tokenizer_for
from vtoken.registry import register_adapter
from vtoken.tokens import VisualTokens

from .base import Adapter, EncodedImages, Modality
from .flat_features import FlatFeatures
from .probes import ClsAttentionProbe

FRAME = re.compile(r"Frame(\d+):\s*<img>\s*$")  # InternVLProcessor's text before a video frame's placeholders


@register_adapter
class InternVLAdapter(FlatFeatures, Adapter):
    family = "internvl"
    model_types = ("internvl",)
    model_classes = ("InternVLForConditionalGeneration", "InternVLModel")
    videos_as_image_runs = True  # a video's frames: one single-tile run each, after "FrameN: " in the prompt
    modalities = (
        Modality("image", "pixel_values", "image_token_id", ("vision_feature_layer", "vision_feature_select_strategy")),
    )

    @property
    def tower(self):
        return self.inner.vision_tower

    @property
    def patch_grid(self) -> int:
        """Patches per side of a tile."""
        config = self.tower.config
        return config.image_size[0] // config.patch_size[0]

    @property
    def grid(self) -> tuple[int, int]:
        """Tokens per side of a crop after the pixel shuffle."""
        side = int(self.patch_grid * self.model.config.downsample_ratio)
        return side, side

    @property
    def tokens_per_crop(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def group(self) -> int:
        """Patches per side of one pixel-shuffle group (2 for the 0.5 ratio)."""
        return round(1 / self.model.config.downsample_ratio)

    def _feature_layer(self, vision_feature_layer: Any = None) -> int:
        layer = self.model.config.vision_feature_layer if vision_feature_layer is None else vision_feature_layer
        if not isinstance(layer, int):
            raise InputError(f"vision_feature_layer={layer!r}; InternVL takes the features of one layer (an int)")
        return layer

    def _attention_layer(self, hidden_state_index: int) -> int:
        """Index of the encoder layer whose output is `hidden_states[hidden_state_index]` (index 0 = embeddings)."""
        num_layers = len(self.tower.encoder.layer)
        layer = hidden_state_index % (num_layers + 1) - 1
        if layer < 0:
            raise VTokenError(f"vision_feature_layer={hidden_state_index} is the embeddings: no attention to probe")
        return layer

    def available_signals(self) -> set[str]:
        # "resized_grid": positions are renumbered, so a smaller grid only means fewer placeholders
        signals = {"patch_features", "grid", "resized_grid"}
        if self.model.config.vision_feature_select_strategy == "default":  # a [CLS] token the model drops
            signals |= {"cls_attention", "cls_attention@-1", "keys"}
            signals |= {f"cls_attention@{i}" for i in range(len(self.tower.encoder.layer))}
        return signals

    def validate(self) -> None:
        super().validate()
        method = self.encoder_method
        if method is not None and "image" not in method.modalities:  # frames are told from images by the prompt
            self._tokenizer = tokenizer_for(self.model, method.name)
        if method is not None and getattr(method, "partition", "bands") != "bands":
            raise VTokenError(
                f"{method.name}: partition={method.partition!r} needs the tile grid's rows and columns, which "
                f"{self.family}'s processor does not return (only the tile count is known); use partition='bands' "
                "(the official code's split, which needs only the tile count)"
            )

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.inner.multi_modal_projector(features)

    # ----------------------------------------------------------------- tiles grouped by placeholder runs
    def before_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self._input_ids = kwargs["input_ids"]
        return kwargs

    def _frames(self, runs: list[int]) -> list[tuple[int, int]]:
        """For a video-only method: (video, frame) of every placeholder run, read from the prompt, where the
        processor writes "FrameN: <img>" before each frame's run; an image's run is refused (InputError)."""
        ids = self._input_ids.cpu()
        is_placeholder = ids == self.model.config.image_token_id
        found, video, previous = [], -1, None  # previous: (row, frame number) of the run before
        for row in range(ids.shape[0]):
            padded = torch.cat([torch.tensor([False]), is_placeholder[row], torch.tensor([False])]).int()
            for start in (padded.diff() == 1).nonzero().squeeze(1).tolist():
                before = self._tokenizer.decode(ids[row, max(0, start - 16) : start], skip_special_tokens=False)
                match = FRAME.search(before)
                if match is None:
                    raise InputError(
                        f"{self.encoder_method.name} acts on videos only; image {len(found)} of this call is an "
                        'image, not a video frame (no "FrameN: <img>" before it in the prompt)'
                    )
                number = int(match.group(1))
                if previous != (row, number - 1):
                    video += 1
                found.append((video, 0 if previous != (row, number - 1) else found[-1][1] + 1))
                previous = (row, number)
        if len(found) != len(runs):
            raise InputError(f"{len(found)} frames found in the prompt for {len(runs)} placeholder runs")
        return found

    def _runs(self) -> list[int]:
        """Lengths of the contiguous placeholder runs of the prompt, in row-major order (one per image or frame)."""
        is_placeholder = (self._input_ids == self.model.config.image_token_id).cpu()
        runs = []
        for row in is_placeholder:
            padded = torch.cat([torch.tensor([False]), row, torch.tensor([False])]).int()
            starts = (padded.diff() == 1).nonzero().squeeze(1)
            ends = (padded.diff() == -1).nonzero().squeeze(1)
            runs += (ends - starts).tolist()
        return runs

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        size = self.tower.config.image_size
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3 or tuple(pixel_values.shape[2:]) != tuple(size):
            raise InputError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"[total_tiles, 3, {size[0]}, {size[1]}] (image tiles and video frames), as its processor makes them"
            )
        runs, per_crop = self._runs(), self.tokens_per_crop
        if any(run % per_crop for run in runs) or sum(runs) // per_crop != pixel_values.shape[0]:
            raise InputError(
                f"the prompt's image placeholder runs {runs} do not hold {per_crop} tokens for each of the "
                f"{pixel_values.shape[0]} tiles in pixel_values; pass input_ids made by the model's own processor "
                "from the same images"
            )
        self._tiles = [run // per_crop for run in runs]
        if "image" not in self.encoder_method.modalities:
            self._state.family["frames"] = self._frames(runs)
        return runs

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        kept = self.encoder_method.planned_count(self.tokens_per_crop)
        return [None if kept is None else run // self.tokens_per_crop * kept for run in run_lengths]

    # ----------------------------------------------------------------- the vision side
    def vision_tokens(
        self, tiles: torch.Tensor, vision_feature_layer: Any = None, vision_feature_select_strategy: str | None = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Tiles [C, 3, H, W] -> pixel-shuffled features [C, N, 4 * Dv] (before the projector) and the [CLS]
        signals the method needs, as callables of [C, N] scores."""
        self.check_select_strategy(vision_feature_select_strategy)
        layer = self._feature_layer(vision_feature_layer)
        probes, wanted = {}, {}  # layer -> its probe; signal name -> its layer
        for name in self.encoder_method.requires:
            if name in ("cls_attention", "keys"):
                index = self._attention_layer(layer)
            elif name.startswith("cls_attention@"):
                index = int(name.removeprefix("cls_attention@")) % len(self.tower.encoder.layer)
            else:
                continue
            attention = self.tower.encoder.layer[index].attention
            # q and k as the attention uses them: after QK-norm (Identity without it)
            probes.setdefault(index, ClsAttentionProbe(attention, projections=("q_norm", "k_norm")))
            wanted[name] = index
        with ExitStack() as stack:
            for probe in probes.values():
                stack.enter_context(probe)
            out = self.tower(pixel_values=tiles.to(self.tower.dtype), output_hidden_states=layer != -1)
        hidden = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        side = self.patch_grid
        patches = hidden[:, 1:].reshape(hidden.shape[0], side, side, -1)
        shuffled = self.inner.pixel_shuffle(patches, scale_factor=self.model.config.downsample_ratio)
        features = shuffled.reshape(hidden.shape[0], self.tokens_per_crop, -1)

        def grouped(probe: ClsAttentionProbe) -> torch.Tensor:  # mean over each pixel-shuffle group
            maps = probe.scores.view(-1, 1, side, side)
            return F.avg_pool2d(maps, self.group).flatten(1)

        def shuffled_keys(probe: ClsAttentionProbe) -> torch.Tensor:  # a token's key: its group's, concatenated
            keys = probe.patch_keys.reshape(hidden.shape[0], side, side, -1)
            shuffled = self.inner.pixel_shuffle(keys, scale_factor=self.model.config.downsample_ratio)
            return shuffled.reshape(hidden.shape[0], self.tokens_per_crop, -1)

        signals = {name: (lambda probe=probes[index], name=name: (shuffled_keys if name == "keys" else grouped)(probe))
                   for name, index in wanted.items()}  # fmt: skip
        return features, signals

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> EncodedImages:
        features, signals = self.vision_tokens(pixel_values, vision_feature_layer, vision_feature_select_strategy)
        image_index, crop_index, base_first, crop_grid = [], [], [], {}
        for image, tiles in enumerate(self._tiles):
            image_index += [image] * tiles
            crop_index += list(range(tiles))  # the processor's order: tiles, then the thumbnail
            if tiles == 1:  # a single tile or a video frame
                base_first.append(0)
            else:  # for methods, the thumbnail is the base view (crop 0), the tiles follow
                base_first += [*range(1, tiles), 0]
                crop_grid[image] = (1, tiles - 1)  # only the tile count is known (HiRED's "bands" need no more)
        modality_name = "image"
        if "image" not in self.encoder_method.modalities:  # a video method: frames grouped by video
            frames = self._state.family["frames"]
            image_index, crop_index = [v for v, _ in frames], [f for _, f in frames]
            base_first, crop_grid, modality_name = crop_index, {}, "video"
        tokens = VisualTokens(features, self.grid, signals, torch.tensor(image_index), None,
                              torch.tensor(base_first), crop_grid or None)  # fmt: skip
        selection, timer = self.select(tokens)
        projected = tokens.signals.get("projected")
        if projected is not None and selection.kept is not None:  # a method already projected every token (MMTok)
            embeds = torch.cat([projected[c, selection.kept_of(c)] for c in range(tokens.num_crops)])
        else:  # the projector acts on every token alone: project only what is kept (or merged)
            embeds = self.project(selection.gather_flat(features))
        counts = selection.counts_per_crop()
        per_crop = list(embeds.split(counts))
        per_image, offsets, first = [], [], 0
        for tiles in self._tiles:
            crops = range(first, first + tiles)
            first += tiles
            per_image.append(torch.cat([per_crop[c] for c in crops]))
            offsets.append(torch.arange(sum(counts[c] for c in crops)))
        records = self.crop_records(tokens, selection, timer, crop_index, modality_name)
        return EncodedImages(per_image, offsets, records)
