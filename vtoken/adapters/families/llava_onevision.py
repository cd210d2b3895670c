"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): SigLIP tower (no [CLS]), projector before packing.

Images: a base view (27 x 27 tokens) plus, for single-image prompts, the anyres sub-images stitched into one
grid, unpadded, and bilinearly downsampled when larger than `anyres_max_9` allows. The visual tokens are
exactly those the model would pack, computed by the model's own functions: crop 0 is the base view and crop 1
the final stitched grid. After selection, the native packing is kept: base tokens ascending, then the
stitched grid's kept tokens in raster order with `image_newline` after every row that still has tokens (a
single newline after a base-only image). Videos: each frame's tokens are pooled bilinearly to 14 x 14 by the
model, budgets apply per frame, and one newline follows the whole video.

Tower stage (METHODS-4-tower.md, an extension: SigLIP has no [CLS], p = 0): the native packing stitches, unpads
and bilinearly downsamples the grid crops after the tower, where a merged or dropped token has no cell, so tower
methods take `layout="official"`, the flat layout (MustDrop's packing on LLaVA-NeXT): every crop of an image alike
(the base view, then the grid crops, each of 27 x 27 patches before the tower), no unpadding, no downsampling, no
newline. ToMe merges in the SigLIP blocks up to the feature layer (`ToMeTower`); PixelPrune runs the tower on every
crop's kept patches (`KeptPatches`). The count leaving the tower is known before it runs, so the prompt is shrunk
first; positions are renumbered. An encoder method composed with one selects per crop among what the tower left.
Videos are refused: their frames are pooled 2x2 (bilinearly) on the token grid after the tower.

Video signals (pooled like the tokens): "siglip_head_attention" / "siglip_head_pooled", SigLIP's attention-pooling
head on the tower features (FastVID; the head comes from the method's `head` when the checkpoint lacks it, as
Hugging Face OneVision checkpoints do), and "tower_attention", the feature layer's attention per token, mean over
heads and queries (HoliTom).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import nn

from vtoken.errors import InputError, MissingSignalError, VTokenError
from vtoken.geometry.anyres import AnyresGrid, onevision_grid, onevision_max_crops, pack, with_row_after
from vtoken.geometry.kept import item_groups
from vtoken.geometry.tables import on_device, padded_rows, repeated, stack_padded
from vtoken.hub import hub_kwargs
from vtoken.records import LazyRecords
from vtoken.tokens import VisualTokens

from .. import hf
from ..base import EncodedImages, Modality, flat_kept, output_places
from ..probes import RECEIVED, ColumnAttentionProbe, tower_blocks, tower_signals
from .llava import LlavaAdapter

SIGLIP_CHECKPOINT = "google/siglip-so400m-patch14-384"  # the tower of the LLaVA-OneVision checkpoints


@functools.lru_cache(maxsize=2)
def _checkpoint_head(path: str) -> tuple[nn.Module, nn.Module] | None:
    """(post_layernorm, head) of a SigLIP checkpoint, loaded once per process (the rest of the tower is dropped)."""
    kwargs = {} if os.path.isdir(path) else hub_kwargs(path)
    return hf.load_pooling_head(path, **kwargs)


FEATURE_KWARGS = ("vision_feature_layer", "vision_feature_select_strategy")


class LlavaOnevisionAdapter(LlavaAdapter):
    family = "llava-onevision"
    clip_tower = False  # SigLIP: no CLIP text tower of its own
    model_types = ("llava_onevision",)
    model_classes = ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id",
                 ("image_sizes", "batch_num_images", "vision_aspect_ratio", *FEATURE_KWARGS),
                 host=("image_sizes", "batch_num_images")),
        Modality("video", "pixel_values_videos", "video_token_id", FEATURE_KWARGS),
    )  # fmt: skip
    stacked_features = frozenset({"video"})
    # "official": the tower methods' flat layout (every crop alike, no unpadding, downsampling or newline)
    layouts = ("native", "official")
    tower_acts = ("input", "layers")  # images only: PixelPrune's kept patches, ToMe's merging SigLIP blocks
    tower_refusals = {
        "video": "its video frames are pooled 2x2 (bilinearly) on the token grid after the tower, where a merged or "
        "dropped token has no cell"
    }
    video_run_trailer = 1  # a video's placeholder run ends with one image_newline, not a frame token

    @property
    def positions(self) -> str:
        """The kept tokens' positions: "original" where the encoder method keeps them in place (FastVID's official
        code on OneVision videos: `position_ids = keep_indexs`, with gaps; such methods are video-only, and only the
        video path gives offsets), else "renumber" (contiguous, the model's own numbering of the shorter prompt)."""
        method = self.encoder_method
        return "original" if getattr(method, "encoder_positions", "renumber") == "original" else "renumber"

    def position_offset(self, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """[B] with original positions, what decoding adds to a position counted over the real tokens: the prompt's
        largest position + 1 minus its real tokens (the tokens dropped before it); None when renumbered."""
        positions = kwargs.get("position_ids")
        if self.positions == "renumber" or positions is None:
            return None
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        largest = positions.masked_fill(~valid.to(positions.device), -1).amax(-1)
        return largest + 1 - valid.sum(1).to(largest.device)

    def continued_positions(
        self, mask: torch.Tensor, past: int, tail_positions: torch.Tensor | None, offset: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, past + n]: one position per real token of `mask`, moved on by `offset` (the tokens an earlier call
        dropped while the kept ones kept their places); new tokens with positions of their own (`tail_positions`,
        a later turn's pruned video, numbered from their first real token) start where decoding would continue."""
        positions = super().continued_positions(mask, past, tail_positions, offset)
        if offset is None:
            return positions
        positions = positions + offset.to(positions.device)[:, None]
        if tail_positions is not None:
            start = mask[:, :past].long().sum(1) + offset.to(mask.device)  # each row's first new real token
            positions[:, past:] = tail_positions.to(positions) + start[:, None]
        return positions.masked_fill(mask == 0, 0)

    def available_signals(self) -> set[str]:
        # SigLIP has no [CLS]; video frames are plain grids, so they can be resized; "projected_merge": the projector
        # and pooling run before selection, so a merge of LLM-input tokens (PruneVid) reaches the LLM as it is.
        # Images: "received_attention" (the feature layer's block) and "received_attention@L", the attention every
        # patch receives, stitched, unpadded and downsampled with the tokens as one-channel maps
        depth = len(self.tower.encoder.layers)
        return {"patch_features", "grid", "resized_grid", "siglip_head_attention", "siglip_head_pooled",
                "tower_attention", "projected_merge"} | tower_signals(self.encoder_method, RECEIVED, self.family,
                                                                      depth)  # fmt: skip

    def validate(self) -> None:
        method = self.encoder_method
        if method is not None and getattr(method, "scope", None) == "split":
            raise VTokenError(
                f"{method.name}: scope='split' shares an image's budget equally over its crops, and "
                f"{self.family} selects an anyres image's base view and its stitched grid apart (they are not "
                "crops of one geometry); use scope='crop' (each keeps its budget)"
            )
        tower = self.tower_method
        if tower is not None and self.layout == "native":
            raise VTokenError(
                f"{tower.name} acts in the vision tower, and {self.family}'s native layout stitches, unpads and "
                "bilinearly downsamples the grid crops after it, where a merged or dropped token has no cell; use "
                "layout='official' (the flat layout: every crop alike, base view then the grid crops, no unpadding, "
                "downsampling or newline)"
            )
        if tower is None and self.layout == "official":
            raise VTokenError(
                f"layout='official' on {self.family} is the flat layout of the tower methods (tome, pixelprune); no "
                "encoder method has an official layout here: use layout='native'"
            )
        if tower is not None and method is not None and method.acts_on == "placed":
            raise VTokenError(
                f"{method.name} selects among the tokens as the model packs them (newlines included), which the flat "
                f"layout of {tower.name} on {self.family} does not have; use {tower.name} alone or with a method "
                "selecting per crop"
            )
        super().validate()
        if tower is not None:
            self.check_tower_strategy(self.model.config.vision_feature_select_strategy, VTokenError)
        self._pooling_head = None
        method = self.encoder_method
        if method is not None and method.wants("siglip_head_attention"):
            self._pooling_head = self.pooling_head(method.name, getattr(method, "head", None))

    def pooling_head(self, owner: str, source: Any) -> tuple[nn.Module, nn.Module]:
        """(post_layernorm, head) of SigLIP's attention-pooling head for this tower: the tower's own when it has
        one, else from `source` (a SigLIP checkpoint id or directory, or a module holding them), on the tower's
        device and dtype; a clear error when neither gives one."""
        how = (f"pass head={SIGLIP_CHECKPOINT!r} (the SigLIP checkpoint this tower comes from: a hub id or a local "
               "directory) or a loaded SiglipVisionModel with its head")  # fmt: skip
        if source is None:
            found = hf.pooling_head_of(self.tower)
            if found is None:
                raise MissingSignalError(
                    f"{owner}: {type(self.model).__name__}'s SigLIP tower has no attention-pooling head (Hugging Face "
                    "LLaVA-OneVision checkpoints are converted with vision_use_head=False, leaving out "
                    f"`post_layernorm` and `head`), which {owner} reads; {how}"
                )
            return found  # the tower's own, used in place
        if isinstance(source, nn.Module):
            found = hf.pooling_head_of(source)
            what = f"the module {type(source).__name__}"
        else:
            path = os.fspath(source)
            what = f"the checkpoint {path!r}"
            try:
                found = _checkpoint_head(path)
            except VTokenError as err:  # offline and not cached
                raise MissingSignalError(f"{owner}: head={path!r} cannot be loaded: {err}") from err
            except (OSError, ValueError) as err:  # missing, unreadable, or not a valid hub id
                raise MissingSignalError(f"{owner}: head={path!r} cannot be loaded ({err}); {how}") from err
        if found is None:
            raise MissingSignalError(f"{owner}: {what} has no SigLIP attention-pooling head (`post_layernorm` and "
                                     f"`head` with a probe); {how}")  # fmt: skip
        width = self.tower.config.hidden_size
        if found[1].probe.shape[-1] != width:
            raise MissingSignalError(
                f"{owner}: the attention-pooling head of {what} is {found[1].probe.shape[-1]} wide, this tower's "
                f"features {width}: the head must come from the SigLIP checkpoint the tower was trained from"
            )
        parameter = next(self.tower.parameters())
        return tuple(copy.deepcopy(m).to(parameter.device, parameter.dtype).eval() for m in found)

    def video_signals(
        self, hidden: torch.Tensor, probe: ColumnAttentionProbe | None, drop_first: bool
    ) -> dict[str, Any]:
        """The video signals the method requires, as callables (computed inside the selection's timer), each
        pooled to the frames' token grid: hidden [C, N, Dv] the tower features the projector gets."""
        method, signals = self.encoder_method, {}

        def pooled(values: torch.Tensor) -> torch.Tensor:  # [C, N] -> [C, T], as the model pools the tokens
            return hf.pool_video_frames(self.inner, values[..., None].float())[..., 0]

        if method.wants("siglip_head_attention"):
            norm, head = self._pooling_head
            outputs = functools.cache(lambda: hf.pooling_head_outputs(norm, head, hidden))
            signals["siglip_head_attention"] = lambda: pooled(outputs()[0])
            signals["siglip_head_pooled"] = lambda: outputs()[1]
        if probe is not None:
            signals["tower_attention"] = lambda: pooled(probe.scores[:, 1:] if drop_first else probe.scores)
        return signals

    @staticmethod
    def _run_offsets(
        selection: Any, rows: torch.Tensor, frames: int, tokens: int, kept: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Where every video's output rows stand in its placeholder run (F frames of T tokens, then the newline):
        (rows [sum kept, D] ordered by place within each video, per video its [kept + 1] ascending offsets, the
        newline's F * T last, and [sum kept] that order of the rows). Crops are the videos' frames in order. A fixed
        few kernels, no host sync."""
        device = rows.device
        width = max(selection.num_kept, 1)
        picked = padded_rows(selection.counts_per_crop(), width, device)  # real entries of the [C, width] rows
        crop = picked // width
        places = output_places(selection).flatten()[picked] + (crop % frames) * tokens
        order = (crop // frames * (frames * tokens + 1) + places).argsort()  # by video, then place
        places = places[order]
        ends = torch.full((1,), frames * tokens, dtype=places.dtype, device=device)
        offsets = with_row_after(places[:, None], kept, ends)[:, 0].split([n + 1 for n in kept])
        return rows[order], list(offsets), order

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features  # selection runs after the projector (and the model's own pooling/stitching)

    def _crop_counts(self, image_sizes: Any, batch_num_images: Any) -> list[int]:
        """Crops per image, as the model decides them (anyres only for single-image prompts)."""
        if image_sizes is None:
            raise InputError(f"{type(self.model).__name__} needs `image_sizes` next to pixel_values")
        sizes = self.on_host("image_sizes", image_sizes)
        per_prompt = self.on_host("batch_num_images", batch_num_images)
        patching = [True] * len(sizes) if per_prompt is None else [n == 1 for n in per_prompt for _ in range(n)]
        config = self.model.config
        crops = hf.modeling_function("llava_onevision", "image_size_to_num_patches")
        return [
            crops(list(size), config.image_grid_pinpoints, config.vision_config.image_size) if patch else 1
            for size, patch in zip(sizes, patching, strict=True)
        ]  # fmt: skip

    # ----------------------------------------------------------------- the tower stage (images, flat)
    def check_tower_strategy(self, strategy: str | None, error: type[VTokenError] = InputError) -> None:
        """A tower method reads every SigLIP token as a patch (no [CLS], p = 0): the "full" feature strategy only
        ("default" drops the tower's first token, a patch here, as if it were a [CLS]); `error`: what to raise (at
        `patch`: `VTokenError`; a call's own strategy: `InputError`)."""
        if strategy != "full":
            raise error(
                f"{self.tower_method.name} on {self.family}: vision_feature_select_strategy={strategy!r} drops the "
                "SigLIP tower's first token, a patch (SigLIP has no [CLS]), which the tower stage keeps; use 'full' "
                "(the OneVision checkpoints' own)"
            )

    def image_crops(
        self, modality: Modality, pixel_values: torch.Tensor, image_sizes: Any = None, batch_num_images: Any = None,
        vision_feature_select_strategy: str | None = None, **encoder_kwargs: Any,
    ) -> tuple[torch.Tensor, list[int], list[int]] | None:  # fmt: skip
        """Images: every image's crops [C, 3, H, W] as the model runs its tower on them (base view first, then the
        grid crops; anyres only for single-image prompts), each crop's image and index within it (host ints)."""
        if modality.name != "image":
            return None
        self.check_tower_strategy(vision_feature_select_strategy or self.model.config.vision_feature_select_strategy)
        counts = self._crop_counts(image_sizes, batch_num_images)
        if pixel_values.dim() == 5:
            pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, counts, strict=True)])
        images = [i for i, n in enumerate(counts) for _ in range(n)]
        return pixel_values, images, [c for n in counts for c in range(n)]

    def encode_flat(
        self, modality: Modality, pixel_values: torch.Tensor, vision_feature_layer: Any = None, **encoder_kwargs: Any
    ) -> EncodedImages:
        """Images after a tower method: every crop's tokens as the tower left them (ToMe's N' merged tokens as a
        1 x N' row; PixelPrune's kept patches, the dropped ones invalid cells of the crop's grid), projected, to the
        encoder method per crop; its kept ones concatenated per image, crop after crop, no newline."""
        plan = self.tower_plan(modality)
        crops, images, crop_index = self.image_crops(modality, pixel_values, **encoder_kwargs)
        layers = self._feature_layers(vision_feature_layer)
        with plan.running(self.tower.encoder, hf.attention_implementation(self.tower)):
            hidden = torch.cat(hf.hidden_states(self.tower, layers, crops), dim=-1)  # [C, K or N', Dv]
        features = self.inner.multi_modal_projector(hidden)  # selection after the projector, as for native images
        features, signals, grid, valid, counts = self.tower_tokens(plan, features, {})
        device = features.device
        tokens = VisualTokens(features, grid, signals, on_device(images, device), valid, on_device(crop_index, device),
                              image_of_crop=images, valid_counts=counts)  # fmt: skip
        selection, timer = self.select(tokens)
        per_image = plan.item_counts(selection.counts_per_crop())  # host counts: crops concatenated per image
        records = self.encoder.crop_records(tokens, selection, timer, crop_index, images=images)
        return EncodedImages(list(self.kept_flat(tokens, selection).split(per_image)), None, records)

    def stitched_grid(self, image_size: Any, vision_aspect_ratio: str | None = None) -> tuple[int, int]:
        """(rows, cols) of the stitched grid the model packs for an anyres image: unpadded, then downsampled."""
        config = self.model.config
        size = image_size.tolist() if isinstance(image_size, torch.Tensor) else list(image_size)
        max_crops = onevision_max_crops(vision_aspect_ratio or config.vision_aspect_ratio)
        return onevision_grid(size, config.image_grid_pinpoints, config.vision_config.image_size, self.grid[0],
                              max_crops)  # fmt: skip

    def plan(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        image_sizes: Any = None,
        batch_num_images: Any = None,
        vision_aspect_ratio: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        side = self.grid[0]
        if modality.name == "video":
            self._check_crops(pixel_values.flatten(0, 1), "[num_videos, num_frames, 3, H, W]")
            pooled = math.ceil(side / 2) ** 2
            return [pixel_values.shape[1] * pooled + 1] * pixel_values.shape[0]
        self._check_crops(pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values,
                          "[num_images, num_crops, 3, H, W]")  # fmt: skip
        runs = []
        sizes = self.on_host("image_sizes", image_sizes)
        for size, crops in zip(sizes, self._crop_counts(image_sizes, batch_num_images), strict=True):
            if crops == 1:
                runs.append(side * side + 1)
            else:
                rows, cols = self.stitched_grid(size, vision_aspect_ratio)
                runs.append(side * side + rows * cols + rows)
        return runs

    def planned_counts(self, modality: Modality, run_lengths: list[int]) -> list[int | None]:
        if modality.name == "image":
            plan = self.tower_plan(modality)
            if plan is None:
                return [None] * len(run_lengths)  # rows with newlines depend on which tokens are kept
            # flat after a tower method: every crop's count (what the tower leaves, then the encoder method's)
            per_crop = [self.encoder_method.planned_count(n) for n in plan.counts]
            return [None] * len(run_lengths) if None in per_crop else plan.item_counts(per_crop)
        pooled = math.ceil(self.grid[0] / 2) ** 2
        whole = getattr(self.encoder_method, "video_count", None)  # a video's count from its frames (DyCoke)
        if whole is not None:
            return [whole((run - 1) // pooled, pooled) + 1 for run in run_lengths]
        kept = self.encoder_method.planned_count(pooled)
        return [None if kept is None else (run - 1) // pooled * kept + 1 for run in run_lengths]

    def _tower_features(self, crops: torch.Tensor, vision_feature_layer: Any, strategy: str | None) -> torch.Tensor:
        """[C, N, Dv] what the projector gets: the feature layer(s)' hidden states (the first token dropped for
        the "default" strategy)."""
        layers = self._feature_layers(vision_feature_layer)
        hidden = torch.cat(hf.hidden_states(self.tower, layers, crops), dim=-1)
        if (strategy or self.model.config.vision_feature_select_strategy) == "default":
            hidden = hidden[:, 1:]
        return hidden

    def _projected(self, crops: torch.Tensor, vision_feature_layer: Any, strategy: str | None) -> torch.Tensor:
        return self.inner.multi_modal_projector(self._tower_features(crops, vision_feature_layer, strategy))

    def encode(
        self,
        modality: Modality,
        pixel_values: torch.Tensor,
        image_sizes: Any = None,
        batch_num_images: Any = None,
        vision_aspect_ratio: str | None = None,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
    ) -> EncodedImages:
        newline = self.inner.image_newline
        if modality.name == "video":
            videos, frames = pixel_values.shape[:2]
            probe = None
            if self.encoder_method.wants("tower_attention"):  # the feature layer's attention (HoliTom)
                layer = self._attention_layer(self._feature_layers(vision_feature_layer)[-1])
                probe = ColumnAttentionProbe(self.tower.encoder.layers[layer].self_attn)
            with probe or nullcontext():
                hidden = self._tower_features(pixel_values.flatten(0, 1), vision_feature_layer,
                                              vision_feature_select_strategy)  # fmt: skip
            pooled = hf.pool_video_frames(self.inner, self.inner.multi_modal_projector(hidden))
            side = math.ceil(self.grid[0] / 2)
            drop_first = hidden.shape[1] < self.grid[0] * self.grid[1]  # the "default" strategy
            signals = self.video_signals(hidden, probe, drop_first)
            owners = [v for v in range(videos) for _ in range(frames)]
            index = repeated(list(range(videos)), [frames] * videos, pooled.device)
            tokens = VisualTokens(pooled, (side, side), signals, index, image_of_crop=owners)
            selection, timer = self.select(tokens)
            per_frame = selection.counts_per_crop()
            kept = [sum(per_frame[v * frames : (v + 1) * frames]) for v in range(videos)]
            rows, offsets, order = flat_kept(selection, pooled), None, None
            if self.positions == "original":  # each kept token at its place in the video's run, the newline last
                rows, offsets, order = self._run_offsets(selection, rows, frames, pooled.shape[1], kept)
            per_video = with_row_after(rows, kept, newline).split([n + 1 for n in kept])
            records = self.encoder.crop_records(tokens, selection, timer, list(range(frames)) * videos, "video", owners)
            found = item_groups(selection, [frames] * videos)  # a later stage's groups (PruneVid), the newline none
            groups = sizes = None
            if found is not None:
                flat = torch.cat(found[0])
                flat = flat if order is None else flat[order]
                newline_group = torch.full((1,), -1, dtype=flat.dtype, device=flat.device)
                groups, sizes = list(with_row_after(flat[:, None], kept, newline_group)[:, 0].split(
                    [n + 1 for n in kept])), found[1]  # fmt: skip
            return EncodedImages(list(per_video), offsets, records, groups=groups, group_sizes=sizes)

        self.refuse_resized_grids("anyres images")
        if self.tower_plan(modality) is not None:  # the tower stage's flat layout
            return self.encode_flat(modality, pixel_values, vision_feature_layer, image_sizes=image_sizes,
                                    batch_num_images=batch_num_images,
                                    vision_feature_select_strategy=vision_feature_select_strategy)  # fmt: skip
        counts = self._crop_counts(image_sizes, batch_num_images)
        sizes = self.on_host("image_sizes", image_sizes)
        if pixel_values.dim() == 5:
            pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, counts, strict=True)])
        layers = self._feature_layers(vision_feature_layer)
        depth = len(self.tower.encoder.layers)
        wanted = tower_blocks(self.encoder_method, RECEIVED, self.family, depth,
                              self._attention_layer(layers[-1]) % depth)  # fmt: skip
        probes = {block: ColumnAttentionProbe(self.tower.encoder.layers[block].self_attn)
                  for block in set(wanted.values())}  # fmt: skip
        with ExitStack() as stack:
            for probe in probes.values():
                stack.enter_context(probe)
            embeds = self._projected(pixel_values, vision_feature_layer, vision_feature_select_strategy)
        # the model's own stitching, unpadding and downsampling, without newlines: base view, then the grid
        aspect = vision_aspect_ratio or self.model.config.vision_aspect_ratio
        packed = hf.pack_anyres_features(self.inner, list(embeds.split(counts)), sizes, aspect)
        side = self.grid[0]
        base = torch.stack([p[: side * side] for p in packed])
        device = base.device
        maps = {}  # block -> every image's scores packed like its tokens (one-channel maps), computed when read

        def packed_scores(block: int) -> list[torch.Tensor]:
            if block not in maps:
                scores = probes[block].scores[:, -embeds.shape[1] :, None]  # the tokens the projector got
                maps[block] = [p[:, 0] for p in hf.pack_anyres_features(self.inner, list(scores.split(counts)),
                                                                        sizes, aspect)]  # fmt: skip
            return maps[block]

        base_signals = {name: (lambda block=block: torch.stack([p[: side * side] for p in packed_scores(block)]))
                        for name, block in wanted.items()}  # fmt: skip
        base_tokens = VisualTokens(base, self.grid, base_signals, torch.arange(len(packed), device=device),
                                   image_of_crop=list(range(len(packed))))  # fmt: skip
        selection, timer = self.select(base_tokens)
        images = list(range(len(packed)))
        parts = [self.encoder.crop_records(base_tokens, selection, timer, [0] * len(packed), images=images)]
        # every image as crops for `pack`: the base view, then its stitched grid as one sub-image of its own size
        base_counts = selection.counts_per_crop()
        base_rows = flat_kept(selection, base).split(base_counts)
        base_places = output_places(selection)
        grids, places, rows, kept = [], [], [], []
        for i, (features, crops) in enumerate(zip(packed, counts, strict=True)):
            places.append(base_places[i, : base_counts[i]])
            rows.append(base_rows[i])
            kept.append(base_counts[i])
            if crops == 1:
                grids.append(AnyresGrid(0, 0, (side, side), 0, 0, 0, 0))
                continue
            height, width = self.stitched_grid(sizes[i], vision_aspect_ratio)
            stitched = features[side * side :][None]
            grid_signals = {name: (lambda block=block, i=i: packed_scores(block)[i][side * side :][None])
                            for name, block in wanted.items()}  # fmt: skip
            tokens = VisualTokens(stitched, (height, width), grid_signals, torch.full((1,), i, device=device),
                                  image_of_crop=[i])  # fmt: skip
            chosen, watch = self.select(tokens)
            parts.append(self.encoder.crop_records(tokens, chosen, watch, [1], images=[i]))
            grids.append(AnyresGrid(1, 1, (height, width), 0, height, 0, width))
            count = chosen.counts_per_crop()[0]
            places.append(output_places(chosen)[0, :count])
            rows.append(flat_kept(chosen, stitched))
            kept.append(count)
        out = pack(grids, stack_padded(places), kept, torch.cat(rows), newline, native=True)
        records = LazyRecords(lambda: sorted(LazyRecords.chain(parts), key=lambda r: (r.image, r.crop)))
        return EncodedImages(out.per_image(), None, records)
