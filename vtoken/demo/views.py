"""Pictures of what a configuration kept, drawn on what the model saw: every crop of an anyres image, a grid of
frames for a video, merged groups tinted, and the tokens that survived the LLM's drop layers.

Records index tokens per crop (encoder stages) or per batch row over the row's visual tokens in the order the LLM
receives them (LLM stages). To draw the latter, `llm_order` rebuilds that order as lists of grid cells, one list
per visual token (empty for a newline or a pass-through [CLS]); its length is checked against the records, so a
picture is never drawn from a mapping that does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from .. import api
from ..methods.random import Random
from ..overlay import model_view, mosaic, token_picture
from ..records import Record, llm_point, llm_point_label

TILE = 224  # pixels per crop tile on its longer side


@dataclass
class Crop:
    """One crop (or frame) of the first image or video: its grid, which cells reached the LLM after the encoder,
    the merged groups, and its visual tokens in emission order (lists of cells)."""

    index: int
    grid: tuple[int, int]
    modality: str
    keep: np.ndarray  # [rows * cols] bool: cells whose content reaches the LLM
    tokens: list[list[int]]
    groups: list[np.ndarray] = field(default_factory=list)


def probe_records(model, inputs, layout: str = "native") -> tuple[list[Record], object]:
    """Encoder records of the unpruned input (every valid token of every crop kept), and the adapter: the crop
    structure the LLM-only methods and the unpatched column are drawn on. Runs the encoder only."""
    with api.patched(model, Random(budget=1.0), layout=layout) as handle:
        handle.adapter.calls.prepare(dict(inputs))
        return list(handle.adapter.records), handle.adapter


def _crops(records: list[Record], method, merges: list) -> list[Crop]:
    """The first item's crops from encoder records (selection, merging, or MustDrop's tower merge), after the tower
    stage's where a tower method acted (alone: its records)."""
    towers = {r.crop: r for r in records if r.image == 0 and r.stage == "tower"}
    first = [r for r in records if r.image == 0 and r.stage in ("encoder", "encoder.merge")] or list(towers.values())
    crops = []
    for r in first:
        tower = towers.get(r.crop)
        if tower is not None and tower.kept is None:  # merged inside the tower (ToMe): patches per output token
            crops.append(_merged_in_tower(r, tower))
            continue
        rows, cols = r.grid
        n = rows * cols
        keep = np.zeros(n, dtype=bool)
        if r.stage == "encoder.merge":  # MustDrop: merged windows first (by score), then the unmerged tokens
            plan = merges[0] if merges else None
            if plan is None:
                crops.append(Crop(r.crop, r.grid, r.modality, np.ones(n, bool), [[i] for i in range(n)]))
                continue
            windows = plan.window_tokens.cpu().numpy()
            merged = [windows[w] for w in plan.merged[_plan_row(first, r)].tolist()]
            unmerged = plan.unmerged[_plan_row(first, r)].tolist()
            keep[:] = True
            crops.append(Crop(r.crop, r.grid, r.modality, keep, [m.tolist() for m in merged] + [[u] for u in unmerged],
                              merged))  # fmt: skip
        elif r.kept is not None:
            kept = r.kept.cpu().tolist()
            keep[kept] = True
            crops.append(Crop(r.crop, r.grid, r.modality, keep, [[k] for k in kept]))
        else:  # a merging method: pool cells or a low-pass grid, in raster order
            keep[:] = True
            groups = _merge_groups(method, rows, cols, r.tokens_out)
            crops.append(Crop(r.crop, r.grid, r.modality, keep, [g.tolist() for g in groups], groups))
    return crops


def _merged_in_tower(record: Record, tower: Record) -> Crop:
    """A crop whose tokens were merged inside the tower (its record says every patch's output token, `sources`):
    each token the LLM got (those `record` kept, or all of them) drawn as the patches it stands for."""
    sources = tower.extra["sources"].cpu().numpy()
    kept = range(tower.tokens_out) if record is tower or record.kept is None else record.kept.cpu().tolist()
    tokens = [np.flatnonzero(sources == k) for k in kept]
    keep = np.zeros(len(sources), dtype=bool)
    for cells in tokens:
        keep[cells] = True
    groups = [cells for cells in tokens if len(cells) > 1]
    return Crop(tower.crop, tower.grid, tower.modality, keep, [cells.tolist() for cells in tokens], groups)


def _plan_row(first: list[Record], record: Record) -> int:
    return first.index(record)  # one plan row per crop of the batch, item 0's crops first


def _merge_groups(method, rows: int, cols: int, k: int) -> list[np.ndarray]:
    """Cells merged into each output token, as the method says (`merged_cells`: pool's cells, Fourier-VLM's
    blocks); else the grid cut into about k square blocks."""
    said = method.merged_cells(rows, cols, k) if hasattr(method, "merged_cells") else None
    if said is not None:
        return [np.asarray(group, dtype=np.int64) for group in said]
    cells = np.arange(rows * cols).reshape(rows, cols)
    h = w = max(1, math.isqrt(k))
    ys, xs = (np.arange(rows) * h) // rows, (np.arange(cols) * w) // cols
    block = ys[:, None] * w + xs[None, :]
    return [cells[block == b] for b in range(h * w)]


def llm_order(crops: list[Crop], adapter, inputs) -> list[list[int | tuple]]:
    """The first item's visual tokens in the order the LLM receives them: each a list of (crop, cell) pairs,
    empty for a newline or a pass-through [CLS] token."""
    family, layout = adapter.family, adapter.layout
    tokens = lambda c: [[(c.index, cell) for cell in t] for t in c.tokens]  # noqa: E731
    if crops and crops[0].modality == "video":
        order = []
        for c in crops:
            order += ([[]] if family == "video-llava" else []) + tokens(c)  # Video-LLaVA: each frame's [CLS] first
        return order + ([[]] if family == "llava-onevision" else [])  # OneVision: one newline after the video
    if family in ("llava-next", "llava-next-video", "llava-onevision") and "tower_merge" not in _requires(adapter):
        base, subs = crops[0], crops[1:]
        native = layout == "native"
        if not subs:
            return tokens(base) + ([[]] if native else [])
        if family == "llava-onevision":  # crop 1 is the stitched grid already
            stitched = [(i // subs[0].grid[1], t) for i, t in zip(_cells_of(subs[0]), tokens(subs[0]), strict=True)]
        else:
            grid = adapter.crop_layout(inputs["image_sizes"][0])
            height, width = base.grid
            stitched = []
            for c in subs:
                r, col = divmod(c.index - 1, grid.cols)
                for cell, t in zip(_cells_of(c), tokens(c), strict=True):
                    y, x = divmod(cell, width)
                    stitched.append(((r * height + y) * (grid.cols * width) + col * width + x, t))
            stitched.sort(key=lambda item: item[0])
            stitched = [(key // (grid.cols * width), t) for key, t in stitched]
        order = tokens(base)
        for i, (row, t) in enumerate(stitched):
            order.append(t)
            if native and (i + 1 == len(stitched) or stitched[i + 1][0] != row):
                order.append([])  # a newline after every row that still has tokens
        return order
    return [t for c in crops for t in tokens(c)]


def _cells_of(crop: Crop) -> list[int]:
    return [t[0] for t in crop.tokens]  # selection methods: one cell per token


def _requires(adapter) -> tuple:
    method = adapter.encoder_method
    return tuple(method.requires) if method is not None else ()


def survivors(order: list[list], records: list[Record]) -> set | None:
    """(crop, cell) pairs of the tokens that survived every LLM drop of row 0; None if the records do not fit
    `order` (then nothing is drawn rather than something wrong)."""
    alive = list(range(len(order)))
    drops = sorted((r for r in records if llm_point(r.stage) is not None and r.image == 0 and r.kept is not None),
                   key=lambda r: llm_point(r.stage))  # fmt: skip
    if drops:  # every drop's `kept` indexes the visual tokens the LLM received (tokens merged on the way: none)
        if drops[0].tokens_in != len(alive):
            return None
        alive = drops[-1].kept.cpu().tolist()
    return {pair for i in alive for pair in order[i]}


def crop_images(inputs, image: Image.Image | None, frames: list | None, crops: list[Crop], processor) -> list:
    """The picture each crop is drawn on: the crop's own pixels as the model saw them where the input has one per
    crop, else the uploaded image (or the frame) stretched to the crop's grid."""
    pixels = next((inputs[k] for k in ("pixel_values", "pixel_values_images") if k in inputs), None)
    ip = getattr(processor, "image_processor", None)
    out = []
    for c in crops:
        rows, cols = c.grid
        size = (TILE, max(1, round(TILE * rows / cols))) if cols >= rows else (max(1, round(TILE * cols / rows)), TILE)
        if c.modality == "video" and frames:
            source = frames[min(len(frames) - 1, c.index * len(frames) // max(len(crops), 1))]
        elif (pixels is not None and ip is not None and pixels.dim() in (4, 5) and rows == cols
              and (pixels.dim() == 4 or c.index < pixels.shape[1])):  # fmt: skip
            crop_pixels = pixels[0] if pixels.dim() == 4 else pixels[0, c.index]
            source = model_view(crop_pixels, ip.image_mean, ip.image_std)
        else:
            source = image if image is not None else Image.new("RGB", size, (128, 128, 128))
        out.append(source.convert("RGB").resize(size, Image.BILINEAR))
    return out


def picture(outcome, model, processor, inputs, image=None, frames=None, probe=None) -> tuple[Image.Image, str]:
    """(picture, caption) of what `outcome` kept of the first image or video. `probe`: `probe_records(...)`, for
    configurations without an encoder stage and for the unpatched model."""
    adapter = outcome.adapter
    encoder_method = adapter.encoder_method if adapter is not None else None
    placed = encoder_method is not None and encoder_method.acts_on == "placed"
    if encoder_method is not None and not placed:
        crops = _crops(outcome.records, encoder_method, outcome.merges)
        if not crops:
            return Image.new("RGB", (TILE, TILE), "white"), "no visual tokens recorded"
    else:  # no encoder stage, or one that selects among the packed tokens (DivPrune): drawn on the whole crops
        if probe is None or placed:
            probe = probe_records(model, inputs, adapter.layout if adapter is not None else "native")
        records, probe_adapter = probe
        crops = _crops(records, None, [])
        adapter = adapter or probe_adapter
    notes = []
    keep = {c.index: c.keep.copy() for c in crops}
    order = llm_order(crops, outcome.adapter if outcome.adapter is not None else adapter, inputs)
    if placed:  # its kept indices are positions in the item's packed sequence: `order` maps them onto the crops
        record = next((r for r in outcome.records if r.stage == "encoder" and r.image == 0), None)
        if record is None or record.tokens_in != len(order):
            notes.append(f"{encoder_method.name}'s picks cannot be mapped onto this layout; all tokens shown")
        else:
            order = [order[k] for k in record.kept.cpu().tolist()]
            chosen = {pair for token in order for pair in token}
            for c in crops:
                cells = np.zeros(c.grid[0] * c.grid[1], dtype=bool)
                cells[[cell for crop, cell in chosen if crop == c.index]] = True
                keep[c.index] &= cells
    if any(r.stage.startswith("prefill.") for r in outcome.records):
        alive = survivors(order, outcome.records)
        if alive is None:
            notes.append("the LLM-stage drops cannot be mapped onto this layout; encoder stage shown")
        else:
            for c in crops:
                cells = np.zeros(c.grid[0] * c.grid[1], dtype=bool)
                cells[[cell for crop, cell in alive if crop == c.index]] = True
                keep[c.index] &= cells
            points = sorted({r.stage for r in outcome.records if llm_point(r.stage) is not None}, key=llm_point)
            notes.append(f"tokens surviving the LLM's drops ({', '.join(llm_point_label(p) for p in points)})")
    tiles = [
        token_picture(view, c.grid, keep[c.index], c.groups)
        for c, view in zip(crops, crop_images(inputs, image, frames, crops, processor), strict=True)
    ]
    if any(c.groups for c in crops):
        notes.append("merged groups tinted")
    if crops[0].modality == "video":  # a near-square grid of frames: a one-row strip is unreadably thin
        per_row = math.ceil(math.sqrt(len(tiles)))
        layout = [tiles[i : i + per_row] for i in range(0, len(tiles), per_row)]
        notes.insert(0, f"{len(tiles)} frames")
    elif len(tiles) > 1 and adapter is not None and adapter.family in ("llava-next", "llava-next-video"):
        grid = adapter.crop_layout(inputs["image_sizes"][0])
        subs = tiles[1:]
        layout = [[tiles[0]]] + [subs[r * grid.cols : (r + 1) * grid.cols] for r in range(grid.rows)]
        layout = [[tiles[0], mosaic(layout[1:], gap=2)]]
        notes.insert(0, f"base view + {grid.rows}x{grid.cols} crops")
    else:
        layout = [tiles]
        if len(tiles) > 1:
            notes.insert(0, f"{len(tiles)} crops")
    return mosaic(layout), "; ".join(notes)


def kept_counts(outcome) -> dict[str, int]:
    """Visual tokens per stage for item 0 (for captions)."""
    out = {}
    for r in outcome.records:
        if r.image == 0:
            out[r.stage] = out.get(r.stage, 0) + r.tokens_out
    return out


__all__ = ["picture", "probe_records", "llm_order", "survivors", "Crop", "torch"]
