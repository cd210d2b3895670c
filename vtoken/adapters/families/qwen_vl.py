"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution ViT, 2x2 patch merger, multimodal RoPE (M-RoPE).

Visual tokens are the patch-merger outputs: an image of grid (t=1, h, w) patches gives (h/2) x (w/2) tokens, a
video (t, h, w) gives t frames of (h/2) x (w/2). Budgets apply per image and per video frame. Kept tokens keep
their **original (t, h, w) M-RoPE positions**, computed by the model's own `get_rope_index` on the unpruned
prompt. The text position row that transformers uses for attention masks stays contiguous. `mm_token_type_ids`
shrinks with the prompt, and decoding continues after the largest position, as the stock model does.

There is no [CLS] token: methods that need [CLS] attention fail at `patch` time. Methods can read
`merge_features`: the last ViT block's output, mean-pooled over each 2 x 2 merge group, in the merged tokens'
raster order. Qwen2.5-VL's encoder runs in window order, so these are un-permuted the way the model un-permutes
its merger output.

Per temporal patch of a video, from the hooked queries and keys of a ViT block (SDPA/flash kept):
"vit_query_attention" (FastVID's Qwen form: the last block, softmax of the patch's mean query against each merge
group's mean key, head mean) and "tower_attention" (HoliTom, an extension: the last full-attention block's
attention each patch receives, mean over heads and queries, then over its merge group), per merged token.
A merging method's tokens keep the positions of the tokens they stand at (sorted, as the prompt keeps them).

Tower stage: PixelPrune decides before the tower which 2 x 2 merge groups of every image go through it (from the
pixels: one read of the kept mask), the prompt keeps those groups' placeholders at their original M-RoPE positions
(holes deleted; `image_grid_thw` unchanged), and the tower runs on their pixel rows only (`qwen_pruned_tower`). An
encoder method then sees every image's full token grid with the dropped groups invalid.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from vtoken.errors import InputError, VTokenError
from vtoken.geometry.kept import item_groups
from vtoken.geometry.qwen import item_tokens, resized_grid_thw, run_offsets, token_grid, window_index
from vtoken.geometry.tables import on_device
from vtoken.kernels import attention_column_mean
from vtoken.records import LazyRecords
from vtoken.tokens import Selection, VisualTokens

from .. import hf
from ..base import Adapter, EncodedImages, Modality, flat_kept, output_places
from ..probes import RECEIVED, VisionQueryKeyProbe, tower_blocks, tower_signals
from ..tower import TowerPlan, qwen_pruned_tower

GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}


class QwenVLAdapter(Adapter):
    family = "qwen2-vl"
    model_types = ("qwen2_vl",)
    model_classes = ("Qwen2VLForConditionalGeneration", "Qwen2VLModel")
    modalities = (
        Modality("image", "pixel_values", "image_token_id", ("image_grid_thw",), host=("image_grid_thw",)),
        Modality("video", "pixel_values_videos", "video_token_id", ("video_grid_thw",), host=("video_grid_thw",)),
    )
    positions = "original"
    token_columns = {"mm_token_type_ids": 0}
    tower_acts = ("input",)  # PixelPrune: the tower runs on the kept merge groups' rows

    @property
    def merge(self) -> int:
        return self.model.config.vision_config.spatial_merge_size

    multi_axis_positions = True  # M-RoPE (t, h, w): LLM-stage drops keep original positions

    def available_signals(self) -> set[str]:
        # "received_attention": the attention each merged token receives in the last full-attention block (HoloV's
        # score="received", SCOPE's saliency="received"; "tower_attention", HoliTom's, under another name), and
        # "received_attention@L" in any block L (HiPrune's two layers), over whole frames; "projected_merge": the
        # merger runs before selection, so a merge of LLM-input tokens (PruneVid) reaches the LLM as it is
        depth = len(self.inner.visual.blocks)
        return {"patch_features", "grid", "merge_features", "resized_grid", "vit_query_attention", "tower_attention",
                "projected_merge"} | tower_signals(self.encoder_method, RECEIVED, self.family, depth)  # fmt: skip

    def attention_probes(self) -> dict[str, VisionQueryKeyProbe]:
        """Probes on the ViT blocks whose attention the encoder method's signals read (signal -> its block's probe;
        signals reading one block share its probe)."""
        visual, method, probes, blocks = self.inner.visual, self.encoder_method, {}, {}

        def probe(block: int) -> VisionQueryKeyProbe:
            if block not in blocks:
                blocks[block] = VisionQueryKeyProbe(visual.blocks[block].attn)
            return blocks[block]

        last_full = hf.full_attention_blocks(visual)[-1]  # the last block attending over whole frames
        if method.wants("vit_query_attention"):
            probes["vit_query_attention"] = probe(len(visual.blocks) - 1)
        if method.wants("tower_attention"):
            probes["tower_attention"] = probe(last_full)
        for name, block in tower_blocks(method, RECEIVED, self.family, len(visual.blocks), last_full).items():
            probes[name] = probe(block)  # over whole frames, windows ignored (as the official flash runs)
        return probes

    def attention_signals(
        self, probes: dict[str, VisionQueryKeyProbe], thw: list[tuple[int, int, int]]
    ) -> list[dict[str, Any]]:
        """Per item of the call, its signals [t, merged tokens] (raster order) as callables (`thw`: `grid_thw` read
        on the host once). A block's received attention is computed once for every signal that reads it."""
        group = self.merge**2
        sizes = [t * h * w for t, h, w in thw]

        def per_item(probe: VisionQueryKeyProbe, query_mean: bool) -> list[torch.Tensor]:
            query, keys = probe.query_keys()  # [S, H, d], encoder order
            heads, dim = query.shape[1:]
            values = []
            for q, k, (frames, _, _) in zip(query.split(sizes), keys.split(sizes), thw, strict=True):
                q, k = q.reshape(frames, -1, heads, dim), k.reshape(frames, -1, heads, dim)
                if query_mean:  # the mean query against each merge group's mean key
                    mean_q, mean_k = q.float().mean(1), k.float().reshape(frames, -1, group, heads, dim).mean(2)
                    logits = (mean_k * mean_q[:, None]).sum(-1) * dim**-0.5  # [t, groups, H]
                    values.append(logits.softmax(dim=1).mean(-1).flatten())
                else:  # tower / received attention: what each patch receives, then its merge group's mean
                    received = attention_column_mean(q, k, dim**-0.5)
                    values.append(received.reshape(frames, -1, group).mean(-1).flatten())
            ordered = self.raster_order(torch.cat(values)[:, None], thw)[:, 0]
            return list(ordered.split([n // group for n in sizes]))

        cache: dict[tuple[int, bool], list[torch.Tensor]] = {}

        def signal(name: str, item: int, frames: int) -> torch.Tensor:
            key = (id(probes[name]), name == "vit_query_attention")
            if key not in cache:
                cache[key] = per_item(probes[name], key[1])
            return cache[key][item].view(frames, -1)

        return [{name: (lambda name=name, i=i, t=t: signal(name, i, t)) for name in probes}
                for i, (t, _, _) in enumerate(thw)]  # fmt: skip

    def raster_order(self, per_group: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Rows, one per merge group in the encoder's internal order, put in the merged tokens' raster order
        (`grids`: every item's (t, h, w) patches)."""
        return per_group  # Qwen2-VL's encoder keeps merge groups in raster order

    def _grids(self, modality: Modality, pixel_values: torch.Tensor, grid_thw: Any) -> list[tuple[int, int, int]]:
        """The (t, h, w) patches of every item, as host integers (read once per call with the prompt's layout)."""
        key = GRID_KEYS[modality.name]
        if grid_thw is None:
            raise InputError(f"{type(self.model).__name__} needs `{key}` next to `{modality.pixel_key}` "
                             "(its processor returns both)")  # fmt: skip
        grids = self.on_host(key, grid_thw)
        if pixel_values.dim() != 2 or any(len(g) != 3 for g in grids):
            shape = tuple(grid_thw.shape) if isinstance(grid_thw, torch.Tensor) else (len(grids), "?")
            raise InputError(
                f"{modality.pixel_key} of shape {tuple(pixel_values.shape)} with {key} of shape "
                f"{shape}; expected [total_patches, channels * patch volume] and [num_{modality.name}s, 3]"
            )
        vision = self.model.config.vision_config
        volume = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        if pixel_values.shape[1] != volume:
            raise InputError(
                f"{modality.pixel_key} of shape {tuple(pixel_values.shape)}; each row must hold one patch of "
                f"{volume} values (channels x temporal patch x patch x patch), as the processor makes them"
            )
        patches = sum(t * h * w for t, h, w in grids)
        if patches != pixel_values.shape[0]:
            raise InputError(
                f"{key} {grids} describes {patches} patches, but {modality.pixel_key} holds {pixel_values.shape[0]}"
            )
        return [tuple(g) for g in grids]

    def plan(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> list[int]:
        grids = self._grids(modality, pixel_values, encoder_kwargs.get(GRID_KEYS[modality.name]))
        return [item_tokens(g, self.merge) for g in grids]

    def plan_tower(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> TowerPlan | None:
        if modality.name != "image":
            return None
        grids = self._grids(modality, pixel_values, encoder_kwargs.get(GRID_KEYS[modality.name]))
        return self.tower_site.plan_groups(pixel_values, grids)

    def planned_offsets(
        self, modality: Modality, run_lengths: list[int], planned: list[int]
    ) -> list[int | torch.Tensor] | None:
        """After PixelPrune alone, the kept groups of every image (known before the tower, original positions);
        else known only after selecting."""
        plan = self.tower_plan(modality)
        if plan is None or not self.tower_alone:  # an encoder method chooses among them after the tower
            return None
        return plan.offsets(plan.device)

    def _rope_positions(self, kwargs: dict[str, Any], grids: dict[str, Any]) -> torch.Tensor:
        """[4, B, L] positions of the prompt in `kwargs` as the stock model builds them: text row + t/h/w rows."""
        if kwargs.get("mm_token_type_ids") is None:
            raise InputError(
                f"{type(self.model).__name__} needs `mm_token_type_ids` to place visual tokens in M-RoPE; pass "
                "everything its processor returns"
            )
        rope = hf.rope_index(
            self.inner,
            kwargs["input_ids"],
            mm_token_type_ids=kwargs["mm_token_type_ids"],
            attention_mask=kwargs.get("attention_mask"),
            **{k: v for k, v in grids.items() if v is not None},
        )
        text = _text_positions(kwargs.get("attention_mask"), kwargs["input_ids"])
        return torch.cat([text[None], rope.to(text.device)])

    @property
    def resizes_grids(self) -> bool:
        """The method hands back a smaller grid (Fourier-VLM): positions are those of the smaller grid."""
        return "resized_grid" in self.encoder_method.requires

    def before_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The stock [4, B, L] positions of the unpruned prompt, to be gathered for the kept tokens."""
        for modality in self.present(kwargs):
            self._grids(modality, kwargs[modality.pixel_key], kwargs.get(GRID_KEYS[modality.name]))
        extras = self._state.family  # per call (and thread): the grids a resizing method hands back
        extras["new_grids"] = {"image": [], "video": []}
        extras["seconds_per_grid"] = kwargs.get("second_per_grid_ts")
        if kwargs.get("position_ids") is not None or self.resizes_grids:
            if kwargs.get("mm_token_type_ids") is None:
                self._rope_positions(kwargs, {})  # raises the clear error
            return kwargs
        grids = {key: kwargs.get(key) for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        return dict(kwargs, position_ids=self._rope_positions(kwargs, grids))

    def after_shrinking(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Renumber the text row (masks need it contiguous); store the decoding offset the stock model uses.
        For resized grids, the positions are the stock ones of the shrunk prompt with the smaller grids."""
        mask = kwargs.get("attention_mask")
        if self.resizes_grids:
            extras = self._state.family
            device = kwargs["input_ids"].device
            grids = {
                f"{name}_grid_thw": on_device([n for thw in sizes for n in thw], device).view(-1, 3) if sizes else None
                for name, sizes in extras["new_grids"].items()
            }
            grids["second_per_grid_ts"] = extras["seconds_per_grid"]
            positions = self._rope_positions(kwargs, grids)
        else:
            positions = kwargs["position_ids"]
            text = _text_positions(mask, kwargs["input_ids"])
            positions = torch.cat([text[None].to(positions), positions[1:]]) if positions.shape[0] == 4 else positions
        valid = mask.bool() if mask is not None else torch.ones_like(kwargs["input_ids"], dtype=torch.bool)
        largest = positions[-3:].masked_fill(~valid[None], -1).amax(dim=(0, 2))
        hf.set_rope_deltas(self.inner, (largest + 1 - valid.sum(1))[:, None])
        return dict(kwargs, position_ids=positions)

    def position_offset(self, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """[B] the rope delta decoding continues with after the prompt in `kwargs`: its largest t/h/w position + 1
        minus its real tokens (the stock model's `rope_deltas`; computed here when the stock encoder runs)."""
        positions, mask, ids = kwargs.get("position_ids"), kwargs.get("attention_mask"), kwargs["input_ids"]
        if positions is None or positions.dim() != 3:
            grids = {key: kwargs.get(key) for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
            if kwargs.get("mm_token_type_ids") is None or (grids["image_grid_thw"] is None
                                                          and grids["video_grid_thw"] is None):  # fmt: skip
                return torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)  # text only: no delta
            positions = self._rope_positions(kwargs, grids)
        valid = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        largest = positions[-3:].masked_fill(~valid.to(positions.device)[None], -1).amax(dim=(0, 2))
        return largest + 1 - valid.sum(1).to(largest.device)

    def continued_positions(
        self, mask: torch.Tensor, past: int, tail_positions: torch.Tensor | None, offset: torch.Tensor | None
    ) -> torch.Tensor:
        """[4, B, past + n]: the text row over the real tokens of `mask`; t/h/w rows continue where decoding would
        (text position + rope delta), the new tokens' own visual positions (`tail_positions`, counted from their
        first real token) moved there. The cached columns' t/h/w rows are the text row + delta (never read)."""
        text = (mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(mask == 0, 0)
        if offset is None:  # a cache no patched call filled: the stock model's own delta, as it would use
            deltas = hf.rope_deltas(self.inner)
            offset = torch.zeros(mask.shape[0], dtype=torch.long) if deltas is None else deltas.view(-1)
            offset = offset.repeat_interleave(mask.shape[0] // offset.shape[0])
        offset = offset.to(text.device)
        rope = (text + offset[:, None])[None].repeat(3, 1, 1)
        if tail_positions is not None:
            start = mask[:, :past].long().sum(1) + offset  # the position of each row's first new real token
            rope[:, :, past:] = tail_positions[-3:].to(rope) + start[None, :, None]
        return torch.cat([text[None], rope])

    def encode(self, modality: Modality, pixel_values: torch.Tensor, **encoder_kwargs: Any) -> EncodedImages:
        given = encoder_kwargs.get(GRID_KEYS[modality.name])
        grids = self._grids(modality, pixel_values, given)
        grid_thw = torch.as_tensor(given)
        visual = self.inner.visual
        plan = self.tower_plan(modality)
        probes = self.attention_probes() if plan is None else {}  # (refused at patch after a tower method)
        with ExitStack() as stack:
            for probe in {id(p): p for p in probes.values()}.values():  # each block's probe once
                stack.enter_context(probe)
            if plan is None:
                out = visual(pixel_values.type(visual.dtype), grid_thw=grid_thw.to(pixel_values.device))
            else:  # the tower on the kept groups only; their outputs put back on every image's grid
                out = qwen_pruned_tower(visual, pixel_values, grids, plan.selected)
        attention = self.attention_signals(probes, grids) if probes else None
        merged = out.pooler_output if plan is None else plan.groups_on_grid(out.pooler_output)
        device = merged.device
        sizes = [item_tokens(g, self.merge) for g in grids]
        left = None if plan is None else plan.selected.keep.to(device).split(sizes)  # the tower's kept groups
        wants_groups = plan is None and bool({"merge_features", "vision_features"} & set(self.encoder_method.requires))
        if wants_groups:  # last block output pooled per merge group, in raster order
            groups = out.last_hidden_state.view(merged.shape[0], self.merge**2, -1).mean(dim=1)
            groups = self.raster_order(groups, grids).split(sizes)
        companions = self.companion_features(out)
        companions = [(c if plan is None else plan.groups_on_grid(c)).split(sizes) for c in companions]
        features, offsets, parts, followers, checks, kinds, kind_sizes = [], [], [], [], [], [], []
        for index, (tokens, thw) in enumerate(zip(merged.split(sizes), grids, strict=True)):
            frames, grid = thw[0], token_grid(thw, self.merge)
            per_frame = tokens.view(frames, grid[0] * grid[1], -1)
            signals = dict(attention[index]) if attention is not None else {}
            if wants_groups:  # also the vision features for token-to-token similarity (MMTok)
                pooled = groups[index].view(frames, grid[0] * grid[1], -1)
                signals.update({"merge_features": pooled, "vision_features": pooled})
            valid = None if left is None else left[index].view(frames, -1)  # the tower's dropped groups: invalid
            crops = VisualTokens(per_frame, grid, signals, torch.full((frames,), index, device=device), valid,
                                 valid_counts=None if left is None else [plan.counts[index]],
                                 image_of_crop=[index] * frames)  # fmt: skip
            selection, timer = self.select(crops)
            self._state.family["new_grids"][modality.name].append(
                resized_grid_thw(frames, selection.grid or grid, self.merge)
            )
            kept = flat_kept(selection, per_frame)
            places = run_offsets(output_places(selection), selection.counts, per_frame.shape[1])
            followed = [follow_selection(self.encoder_method, selection, crops, c[index]) for c in companions]
            follow = [rows for rows, _ in followed]
            checks += [agrees for _, agrees in followed]
            found = item_groups(selection, [frames])  # a later stage's groups (PruneVid's windows and frames)
            grouped = None if found is None else found[0][0]
            if selection.at_anchors:  # rows at their anchors, not always ascending (HoliTom): the prompt's order
                order = places.argsort(stable=True)
                kept, places, follow = kept[order], places[order], [c[order] for c in follow]
                grouped = None if grouped is None else grouped[order]
            if found is not None:
                kinds.append(grouped)
                kind_sizes.append(found[1][0])
            features.append(kept)
            offsets.append(places)
            parts.append(self.encoder.crop_records(crops, selection, timer, list(range(frames)), modality.name,
                                           [index] * frames))  # fmt: skip
            followers.append(follow)
        check_followed(self.encoder_method, checks)  # a merge's anchors on DeepStack levels: one read, if any
        return EncodedImages(features, offsets, LazyRecords.chain(parts), companions=followers if companions else None,
                             groups=kinds or None, group_sizes=kind_sizes or None)  # fmt: skip

    def companion_features(self, out: Any) -> list[torch.Tensor]:
        """Further [N, D'] tensors of the encoder's output, one row per merged token, that must follow the
        selection of the merged tokens (Qwen3-VL's DeepStack levels). None here."""
        return []


class Qwen25VLAdapter(QwenVLAdapter):
    """Qwen2.5-VL: as Qwen2-VL; its encoder internals are window-ordered and are put back in raster order."""

    family = "qwen2.5-vl"
    model_types = ("qwen2_5_vl",)
    model_classes = ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel")

    def raster_order(self, per_group: torch.Tensor, grids: Any) -> torch.Tensor:
        """Undo the encoder's window permutation, as the model does for its merger output."""
        visual = self.inner.visual
        grids = grids.tolist() if isinstance(grids, torch.Tensor) else grids
        order = window_index(grids, visual.spatial_merge_size, visual.window_size, visual.patch_size,
                             per_group.device)  # fmt: skip
        return per_group[torch.argsort(order)]


def same_selection(method, selection: Selection, tokens: VisualTokens, companion: torch.Tensor) -> torch.Tensor:
    """[k, D'] the rows of `companion` [C * N, D'] (aligned with `tokens`) that `selection` made of the tokens.

    Kept indices are gathered; a merge (pool, fourier) is the method's own merge run on the companion grid, which
    is the same merge when it does not depend on the features (both are fixed linear maps of the grid); a merge
    that comes out different (anchors or grid) is refused rather than mixed."""
    rows, agrees = follow_selection(method, selection, tokens, companion)
    check_followed(method, [agrees])
    return rows


def follow_selection(
    method, selection: Selection, tokens: VisualTokens, companion: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`same_selection` without reading the device: the rows, and for a merge with anchors a 0-d bool tensor
    saying whether the companion's merge stood at the same anchors (None: nothing left to check); a merge that
    comes out different on the host (grid, counts) is refused here. `check_followed` reads the flags once."""
    per_crop = companion.view(tokens.num_crops, tokens.num_tokens, -1)
    if selection.kept is not None:
        return flat_kept(selection, per_crop), None
    if selection.mix is not None:  # a merge that says how to repeat itself (FastVID, HoliTom)
        mixed = Selection(features=selection.mix(per_crop), counts=selection.counts_per_crop())
        return flat_kept(mixed, per_crop), None
    again = method.select(
        VisualTokens(
            per_crop,
            tokens.grid,
            {},
            tokens.image_index,
            tokens.valid,
            valid_counts=tokens.valid_counts,
            image_of_crop=tokens.image_of_crop,
        )
    )
    same = again.grid == selection.grid and again.counts == selection.counts
    agrees = None
    if selection.anchors is not None:
        same = same and again.anchors is not None and again.anchors.shape == selection.anchors.shape
        agrees = (again.anchors == selection.anchors).all() if same else None
    if again.features is None or not same:
        _refuse_merge(method)
    return flat_kept(again, per_crop), agrees


def check_followed(method, flags: list[torch.Tensor | None]) -> None:
    """Refuse a merge whose anchors differed on a companion (`follow_selection`'s flags: one read for them all)."""
    flags = [f for f in flags if f is not None]
    if flags and not bool(torch.stack(flags).all()):
        _refuse_merge(method)


def _refuse_merge(method) -> None:
    raise VTokenError(
        f"{method.name} merges tokens depending on their features, so the same merge cannot be applied to the "
        "DeepStack features; use a selecting method (random, mmtok) or a fixed merge (pool, fourier)"
    )


def _text_positions(mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D positions over the real tokens of every row (what generate uses for masks)."""
    if mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
