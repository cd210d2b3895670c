"""InternVL 3 / 3.5 (`InternVLForConditionalGeneration`): InternViT with [CLS], pixel shuffle, MLP projector.

An image is cut by `GotOcr2ImageProcessor` into rows x cols tiles plus, when there is more than one tile, a
thumbnail of the whole image (last); a video frame is one tile. Every tile goes through InternViT (448 px, patch
14: 32 x 32 patches after [CLS], which `vision_feature_select_strategy="default"` drops), a 0.5 pixel shuffle
(each 2 x 2 patch group becomes one token: 16 x 16 tokens) and the MLP projector. The visual tokens are the pixel
shuffle's outputs, per crop (a tile, the thumbnail or a video frame); methods select before the projector, which
acts on every token alone. The prompt holds `<img>` + 256 `<IMG_CONTEXT>` per tile + `</img>` per image, and
`FrameN: <img>...</img>` per video frame; the processor merges image tiles and video frames into one
`pixel_values` without saying which tiles belong together, so they are grouped by the placeholder runs, and the
runs labelled "Frame1:", "Frame2:", ... (read with the model's tokenizer) make one video, its frames its crops.
Kept tokens are renumbered (1-D RoPE: the LLM sees a shorter prompt).

[CLS] signals (extension: FasterVLM and HiRED on InternVL): a token's score is the mean, over its 2 x 2 pixel
shuffle group, of the head-mean attention of the [CLS] query to the group's patches in the layer whose output
is the feature, read from q and k after QK-norm where the tower has it. For HiRED the thumbnail plays the base
view. Records number an image's crops in the processor's order (the tiles in raster order, then the thumbnail),
and a video's frames in order (modality "video"; images and videos each numbered on their own). Without the
model's tokenizer (`vtoken.remember_tokenizer`, or a checkpoint to load it from) frames cannot be told from
single-tile images: each is then recorded as an image, and sparse prefill's "grid" pattern is refused at `patch`.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.tables import on_device, repeated, segment_aranges
from vtoken.question import tokenizer_for
from vtoken.records import LazyRecords
from vtoken.tokens import VisualTokens

from .. import hf
from ..base import Adapter, EncodedImages, Modality, flat_kept
from ..calls import PROMPT_IDS
from ..flat_features import FlatFeatures
from ..frames import Columns, host_placeholder_runs
from ..probes import RECEIVED, ClsAttentionProbe, ColumnAttentionProbe, tower_blocks, tower_signals

FRAME_LABEL = re.compile(r"Frame(\d+):\s*(?:<img>)?\s*$")  # the text the processor puts before a video frame


class InternVLAdapter(FlatFeatures, Adapter):
    family = "internvl"
    model_types = ("internvl",)
    model_classes = ("InternVLForConditionalGeneration", "InternVLModel")
    videos_as_image_runs = True  # a video's frames: one single-tile run each, after "FrameN: " in the prompt
    reads_prompt = True  # which tiles make an image or a video is written only in the prompt (its runs and labels)
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
        depth = len(self.tower.encoder.layer)
        if self.model.config.vision_feature_select_strategy == "default":  # a [CLS] token the model drops
            signals |= {"cls_attention", "cls_attention@-1", "keys"}
            signals |= {f"cls_attention@{i}" for i in range(depth)}
            signals |= tower_signals(self.encoder_method, "cls_attention", self.family, depth)  # aliases (HiPrune)
            # the attention every token receives (its [CLS] column dropped), per 2 x 2 pixel-shuffle group
            signals |= tower_signals(self.encoder_method, RECEIVED, self.family, depth)
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
    def _tokenizer_or_none(self) -> Any:
        """The tokenizer that reads the "FrameN:" labels (required at patch by video-only methods), or None."""
        if self._tokenizer is not None:
            return self._tokenizer
        try:
            return tokenizer_for(self.model, "internvl")
        except VTokenError:
            return None

    def check_frame_layout(self) -> None:
        if self._tokenizer_or_none() is None:
            raise VTokenError(
                "sparse_prefill: pattern='grid' on InternVL finds a video's frames by their 'FrameN:' labels in the "
                "prompt, which needs the model's tokenizer: call vtoken.remember_tokenizer(model, processor) first "
                "(or load the model with vtoken.zoo.load)"
            )

    def items(self, input_ids: torch.Tensor | list[list[int]]) -> list[tuple[str, int, list[tuple[int, int]]]]:
        """The prompt's visual items in row-major order: (modality, row, [(start, end) of each placeholder run]):
        an image is one run (its tiles); a video is the runs labelled Frame1:, Frame2:, ... (one tile each).
        `input_ids`: [B, L] (read to the host here) or the host lists a call read already."""
        rows = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids
        tokenizer = self._tokenizer_or_none()
        items: list[tuple[str, int, list[tuple[int, int]]]] = []
        expected = None  # the frame number that continues the current video
        for row, start, end in host_placeholder_runs(rows, self.model.config.image_token_id):
            number = None
            if tokenizer is not None and end - start == self.tokens_per_crop:
                before = rows[row][max(0, start - 16) : start]
                found = FRAME_LABEL.search(tokenizer.decode(before, skip_special_tokens=False))
                number = int(found.group(1)) if found else None
            if number is not None and number == expected and items[-1][1] == row:
                items[-1][2].append((start, end))
            else:
                items.append(("video" if number == 1 else "image", row, [(start, end)]))
            expected = number + 1 if number is not None and items[-1][0] == "video" else None
        return items

    def frame_spans(self, input_ids: torch.Tensor, frames: list[int] | None) -> list[list[torch.Tensor]] | None:
        """Per row, per video, the [F, 2] columns of its frames (each frame a run); None: no video."""
        spans: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
        videos = [(row, runs) for kind, row, runs in self.items(input_ids) if kind == "video"]
        for row, runs in videos:
            spans[row].append(torch.tensor(runs))
        return spans if videos else None

    def frame_read(self, input_ids: torch.Tensor, frames: list[int] | None) -> torch.Tensor:
        """The prompt's ids themselves: its frames are the runs whose "FrameN:" labels the tokenizer reads."""
        return input_ids.long()

    def frame_columns(self, rows: list[list[int]], frames: list[int] | None) -> Columns | None:
        """Per row, per video, the (start, end) columns of its frames (each frame a run), from the host ids."""
        spans: Columns = [[] for _ in rows]
        videos = [(row, runs) for kind, row, runs in self.items(rows) if kind == "video"]
        for row, runs in videos:
            spans[row].append(list(runs))
        return spans if videos else None

    def before_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self._state.family["items"] = self.items(self.on_host(PROMPT_IDS, kwargs["input_ids"]))
        return kwargs

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        size = self.tower.config.image_size
        if pixel_values.dim() != 4 or pixel_values.shape[1] != 3 or tuple(pixel_values.shape[2:]) != tuple(size):
            raise InputError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; {type(self.model).__name__} expects "
                f"[total_tiles, 3, {size[0]}, {size[1]}] (image tiles and video frames), as its processor makes them"
            )
        items, per_crop = self._state.family["items"], self.tokens_per_crop
        runs = [end - start for _, _, spans in items for start, end in spans]
        if any(run % per_crop for run in runs) or sum(runs) // per_crop != pixel_values.shape[0]:
            raise InputError(
                f"the prompt's image placeholder runs {runs} do not hold {per_crop} tokens for each of the "
                f"{pixel_values.shape[0]} tiles in pixel_values; pass input_ids made by the model's own processor "
                "from the same images"
            )
        if "image" not in self.encoder_method.modalities:  # a video method: every item must be a video
            images = [i for i, (kind, _, _) in enumerate(items) if kind == "image"]
            if images:
                raise InputError(
                    f"{self.encoder_method.name} acts on videos only; image {images[0]} of this call is an image, "
                    'not a video frame (no "FrameN: <img>" before it in the prompt)'
                )
        if "video" not in self.encoder_method.modalities:  # an image method: no item may be a video
            videos = [i for i, (kind, _, _) in enumerate(items) if kind == "video"]
            if videos:
                raise InputError(
                    f"{self.encoder_method.name} takes images only (its official code covers images); item "
                    f'{videos[0]} of this call is a video (its frames follow "FrameN:" labels in the prompt)'
                )
        self._state.family["tiles"] = [sum(end - start for start, end in spans) // per_crop for _, _, spans in items]
        return [sum(end - start for start, end in spans) for _, _, spans in items]

    def planned_offsets(
        self, modality: Modality, run_lengths: list[int], planned: list[int]
    ) -> list[int | torch.Tensor] | None:
        """An image's kept tokens anywhere in its one run (only the count matters); a video's, each frame's share at
        the start of its own run (frames are runs apart), when the method keeps a count per frame; None otherwise
        (a method choosing over the whole video: where they stay is known after it chose)."""
        items = self._state.family["items"]
        videos = [(spans, k) for (_, _, spans), k in zip(items, planned, strict=True) if len(spans) > 1]
        if any(self.encoder_method.acts_on == "placed" or k % len(spans) for spans, k in videos):
            return None
        return self._frame_offsets(
            [[k // len(spans)] * len(spans) for (_, _, spans), k in zip(items, planned, strict=True)]
        )

    def _frame_offsets(self, kept: list[list[int]]) -> list[int | torch.Tensor]:
        """Per item, the offsets in its placeholders that stay when its crop i keeps `kept[item][i]`: an item of
        one run keeps its first ones (a count); a video's frame i the first ones of its own run (a few kernels for
        all videos at once)."""
        device = self.model.device
        frames = [counts for counts in kept if len(counts) > 1]
        if not frames:
            return [counts[0] for counts in kept]
        counts = [n for item in frames for n in item]
        starts = [i * self.tokens_per_crop for item in frames for i in range(len(item))]
        offsets = (segment_aranges(counts, device) + repeated(starts, counts, device)).split([sum(f) for f in frames])
        videos = iter(offsets)
        return [next(videos) if len(counts) > 1 else counts[0] for counts in kept]

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
        method, blocks = self.encoder_method, self.tower.encoder.layer
        probes, wanted = {}, {}  # (layer, kind) -> its probe; signal name -> (layer, kind)
        rows = tower_blocks(method, "cls_attention", self.family, len(blocks), None)
        if {"cls_attention", "keys"} & set(method.requires):
            rows.update({name: self._attention_layer(layer) for name in ("cls_attention", "keys")
                         if name in method.requires})  # fmt: skip
        for name, index in rows.items():
            # q and k as the attention uses them: after QK-norm (Identity without it)
            probes.setdefault((index, "row"), ClsAttentionProbe(blocks[index].attention,
                                                                projections=("q_norm", "k_norm")))  # fmt: skip
            wanted[name] = (index, "row")
        received = tower_blocks(method, RECEIVED, self.family, len(blocks), None)
        if RECEIVED in method.requires:
            received[RECEIVED] = self._attention_layer(layer)
        for name, index in received.items():
            probes.setdefault((index, "column"), ColumnAttentionProbe(blocks[index].attention,
                                                                      projections=("q_norm", "k_norm")))  # fmt: skip
            wanted[name] = (index, "column")
        with ExitStack() as stack:
            for probe in probes.values():
                stack.enter_context(probe)
            out = self.tower(pixel_values=tiles.to(self.tower.dtype), output_hidden_states=layer != -1)
        hidden = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        side = self.patch_grid
        patches = hidden[:, 1:].reshape(hidden.shape[0], side, side, -1)
        shuffled = hf.pixel_shuffle(self.inner, patches, self.model.config.downsample_ratio)
        features = shuffled.reshape(hidden.shape[0], self.tokens_per_crop, -1)

        def grouped(probe: ClsAttentionProbe | ColumnAttentionProbe) -> torch.Tensor:  # each pixel-shuffle group's mean
            scores = probe.scores if isinstance(probe, ClsAttentionProbe) else probe.patch_scores
            maps = scores.reshape(-1, 1, side, side)
            return F.avg_pool2d(maps, self.group).flatten(1)

        def shuffled_keys(probe: ClsAttentionProbe) -> torch.Tensor:  # a token's key: its group's, concatenated
            keys = probe.patch_keys.reshape(hidden.shape[0], side, side, -1)
            shuffled = hf.pixel_shuffle(self.inner, keys, self.model.config.downsample_ratio)
            return shuffled.reshape(hidden.shape[0], self.tokens_per_crop, -1)

        signals = {name: (lambda probe=probes[key], name=name: (shuffled_keys if name == "keys" else grouped)(probe))
                   for name, key in wanted.items()}  # fmt: skip
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
        items, item_tiles = self._state.family["items"], self._state.family["tiles"]
        for item, ((kind, _, _), tiles) in enumerate(zip(items, item_tiles, strict=True)):
            image_index += [item] * tiles
            crop_index += list(range(tiles))  # the processor's order: tiles then the thumbnail, or frames
            if kind == "video":  # a video's crops are its frames, in order
                base_first += list(range(tiles))
            elif tiles == 1:  # a single tile
                base_first.append(0)
            else:  # for methods, the thumbnail is the base view (crop 0), the tiles follow
                base_first += [*range(1, tiles), 0]
                crop_grid[item] = (1, tiles - 1)  # only the tile count is known (HiRED's "bands" need no more)
        device = features.device
        tokens = VisualTokens(features, self.grid, signals, repeated(list(range(len(item_tiles))), item_tiles, device),
                              None, on_device(base_first, device), crop_grid or None,
                              image_of_crop=image_index)  # fmt: skip
        selection, timer = self.select(tokens)
        projected = tokens.signals.get("projected")
        if projected is not None and selection.kept is not None:  # a method already projected every token (MMTok)
            embeds = flat_kept(selection, projected)
        else:  # the projector acts on every token alone: project only what is kept (or merged)
            embeds = self.project(flat_kept(selection, features))
        counts = selection.counts_per_crop()
        # an item's crops are consecutive: its tokens are one stretch of `embeds`; each crop's kept tokens stay in
        # its own stretch of the placeholders (a video's frames are runs apart)
        kept, first = [], 0
        for tiles in item_tiles:
            kept.append(counts[first : first + tiles])
            first += tiles
        per_image = list(embeds.split([sum(k) for k in kept]))
        offsets = self._frame_offsets(kept)
        # records: images and videos numbered on their own, a video's frames its crops
        kinds = [kind for kind, _, _ in items]
        number = [kinds[:item].count(kind) for item, kind in enumerate(kinds)]
        crop_records = self.encoder.crop_records(tokens, selection, timer, crop_index, images=image_index)
        records = LazyRecords(
            lambda: [
                dataclasses.replace(record, image=number[record.image], modality=kinds[record.image])
                for record in crop_records
            ]
        )
        return EncodedImages(per_image, offsets, records)
