"""Anyres geometry: LLaVA-NeXT (and LLaVA-NeXT-Video's images) and LLaVA-OneVision.

An image is a base view plus `rows` x `cols` sub-image crops, each an H x W token grid. The sub-images stitched
together form a (rows*H) x (cols*W) grid, of which a window survives unpadding (the padding that fitted the image's
aspect ratio into the crop grid). The model's own ("native") packing, which the checkpoints were trained on: the
base view's tokens, then the window's tokens in raster order with a newline token after every row. OneVision then
downsamples the window when it is larger than `anyres_max_N` allows.

Host side (sizes in, integers out): `crop_grid`, `unpad_window`, `anyres_grid` -> `AnyresGrid` (valid tokens per
crop, native placeholder count), `onevision_grid`. Device side (tensors and those integers in): `crop_valid` (which
tokens of every crop survive unpadding) and `pack` (kept tokens of every crop of every image put in the order the
LLM receives them, native or official, with newlines), a fixed handful of kernels whatever the number of crops or
images; the native packing's length depends on which rows keep tokens and is read back once per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tables import on_device, padded_rows

# `Selection.origin` values of output rows with no place on the grid (vtoken.tokens.CLS / MERGED)
_CLS, _MERGED = -1, -2


def best_resolution(image_size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """The (height, width) among `pinpoints` an image of `image_size` (height, width) is resized and padded to:
    transformers' `select_best_resolution`, which LLaVA-NeXT's processor, model and vLLM all use."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(select_best_resolution(tuple(image_size), [tuple(p) for p in pinpoints]))


def crop_grid(image_size: tuple[int, int], pinpoints: list, crop_pixels: int) -> tuple[int, int]:
    """(rows, cols) of sub-image crops of an image of `image_size` (height, width), crops of `crop_pixels` square."""
    height, width = best_resolution(image_size, pinpoints)
    return height // crop_pixels, width // crop_pixels


def unpad_window(image_size: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a stitched grid of `shape` (height, width) that keeps the aspect ratio of an
    image of `image_size` (height, width): the rows or columns the model's `unpad_image` keeps (same arithmetic)."""
    original_height, original_width = image_size
    height, width = shape
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        padding = (height - new_height) // 2
        return padding, height - padding, 0, width
    new_width = int(round(original_width * (height / original_height), 7))
    padding = (width - new_width) // 2
    return 0, height, padding, width - padding


@dataclass(frozen=True)
class AnyresGrid:
    """One image's crops: a base view, then `rows` x `cols` sub-images of `side` = (H, W) tokens each; of their
    stitched (rows*H) x (cols*W) grid, the window [top, bottom) x [left, right) survives unpadding."""

    rows: int
    cols: int
    side: tuple[int, int]
    top: int
    bottom: int
    left: int
    right: int

    @property
    def num_crops(self) -> int:
        return 1 + self.rows * self.cols

    @property
    def stitched_shape(self) -> tuple[int, int]:
        return self.rows * self.side[0], self.cols * self.side[1]

    @property
    def unpadded_shape(self) -> tuple[int, int]:
        """(rows, columns) of tokens that survive unpadding."""
        return self.bottom - self.top, self.right - self.left

    @property
    def unpadded(self) -> torch.Tensor:
        """[h', w'] raster indices, in the stitched grid, of the tokens that survive unpadding (a host tensor)."""
        height, width = self.stitched_shape
        return torch.arange(height * width).view(height, width)[self.top : self.bottom, self.left : self.right]

    def valid_counts(self) -> list[int]:
        """Tokens of every crop that survive unpadding (the base view first: all of its own)."""
        height, width = self.side
        counts = [height * width]
        for r in range(self.rows):
            ys = max(0, min(self.bottom, (r + 1) * height) - max(self.top, r * height))
            for c in range(self.cols):
                xs = max(0, min(self.right, (c + 1) * width) - max(self.left, c * width))
                counts.append(ys * xs)
        return counts

    def native_length(self) -> int:
        """Placeholders the model's native packing gives the image: the base view, then the unpadded window with a
        newline after each of its rows (a base-only image: the base view and one newline)."""
        base = self.side[0] * self.side[1]
        if self.num_crops == 1:
            return base + 1
        rows, cols = self.unpadded_shape
        return base + rows * cols + rows


def anyres_grid(image_size: tuple[int, int], pinpoints: list, crop_pixels: int, side: tuple[int, int]) -> AnyresGrid:
    """The `AnyresGrid` of an image of `image_size` (height, width) for a model with these grid pinpoints, crops of
    `crop_pixels` square and `side` = (H, W) tokens per crop."""
    rows, cols = crop_grid(image_size, pinpoints, crop_pixels)
    top, bottom, left, right = unpad_window(image_size, (rows * side[0], cols * side[1]))
    return AnyresGrid(rows, cols, tuple(side), top, bottom, left, right)


def onevision_grid(image_size: tuple[int, int], pinpoints: list, crop_pixels: int, side: int,
                   max_crops: int) -> tuple[int, int]:  # fmt: skip
    """(rows, cols) of tokens of LLaVA-OneVision's stitched grid of an anyres image: unpadded, then bilinearly
    downsampled when it holds more than `max_crops` (`anyres_max_N`) crops' worth of tokens."""
    grid = anyres_grid(image_size, pinpoints, crop_pixels, (side, side))
    height, width = grid.unpadded_shape
    ratio = math.sqrt(height * width / (max_crops * side**2))
    return (int(height // ratio), int(width // ratio)) if ratio > 1.1 else (height, width)


def onevision_max_crops(vision_aspect_ratio: str) -> int:
    """N of `anyres_max_N`."""
    return int(vision_aspect_ratio.removeprefix("anyres_max_"))


# ----------------------------------------------------------------- device side
def crop_valid(grids: list[AnyresGrid], device: torch.device | str) -> torch.Tensor:
    """[C, H*W] bool over the crops of every image (base view first): the tokens that survive unpadding."""
    height, width = grids[0].side
    bounds = []  # per crop, the window in its own rows and columns: first row, end row, first column, end column
    for grid in grids:
        bounds += [0, height, 0, width]
        for s in range(grid.rows * grid.cols):
            r, c = divmod(s, grid.cols)
            rows = [min(max(edge - r * height, 0), height) for edge in (grid.top, grid.bottom)]
            cols = [min(max(edge - c * width, 0), width) for edge in (grid.left, grid.right)]
            bounds += rows + cols
    table = on_device(bounds, device).view(-1, 2, 2, 1)  # [C, rows / columns, first / end, 1]
    local = torch.arange(max(height, width), device=device)
    inside = (local >= table[:, :, 0]) & (local < table[:, :, 1])  # [C, 2, max(H, W)]
    return (inside[:, 0, :height, None] & inside[:, 1, None, :width]).flatten(1)


def sequence_index(grids: list[AnyresGrid], device: torch.device | str) -> torch.Tensor:
    """[C, H*W] where every token of every crop (base view first) sits in its image's sequence before unpadding:
    a base-view token at its raster index, a sub-image token at H*W + its raster index in the stitched grid."""
    height, width = grids[0].side
    table = []  # per crop: is it a sub-image, its grid row, its grid column, its image's grid columns
    for grid in grids:
        table += [0, 0, 0, grid.cols]
        for s in range(grid.rows * grid.cols):
            table += [1, *divmod(s, grid.cols), grid.cols]
    sub, row, col, cols = on_device(table, device).view(-1, 4, 1).unbind(1)  # each [C, 1]
    local = torch.arange(height * width, device=device)
    stitched = (row * height + local // width) * (cols * width) + col * width + local % width
    return torch.where(sub.bool(), height * width + stitched, local)


@dataclass
class Packed:
    """The kept tokens of a call's images in the order the LLM receives them: `features` [T, D] (images one after
    another), `lengths` per image (host), and per crop the tokens that reached the LLM (`reached`, host; differs
    from the kept count only where a layout drops picks, HiRED's official one)."""

    features: torch.Tensor
    lengths: list[int]
    reached: list[int]

    def per_image(self) -> list[torch.Tensor]:
        return list(self.features.split(self.lengths))


def pack(
    grids: list[AnyresGrid],
    places: torch.Tensor,
    counts: list[int],
    embeds: torch.Tensor,
    newline: torch.Tensor,
    native: bool,
    origin: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    base_newline: bool = False,
    whole: bool = False,
) -> Packed:
    """Pack the kept tokens of every crop of every image (crops image after image, base view first).

    places: [C, k] the grid index each crop's output rows stand at (kept indices, or a merge's anchors), rows
        padded past `counts[c]`; embeds: [sum(counts), D] the output rows' embeddings, crop after crop, each crop's
        rows in its order; newline: [D].
    native: the model's packing (unpadded window, a newline after every stitched row that keeps a token; a
        base-only image gets one newline); else the official packing of the seed methods' LLaVA-NeXT code (no
        newlines; a base-only image ends with one only if `base_newline`, VisionZip's).
    origin: [C, k] for merging methods whose rows say where they come from (VisionZip: a grid index, or CLS or
        MERGED; used instead of `places`): the sub-images' grid rows are placed on the grid, then every sub-image's
        [CLS] row, then every sub-image's merged rows, crop after crop.
    drop: [C, k] bool, rows a layout drops after selecting (HiRED's official packing unpads then).
    whole: every crop keeps all its valid tokens (a method that selects later, among the packed tokens): the
        native newlines are then the window's rows, known without a read.
    Each image: the base view's rows as they are, then the sub-images' grid rows in raster order of the stitched
    grid (with newlines, native), then the rows without a place on it. A fixed handful of kernels; the newlines
    (which rows keep tokens) and the dropped rows depend on the data and are read back in one read, everything else
    is known on the host from `counts`.
    """
    device, width = embeds.device, max(places.shape[1], 1)
    crops = sum(g.num_crops for g in grids)
    image_of = [i for i, g in enumerate(grids) for _ in range(g.num_crops)]
    # Every output row gets a sort key: image * big, then base rows by slot, grid rows by their stitched raster
    # index (after `width`), [CLS] rows, then merged rows. Per crop (host): the key of its first grid token, what a
    # row of its tokens adds beyond its own width, its grid's width, sub-image index + 1 (0: the base view), where
    # its image's [CLS] and merged keys start, the stitched row id of its first row (for newlines).
    big = 1 + max(width + g.stitched_shape[0] * g.stitched_shape[1] + g.rows * g.cols * (width + 1) for g in grids)
    rows_cap = max(g.stitched_shape[0] for g in grids) + 1
    values = []
    for i, grid in enumerate(grids):
        height, side_w = grid.side
        subs, row_length = grid.rows * grid.cols, grid.cols * side_w
        cls_key = i * big + width + grid.stitched_shape[0] * row_length
        values += [i * big, 0, 1, 0, cls_key, cls_key + subs, 0]
        for s in range(subs):
            r, c = divmod(s, grid.cols)
            first = i * big + width + r * height * row_length + c * side_w
            values += [first, row_length - side_w, side_w, s + 1, cls_key, cls_key + subs, i * rows_cap + r * height]
    table = on_device(values, device).view(crops, 7)
    flat = padded_rows(counts, width, device)  # [M] the real (crop, slot) entries of [C, k]
    crop, slot = flat // width, flat % width
    first, row_extra, side_w, sub, cls_key, merged_key, row_base = table[crop].unbind(1)
    is_sub = sub > 0
    place = (origin if origin is not None else places).flatten()[flat]
    on_grid = is_sub & (place >= 0)
    safe = place.clamp(min=0)
    y = safe // side_w
    key = torch.where(on_grid, first + y * row_extra + safe, first + slot)  # base rows first, in their order
    if origin is not None:  # then every sub-image's [CLS] row, then its merged rows
        key = torch.where(is_sub & (place == _CLS), cls_key + sub - 1, key)
        key = torch.where(is_sub & (place == _MERGED), merged_key + (sub - 1) * width + slot, key)
    dropped = None
    if drop is not None:
        dropped = drop.flatten()[flat] & is_sub
        key = key.masked_fill(dropped, big * len(grids))  # last of all, then discarded
    order = key.argsort(stable=True)
    grid_rows = on_grid if dropped is None else on_grid & ~dropped
    sorted_grid = grid_rows[order] if native else torch.zeros_like(grid_rows)
    row_id = torch.where(grid_rows, row_base + y, -1)[order]  # the stitched row of a grid row, image apart
    starts = sorted_grid & torch.cat([sorted_grid[:1], row_id[1:] != row_id[:-1]])  # a grid row begins
    started = starts.long()

    # what each image gets beside its rows: one newline for a base-only image (native; VisionZip's official one)
    tail = [int(g.num_crops == 1 and (native or base_newline)) for g in grids]
    reached, newlines = list(counts), [0] * len(grids)
    if native and whole and dropped is None:
        newlines = [g.unpadded_shape[0] if g.num_crops > 1 else 0 for g in grids]
    elif native or dropped is not None:  # the one read: which rows keep tokens, which rows a layout dropped
        read = []
        if native:
            image = table[crop[order], 6] // rows_cap  # (base rows say 0, but never begin a row)
            read.append(started.new_zeros(len(grids)).index_add_(0, image, started))
        if dropped is not None:
            read.append(started.new_zeros(crops).index_add_(0, crop, dropped.long()))
        host = torch.cat(read).tolist() if len(read) > 1 else read[0].tolist()
        if native:
            newlines, host = host[: len(grids)], host[len(grids) :]
        if dropped is not None:
            reached = [n - d for n, d in zip(counts, host, strict=True)]
    lengths = [t + r for t, r in zip(tail, newlines, strict=True)]
    for c, n in enumerate(reached):
        lengths[image_of[c]] += n
    total = sum(lengths)
    # each row's slot: the rows before it, the newlines before it (rows begun, but its own), earlier images' tails
    dest = torch.arange(len(flat), device=device) + started.cumsum(0) - sorted_grid.long()
    earlier_tails = [sum(tail[:i]) for i in image_of]
    if any(earlier_tails):
        dest = dest + on_device(earlier_tails, device)[crop[order]]
    if dropped is not None:
        dest = dest.masked_fill(dropped[order], total)
    out = newline.to(embeds).expand(total + 1, -1).clone()
    out[dest] = embeds[order]
    return Packed(out[:total], lengths, reached)


def with_row_after(flat: torch.Tensor, lengths: list[int], row: torch.Tensor) -> torch.Tensor:
    """[sum(lengths) + len(lengths), D]: the pieces of `flat` [sum(lengths), D] (one per item, in order), each
    followed by `row` [D] (OneVision's newline after every video), in a fixed few kernels."""
    from .tables import repeated

    out = row.to(flat).expand(len(flat) + len(lengths), -1).clone()
    dest = torch.arange(len(flat), device=flat.device) + repeated(list(range(len(lengths))), lengths, flat.device)
    out[dest] = flat
    return out
