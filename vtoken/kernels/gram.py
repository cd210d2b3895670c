"""Gram matrices of L2-normalised token sets in exact fp32, for the greedy selections (DivPrune, VisPruner).

`gram_triton` computes every entry as one fp32 dot product accumulated in a fixed order (IEEE fp32, never TF32),
the same at every position, whatever the batch size or the padded length: an image's similarities do not depend on
what else is in the batch, and identical tokens get bitwise identical rows (exact ties stay ties). Entry (j, i) is
the stored transpose of entry (i, j): the matrix is exactly symmetric (a row read later holds the column's values).
`gram_reference` is the plain batched product.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

BLOCK = 32  # rows and columns of a tile
BLOCK_D = 8  # channels per accumulation step


def gram_reference(unit: torch.Tensor) -> torch.Tensor:
    """[B, L, D] -> [B, L, L] fp32: unit @ unit^T per batch entry."""
    unit = unit.float()
    return unit @ unit.transpose(1, 2)


if triton is not None:

    @triton.jit
    def _gram_kernel(
        x_ptr,
        out_ptr,
        length,
        dim,
        stride_xb,
        stride_xl,
        stride_ob,
        stride_ol,
        BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # one program per (batch entry, tile row, tile column) with column >= row; the lower tile is its transpose
        b, ti, tj = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # 64-bit batch offsets
        if tj >= ti:
            rows = ti * BLOCK + tl.arange(0, BLOCK)
            cols = tj * BLOCK + tl.arange(0, BLOCK)
            offs_d = tl.arange(0, BLOCK_D)
            acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
            base = x_ptr + b * stride_xb
            for start in range(0, dim, BLOCK_D):
                d = start + offs_d
                a = tl.load(base + rows[:, None] * stride_xl + d[None, :],
                            mask=(rows[:, None] < length) & (d[None, :] < dim), other=0.0)  # fmt: skip
                c = tl.load(base + cols[:, None] * stride_xl + d[None, :],
                            mask=(cols[:, None] < length) & (d[None, :] < dim), other=0.0)  # fmt: skip
                # products summed per entry, the same way at every position of the tile (tl.dot may accumulate
                # an entry differently depending on where it sits, which would split exact ties)
                acc += tl.sum(a[:, None, :] * c[None, :, :], axis=2)
            out = out_ptr + b * stride_ob
            # the upper triangle of the tile, stored at (i, j) and (j, i): exactly symmetric, diagonal tiles too
            inside = (rows[:, None] < length) & (cols[None, :] < length) & (rows[:, None] <= cols[None, :])
            tl.store(out + rows[:, None] * stride_ol + cols[None, :], acc, mask=inside)
            tl.store(out + cols[None, :] * stride_ol + rows[:, None], acc, mask=inside)


def gram_triton(unit: torch.Tensor) -> torch.Tensor:
    """[B, L, D] -> [B, L, L] fp32 on unit's device (CUDA, or CPU under TRITON_INTERPRET=1); see the module."""
    if triton is None:
        raise RuntimeError("gram_triton needs triton (pip install 'vtoken[kernels]')")
    unit = unit.float().contiguous()
    batch, length, dim = unit.shape
    out = torch.empty(batch, length, length, device=unit.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    tiles = triton.cdiv(length, BLOCK)
    _gram_kernel[(batch, tiles, tiles)](
        unit, out, length, dim, unit.stride(0), unit.stride(1), out.stride(0), out.stride(1),
        BLOCK=BLOCK, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return out
