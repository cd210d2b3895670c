"""PixelPrune's anchored predictor (threshold > 0) as one custom op, `vtoken::anchored_prediction`.

Every image is an h x w grid of units (a unit: the de-normalised pixel values of one LLM token, D values in fp32),
stored row after row, images one after another. In raster order, with R the reconstruction: (0, 0) is kept and
R = u; row 0 predicts from the left (pred = R[0, c-1]), column 0 from above (pred = R[r-1, 0]); elsewhere, with
A = R[r, c-1], B = R[r-1, c], C = R[r-1, c-1] (LOCO-I / JPEG-LS), pred = B if sim(C, A) and not sim(C, B) else A.
A unit similar to its prediction is dropped and R = pred; else it is kept and R = u. sim(x, y) <=> dist(x, y) <=
threshold, dist: "max" = max |x - y|, "mae" = mean |x - y|, "rmse" = sqrt(mean (x - y)^2).

A cell needs R at (r, c-1), (r-1, c) and (r-1, c-1): the cells of one anti-diagonal r + c = d are independent.
CPU (and any device without triton): `anchored_prediction_reference`, the raster loop, one image at a time.
CUDA: `anchored_prediction_triton`, one launch, one program per image looping over its h + w - 1 anti-diagonals,
each vectorised over its cells and D, R in global memory. "max" agrees exactly with the reference; "mae"/"rmse"
sum in another order, so a distance within rounding of the threshold may decide differently.
"""

from __future__ import annotations

import numpy as np
import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

METRICS = ("max", "mae", "rmse")


def distance(x: np.ndarray, y: np.ndarray, metric: str) -> np.float32:
    """dist(x, y) of two [D] fp32 vectors (see the module)."""
    diff = np.abs(x - y)
    if metric == "max":
        return diff.max()
    if metric == "mae":
        return diff.mean(dtype=np.float32)
    return np.sqrt((diff * diff).mean(dtype=np.float32))


def predict_image(units: np.ndarray, height: int, width: int, threshold: float, metric: str) -> np.ndarray:
    """[h * w] bool kept units of one image's [h * w, D] fp32 units: the raster loop (see the module)."""
    grid = units.reshape(height, width, -1)
    recon = grid.copy()
    keep = np.ones((height, width), dtype=bool)
    tau = np.float32(threshold)
    for row in range(height):
        for col in range(width):
            if row == 0 and col == 0:
                continue
            if row == 0:
                pred = recon[0, col - 1]
            elif col == 0:
                pred = recon[row - 1, 0]
            else:
                a, b, c = recon[row, col - 1], recon[row - 1, col], recon[row - 1, col - 1]
                ca, cb = distance(c, a, metric) <= tau, distance(c, b, metric) <= tau
                pred = b if ca and not cb else a
            if distance(grid[row, col], pred, metric) <= tau:
                keep[row, col] = False
                recon[row, col] = pred
    return keep.reshape(-1)


def anchored_prediction_reference(
    units: torch.Tensor, starts: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor, threshold: float,
    metric: str,
) -> torch.Tensor:  # fmt: skip
    """units [G, D] fp32 (every image's h * w units, row after row, images one after another), starts/heights/
    widths [I] int64 -> [G] bool kept units: the raster loop, one image at a time (numpy)."""
    values = units.detach().float().cpu().numpy()
    keep = np.ones(values.shape[0], dtype=bool)
    for start, height, width in zip(starts.tolist(), heights.tolist(), widths.tolist(), strict=True):
        end = start + height * width
        keep[start:end] = predict_image(values[start:end], height, width, threshold, metric)
    return torch.from_numpy(keep).to(units.device)


if triton is not None:

    @triton.jit
    def _anchored_kernel(
        units_ptr, recon_ptr, keep_ptr, starts_ptr, heights_ptr, widths_ptr, dim, threshold,
        METRIC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per image, its anti-diagonals in order; R (recon) in global memory, a barrier between diagonals
        image = tl.program_id(0)
        start = tl.load(starts_ptr + image)
        height = tl.load(heights_ptr + image)
        width = tl.load(widths_ptr + image)
        lanes = tl.arange(0, BLOCK_C)
        columns = tl.arange(0, BLOCK_D)
        for diagonal in range(0, height + width - 1):
            first_row = tl.maximum(diagonal - width + 1, 0)
            cells = tl.minimum(diagonal, height - 1) - first_row + 1
            for chunk in range(0, cells, BLOCK_C):
                i = chunk + lanes
                real = i < cells
                row = first_row + i
                col = diagonal - row
                cell = (start + row * width + col).to(tl.int64)
                has_left = real & (col > 0)
                has_up = real & (row > 0)
                dist_ua = tl.zeros([BLOCK_C], dtype=tl.float32)
                dist_ub = tl.zeros([BLOCK_C], dtype=tl.float32)
                dist_ca = tl.zeros([BLOCK_C], dtype=tl.float32)
                dist_cb = tl.zeros([BLOCK_C], dtype=tl.float32)
                for offset in range(0, dim, BLOCK_D):
                    k = offset + columns
                    inside = real[:, None] & (k < dim)[None, :]
                    left_in = inside & has_left[:, None]
                    up_in = inside & has_up[:, None]
                    u = tl.load(units_ptr + cell[:, None] * dim + k[None, :], mask=inside, other=0.0)
                    a = tl.load(recon_ptr + (cell - 1)[:, None] * dim + k[None, :], mask=left_in, other=0.0)
                    b = tl.load(recon_ptr + (cell - width)[:, None] * dim + k[None, :], mask=up_in, other=0.0)
                    c = tl.load(recon_ptr + (cell - width - 1)[:, None] * dim + k[None, :], mask=left_in & up_in,
                                other=0.0)  # fmt: skip
                    if METRIC == 0:
                        dist_ua = tl.maximum(dist_ua, tl.max(tl.abs(u - a), axis=1))
                        dist_ub = tl.maximum(dist_ub, tl.max(tl.abs(u - b), axis=1))
                        dist_ca = tl.maximum(dist_ca, tl.max(tl.abs(c - a), axis=1))
                        dist_cb = tl.maximum(dist_cb, tl.max(tl.abs(c - b), axis=1))
                    elif METRIC == 1:
                        dist_ua += tl.sum(tl.abs(u - a), axis=1)
                        dist_ub += tl.sum(tl.abs(u - b), axis=1)
                        dist_ca += tl.sum(tl.abs(c - a), axis=1)
                        dist_cb += tl.sum(tl.abs(c - b), axis=1)
                    else:
                        dist_ua += tl.sum((u - a) * (u - a), axis=1)
                        dist_ub += tl.sum((u - b) * (u - b), axis=1)
                        dist_ca += tl.sum((c - a) * (c - a), axis=1)
                        dist_cb += tl.sum((c - b) * (c - b), axis=1)
                if METRIC == 1:
                    dist_ua, dist_ub, dist_ca, dist_cb = dist_ua / dim, dist_ub / dim, dist_ca / dim, dist_cb / dim
                elif METRIC == 2:
                    dist_ua = tl.sqrt(dist_ua / dim)
                    dist_ub = tl.sqrt(dist_ub / dim)
                    dist_ca = tl.sqrt(dist_ca / dim)
                    dist_cb = tl.sqrt(dist_cb / dim)
                interior = has_left & has_up
                from_above = (interior & (dist_ca <= threshold) & (dist_cb > threshold)) | (has_up & ~has_left)
                dist_pred = tl.where(from_above, dist_ub, dist_ua)
                dropped = (has_left | has_up) & (dist_pred <= threshold)
                tl.store(keep_ptr + cell, (~dropped).to(tl.int8), mask=real)
                for offset in range(0, dim, BLOCK_D):
                    k = offset + columns
                    inside = real[:, None] & (k < dim)[None, :]
                    u = tl.load(units_ptr + cell[:, None] * dim + k[None, :], mask=inside, other=0.0)
                    a = tl.load(recon_ptr + (cell - 1)[:, None] * dim + k[None, :], mask=inside & has_left[:, None],
                                other=0.0)  # fmt: skip
                    b = tl.load(recon_ptr + (cell - width)[:, None] * dim + k[None, :], mask=inside & has_up[:, None],
                                other=0.0)  # fmt: skip
                    pred = tl.where(from_above[:, None], b, a)
                    value = tl.where(dropped[:, None], pred, u)
                    tl.store(recon_ptr + cell[:, None] * dim + k[None, :], value, mask=inside)
            tl.debug_barrier()


def anchored_prediction_triton(
    units: torch.Tensor, starts: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor, threshold: float,
    metric: str,
) -> torch.Tensor:  # fmt: skip
    """`anchored_prediction_reference`'s signature and result, every image in one launch of the Triton kernel
    (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("anchored_prediction_triton needs triton (pip install 'vtoken[kernels]')")
    count, dim = units.shape
    keep = torch.ones(count, dtype=torch.int8, device=units.device)
    images = starts.shape[0]
    if count == 0 or images == 0:
        return keep.bool()
    units = units.float().contiguous()
    recon = torch.empty_like(units)
    block_d = min(triton.next_power_of_2(max(dim, 1)), 256)
    _anchored_kernel[(images,)](
        units, recon, keep, starts.to(units.device).contiguous(), heights.to(units.device).contiguous(),
        widths.to(units.device).contiguous(), dim, float(threshold), METRIC=METRICS.index(metric), BLOCK_C=16,
        BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return keep.bool()


@torch.library.custom_op("vtoken::anchored_prediction", mutates_args=())
def anchored_prediction(
    units: torch.Tensor, starts: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor, threshold: float,
    metric: str,
) -> torch.Tensor:  # fmt: skip
    """PixelPrune's anchored predictor over every image of a batch (see the module): units [G, D] fp32, starts/
    heights/widths [I] int64 (each image's first unit and grid) -> [G] bool kept units."""
    return anchored_prediction_reference(units, starts, heights, widths, threshold, metric)


@anchored_prediction.register_fake
def _(units, starts, heights, widths, threshold, metric):  # noqa: ANN001, ANN202
    return units.new_empty(units.shape[0], dtype=torch.bool)


# the reference runs the raster loop on the host, one image at a time
register_cuda(anchored_prediction, anchored_prediction_triton, anchored_prediction_reference, host_loop=True)
