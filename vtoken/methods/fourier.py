"""Fourier-VLM: a 2-D DCT low-pass of each crop's token grid (official code: whyisverysmart/Fourier-Compressor).

Per channel: orthonormal 2-D DCT-II over the H x W token grid, keep the top-left h x w low-frequency block, and
take the inverse orthonormal DCT *at size h x w*. The result is h * w tokens in raster order, computed in fp32
and cast back, with no renormalisation (the DC level grows by sqrt(HW / hw)). Transforms use 2N-point FFTs:
O(n log n), no N x N matrices.

The paper's checkpoints were fine-tuned with the compressor in place; training-free use on stock models is an
approximation of the method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import VTokenError
from ..params import Int, OrNone, Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod


def _scales(n: int, like: torch.Tensor) -> torch.Tensor:
    scale = torch.full((n,), math.sqrt(2 / n), device=like.device, dtype=like.dtype)
    scale[0] = math.sqrt(1 / n)
    return scale


def _phase(n: int, like: torch.Tensor, sign: float) -> torch.Tensor:
    """exp(sign * i * pi * k / (2n)), k = 0..n-1, in the precision of `like`."""
    k = torch.arange(n, device=like.device, dtype=like.dtype)
    return torch.polar(torch.ones_like(k), sign * math.pi * k / (2 * n))


def dct(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Orthonormal DCT-II of real `x` along `dim` (equals scipy.fft.dct(norm="ortho"))."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    spectrum = torch.fft.fft(x, n=2 * n)[..., :n]
    out = (spectrum * _phase(n, x, -1.0)).real * _scales(n, x)
    return out.movedim(-1, dim)


def idct(c: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `dct` (orthonormal DCT-III) along `dim`."""
    c = c.movedim(dim, -1)
    n = c.shape[-1]
    z = c * _scales(n, c) * _phase(n, c, 1.0)
    out = (torch.fft.ifft(z, n=2 * n)[..., :n] * (2 * n)).real
    return out.movedim(-1, dim)


def dct_lowpass(grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """grid [..., H, W, D] -> [..., height, width, D]: 2-D DCT, keep the low-frequency block, inverse at its size."""
    work = grid.to(torch.promote_types(grid.dtype, torch.float32))  # at least fp32 (bf16/fp16 lose the DC term)
    coefficients = dct(dct(work, dim=-3), dim=-2)[..., :height, :width, :]
    return idct(idct(coefficients, dim=-3), dim=-2).to(grid.dtype)


@dataclass
class FourierDCT(EncoderMethod):
    """DCT low-pass of every crop's grid to h x w tokens.

    The per-axis size is, in order of precedence: `reserve` (same side on both axes; LLaVA-1.5 official values
    16/12/8/6 give 256/144/64/36 tokens), `ratio` (per-axis fraction, `max(int(side * ratio), 1)`; Qwen's
    official default is 2/3), or `budget` (fraction kept overall, so per axis sqrt(fraction); a count k keeps a
    sqrt(k) x sqrt(k) block). The default budget 0.25 is reserve 12 on a 24 x 24 grid.
    """

    reserve: int | None = None
    ratio: float | None = None

    name = "fourier"
    scopes = ("crop",)
    # needs a full grid, and a model that takes a grid of any size at contiguous positions
    requires = ("grid", "resized_grid")
    params = {
        "reserve": OrNone(Int(1, hint="the side kept on both axes, e.g. 12")),
        "ratio": OrNone(Real("(0, 1]", hint="the fraction kept per axis, e.g. 2/3")),
    }
    merges = True

    def merged_cells(self, height: int, width: int, k: int) -> list[list[int]]:
        """The h x w blocks of an H x W crop: each output token of the low-pass is a smooth mix weighted towards
        its block (the demo draws them)."""
        h, w = self.output_grid(height, width)
        block = [(r * h // height) * w + c * w // width for r in range(height) for c in range(width)]
        return [[cell for cell, b in enumerate(block) if b == out] for out in range(h * w)]

    def output_grid(self, height: int, width: int) -> tuple[int, int]:
        if self.reserve is not None:
            return min(self.reserve, height), min(self.reserve, width)
        if self.ratio is not None:
            return max(int(height * self.ratio), 1), max(int(width * self.ratio), 1)
        if isinstance(self.budget, int):
            side = max(1, math.isqrt(self.budget))
            return min(side, height), min(side, width)
        per_axis = math.sqrt(self.budget)
        return max(int(height * per_axis + 0.5), 1), max(int(width * per_axis + 0.5), 1)

    def planned_count(self, n: int) -> int | None:
        return None  # depends on the grid's shape, not only on n

    def count_before_encoding(self, n: int, grid: tuple[int, int], crops: int = 1) -> int | None:
        if n != grid[0] * grid[1]:
            return None  # a grid cut by unpadding is refused at select
        h, w = self.output_grid(*grid)
        return h * w

    def select(self, tokens: VisualTokens) -> Selection:
        height, width = tokens.grid
        if tokens.valid is not None:
            raise VTokenError("fourier needs complete token grids; this model's crops are cut by unpadding")
        h, w = self.output_grid(height, width)
        grid = tokens.features.view(tokens.num_crops, height, width, -1)
        return Selection(features=dct_lowpass(grid, h, w).flatten(1, 2), grid=(h, w))
