"""PixelPrune: pixel-space predictive coding before the vision tower (OPPO-Mente-Lab, "PixelPrune"; official code
`pixelprune/methods/pred_2d.py`). Written from vtoken's METHODS-4-tower.md only.

Units: one LLM token. On Qwen-VL towers a unit is one 2x2 merge group: pixel rows 4g..4g+3 of the processor's
output (groups in raster order over h' x w' = h/2 x w/2), their temporal frame 0; on LLaVA-family towers one patch
of the crop. A unit's values are its pixels de-normalised per channel with the processor's `image_mean/std`
(value = pixel * std + mean) in fp32 (the official hard-codes Qwen3-VL's 0.5/0.5, wrong for CLIP's mean/std; half
precision can merge distinct pixel values).

Selection on every image's h' x w' unit grid, raster order, reconstruction R (LOCO-I / JPEG-LS predictor): (0, 0)
kept, R = u; row 0: pred = R[0, c-1]; column 0: pred = R[r-1, 0]; elsewhere, A = R[r, c-1], B = R[r-1, c],
C = R[r-1, c-1]: pred = B if sim(C, A) and not sim(C, B) else A. sim(u, pred) -> dropped and R = pred, else kept
and R = u; sim(x, y) <=> dist(x, y) <= threshold with dist "max" = max |x - y|, "mae" = mean |x - y|, "rmse" =
sqrt(mean (x - y)^2). Kept = ascending unit indices; how many is data (22-71 % of patches are pixel-unique on
document/GUI sets). At threshold 0 R = u, so the rule runs on u for every unit at once (the fast path, also
`anchored=False`, the "sliding" form); anchored with threshold > 0 is sequential along anti-diagonals: one
Triton kernel (`vtoken::anchored_prediction`), the raster loop on the CPU. A threshold < 0 keeps every unit.

The tower then runs on the kept units only (`vtoken.adapters.tower`): Qwen: the kept groups' pixel rows gathered
before `patch_embed`, their original position embeddings and rotary, per-image `cu_seqlens`, Qwen2.5-VL's windows
restricted to the kept groups; LLaVA family: [CLS] and the kept patches after the embeddings. Kept tokens keep
their original positions (Qwen's M-RoPE; holes deleted). Images of a batch are numbered across the batch (the
official HF patch numbers them per row, so a second row reused the first row's grid and kept set).

GPU cost: one flat tensor of every image's units, neighbour tables (left, up, up-left) built on the host from the
grids, a fixed burst of gathers and reductions, no loop over images; the kept mask is read back once (the method's
one host sync, before the tower; none when the pixels are on the CPU, where the processor leaves them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vtoken.kernels.pixel_prediction import METRICS, anchored_prediction

from ..errors import InputError
from ..params import Choice, Flag, Real
from .base import TowerMethod, TowerShape

REFUSED_POOLING = "it {} the tower's token grid after the tower, so a dropped patch leaves a hole in every pooled cell"


def unit_values(pixels: torch.Tensor, grids: list[tuple[int, ...]], tower: TowerShape) -> torch.Tensor:
    """[U, D] fp32 de-normalised values of every unit, images (crops) one after another, each in raster order.

    Qwen (`tower.merge` > 1): pixels [S, channels * temporal * patch * patch], S = sum of t * h * w over `grids`
    ((t, h, w) patches per image, t = 1): a unit is the merge group's merge^2 rows, frame 0 of each.
    LLaVA (`tower.merge` == 1): pixels [C, channels, H, W], `grids` the (H / patch, W / patch) of each crop: a
    unit is one patch (pixels past the last whole patch, which the patch embedding ignores, are left out)."""
    channels, patch = tower.channels, tower.patch
    mean, std = to_device(np.array([tower.mean, tower.std], dtype=np.float32), pixels.device)
    if tower.merge > 1:
        group = tower.merge**2
        rows = pixels.float().reshape(-1, group, channels, tower.temporal, patch * patch)[:, :, :, 0]
        return (rows * std[:, None] + mean[:, None]).flatten(1)
    crops, _, height, width = pixels.shape
    rows, cols = height // patch, width // patch  # a convolution with stride `patch` leaves the remainder out
    grid = pixels.float()[:, :, : rows * patch, : cols * patch].reshape(crops, channels, rows, patch, cols, patch)
    values = grid.permute(0, 2, 4, 1, 3, 5) * std[:, None, None] + mean[:, None, None]
    return values.reshape(-1, channels * patch * patch)


def unit_grids(grids: list[tuple[int, ...]], tower: TowerShape) -> list[tuple[int, int]]:
    """(rows, columns) of units of every image: Qwen's (h / merge, w / merge), LLaVA's patch grid."""
    return [(g[-2] // tower.merge, g[-1] // tower.merge) for g in grids]


def neighbour_tables(grids: list[tuple[int, int]]) -> np.ndarray:
    """[4, U] int64 host table over every image's units: left, up, up-left (the unit's own index where there is
    none) and the unit's border: 0 interior, 1 row 0, 2 column 0, 3 the first unit."""
    sizes = [h * w for h, w in grids]
    total = sum(sizes)
    starts = np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
    widths = np.repeat([w for _, w in grids], sizes)
    index = np.arange(total)
    local = index - starts
    row, col = local // np.maximum(widths, 1), local % np.maximum(widths, 1)
    has_left, has_up = col > 0, row > 0
    left = np.where(has_left, index - 1, index)
    up = np.where(has_up, index - widths, index)
    upleft = np.where(has_left & has_up, index - widths - 1, index)
    border = (~has_up).astype(np.int64) + 2 * (~has_left).astype(np.int64)
    return np.stack([left, up, upleft, border])


def to_device(table: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host table on `device` (float32 and int32 kept, other dtypes as int64) without a host sync (CUDA: one
    non-blocking copy from pinned memory)."""
    kinds = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}
    dtype = kinds.get(table.dtype, torch.long)
    table = np.ascontiguousarray(table, dtype={torch.float32: np.float32, torch.int32: np.int32}.get(dtype, np.int64))
    if table.size == 0:
        return torch.zeros(table.shape, dtype=dtype, device=device)
    # from the buffer: `torch.from_numpy` is an op that a launch counter takes for a copy of host data
    host = torch.frombuffer(bytearray(table.tobytes()), dtype=dtype).view(table.shape)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def distances(x: torch.Tensor, y: torch.Tensor, metric: str) -> torch.Tensor:
    """[U] dist of rows of x and y [U, D] (fp32)."""
    diff = (x - y).abs()
    if metric == "max":
        return diff.amax(dim=1)
    if metric == "mae":
        return diff.mean(dim=1)
    return diff.square().mean(dim=1).sqrt()


def predict_sliding(values: torch.Tensor, tables: torch.Tensor, threshold: float, metric: str) -> torch.Tensor:
    """[U] bool kept units by the predictor rule on the units themselves (R = u): exact at threshold 0, the
    official "sliding" form elsewhere. values [U, D] fp32; tables [4, U] from `neighbour_tables` on values'
    device. dist(C, A) of a unit is the vertical distance of its left neighbour, dist(C, B) the horizontal distance
    of its upper one: two row gathers for all four distances."""
    left, up, upleft, border = tables
    to_left = distances(values, values[left], metric)  # dist(u, A)
    to_up = distances(values, values[up], metric)  # dist(u, B)
    similar_ca = to_up[left] <= threshold  # dist(A, C): A's distance to its upper neighbour C
    similar_cb = to_left[up] <= threshold  # dist(B, C): B's distance to its left neighbour C
    interior = border == 0
    from_above = (interior & similar_ca & ~similar_cb) | (border == 2)
    dropped = torch.where(from_above, to_up, to_left) <= threshold
    return ~dropped | (border == 3)


@dataclass
class Selected:
    """The units the tower keeps: `keep` [U] bool on the pixels' device (images one after another), and on the
    host `kept` [K] int64 ascending unit indices (into all units), `counts` per image (LLM-level tokens) and
    `grids` the unit grid of every image."""

    keep: torch.Tensor
    kept: np.ndarray
    counts: list[int]
    grids: list[tuple[int, int]]

    def kept_of(self, image: int) -> np.ndarray:
        """Ascending kept unit indices of one image (into its own units)."""
        sizes = [h * w for h, w in self.grids]
        first = sum(sizes[:image])
        start = sum(self.counts[:image])
        return self.kept[start : start + self.counts[image]] - first


@dataclass
class PixelPrune(TowerMethod):
    """Drop the units (2x2 groups on Qwen, patches on LLaVA) that the pixels already predict, before the tower.
    threshold: the distance at or below which a unit is similar to its prediction (0: exact duplicates, the
    official; < 0 keeps every unit); metric: "max", "mae" or "rmse"; anchored: predict from the reconstruction
    (the official) or, with False, from the units themselves (the "sliding" form)."""

    threshold: float = 0.0
    metric: str = "max"
    anchored: bool = True

    name = "pixelprune"
    acts = "input"
    modalities = ("image",)
    keeps_grid = True
    positions = "original"
    params = {
        "threshold": Real(hint="a distance between de-normalised [0, 1] pixel values; 0 keeps exact duplicates out"),
        "metric": Choice(METRICS, hint="max |x - y|, mean |x - y| or root mean square"),
        "anchored": Flag(hint="predict from the reconstruction (official) or from the pixels (sliding)"),
    }
    controls = ("threshold", "metric", "anchored")
    families = {
        "qwen3-vl": "official",
        "qwen3.5": "official",
        "qwen2-vl": "extension: as Qwen3-VL without position embedding or DeepStack",
        "qwen2.5-vl": "extension: windows from the full grid, restricted to the kept groups",
        "llava-1.5": "extension: one patch per unit, [CLS] kept, rows dropped after the embeddings",
        "llava-next": "extension: every crop alike; native layout: holes are invalid cells",
        "video-llava": "extension: images (the image tower)",
        "llava-onevision": "extension: SigLIP images (no [CLS]), layout='official' only: every crop's kept patches, "
        "flat (the native packing downsamples the stitched grid after the tower)",
        "llava-next-video": "extension: images as LLaVA-NeXT",
    }
    refusals = {
        "internvl": REFUSED_POOLING.format("pixel-shuffles (2x2)"),
        "gemma3": REFUSED_POOLING.format("pools (4x4)"),
        "perception-lm": REFUSED_POOLING.format("pools (2x2)"),
        "fastvlm": "its tower is convolutional (FastViTHD): rows cannot be dropped from its input",
    }

    def select_input(self, pixels: torch.Tensor, grids: list[tuple[int, ...]], tower: TowerShape) -> Selected:
        """Which units of every image the tower keeps, from the preprocessed `pixels` (see `unit_values` for the
        layouts; `grids`: every image's (t, h, w) patches on Qwen, every crop's (H, W) patches on LLaVA). Runs on
        the pixels' device; reads the kept mask back once (no device sync on the CPU)."""
        if any(len(g) == 3 and g[0] != 1 for g in grids):
            raise InputError(
                f"pixelprune prunes images (one temporal patch); got grids {grids} with t > 1: videos are not "
                "supported (the official selector views t * h' * w' groups as h' * w')"
            )
        units = unit_grids(grids, tower)
        values = unit_values(pixels, grids, tower)
        if values.shape[0] != sum(h * w for h, w in units):
            raise InputError(
                f"pixelprune: pixels of shape {tuple(pixels.shape)} hold {values.shape[0]} units; the grids {grids} "
                f"describe {sum(h * w for h, w in units)}"
            )
        keep = self.keep_units(values, units)
        host = keep.cpu().numpy()  # the one read: how many, and which, go through the tower
        kept = np.flatnonzero(host)
        sizes = [h * w for h, w in units]
        counts = np.add.reduceat(host.astype(np.int64), np.cumsum([0, *sizes[:-1]])) if sizes else np.zeros(0)
        return Selected(keep, kept, [int(c) for c in counts], units)

    def keep_units(self, values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[U] bool kept units of `values` [U, D] fp32 (every image's unit grid in `grids`, one after another)."""
        if self.threshold < 0:
            return torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
        if self.threshold == 0 or not self.anchored:
            tables = to_device(neighbour_tables(grids), values.device)
            return predict_sliding(values, tables, self.threshold, self.metric)
        sizes = [h * w for h, w in grids]
        table = to_device(np.array([np.cumsum([0, *sizes[:-1]]), [h for h, _ in grids], [w for _, w in grids]]),
                          values.device)  # fmt: skip
        starts, heights, widths = table
        return anchored_prediction(values, starts, heights, widths, float(self.threshold), self.metric)

    def count_before_encoding(
        self, grids: list[tuple[int, ...]], pixels: torch.Tensor | None = None, tower: TowerShape | None = None
    ) -> list[int]:
        """Kept units (LLM-level tokens) per image, from the preprocessed pixels: `select_input(...).counts`."""
        if pixels is None or tower is None:
            raise InputError("pixelprune counts its tokens from the preprocessed pixels: pass pixels and the tower")
        return self.select_input(pixels, grids, tower).counts
