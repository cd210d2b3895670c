"""Greedy MAP inference of a determinantal point process for many crops at once (CDPruner's selection).

The fast greedy algorithm of Chen et al. (2018) on the kernel L = diag(q) S diag(q), S[i, j] = u_i . u_j for
L2-normalised features u and a quality q per token, one crop at a time and independently:

    d2 = diag(L) (non-candidates at -inf); c_0, c_1, ... = 0
    step i: j = argmax d2 over the tokens still adding something (the first index on ties); none left: stop
            e = (L[j, :] - sum_{t < i} c_t[j] c_t) / sqrt(d2[j]);  c_i = e;  d2 -= e^2;  d2[j] = -inf

A token adds something while d2[j] > tolerance * L[j, j]: its gain is zero up to rounding once it lies in the span
of the picks (the similarity matrix's rank is at most the feature width; an exact duplicate adds nothing), and
rounding scales with its own diagonal entry. When no token adds anything the remaining steps report -1 and the
caller fills them its own way (the official code takes square roots of non-positive numbers there).

Each step depends on the previous one: the steps are sequential by nature. `dpp_greedy` is the custom op
`vtoken::dpp_greedy`: on CUDA one Triton program per crop runs every step inside the kernel (d2 and the c rows in
global scratch, per step a block argmax, one row of L, a GEMV against the earlier c rows, the d2 update), so the
whole selection is one launch with no host synchronisation; elsewhere it runs the PyTorch reference loop below.
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

# above this many tokens per crop L is not materialised ([C, N, N] fp32): the kernel computes each row it needs
# from the features (a GEMV per step)
MATRIX_LIMIT = 4096


def dpp_kernel_matrix(unit: torch.Tensor, quality: torch.Tensor) -> torch.Tensor:
    """L = diag(q) (u u^T) diag(q): [C, N, N] float32 from unit [C, N, D] and quality [C, N]."""
    unit, quality = unit.float(), quality.float()
    return quality[:, :, None] * torch.bmm(unit, unit.transpose(1, 2)) * quality[:, None, :]


def dpp_greedy_reference(
    unit: torch.Tensor, quality: torch.Tensor, candidates: torch.Tensor, steps: int, tolerance: float
) -> torch.Tensor:
    """The greedy picks of every crop, in pick order: [C, steps] int64, -1 once no candidate of a crop adds
    anything (its gain at most `tolerance` times its diagonal entry of L).

    unit: [C, N, D] L2-normalised features; quality: [C, N] q; candidates: [C, N] bool (others are never picked).
    """
    crops, n = quality.shape
    kernel = dpp_kernel_matrix(unit, quality)
    diagonal = torch.diagonal(kernel, dim1=1, dim2=2)
    gains = diagonal.masked_fill(~candidates, float("-inf"))
    floor = tolerance * diagonal  # [C, N] a gain at most this is zero up to rounding
    rows = kernel.new_zeros(crops, max(steps, 1), n)  # the c rows
    picks = torch.full((crops, steps), -1, dtype=torch.long, device=kernel.device)
    alive = torch.ones(crops, dtype=torch.bool, device=kernel.device)
    crop = torch.arange(crops, device=kernel.device)
    for step in range(steps):
        adding = torch.where(gains > floor, gains, float("-inf"))
        pick = adding.argmax(-1)  # the first maximum
        best = adding[crop, pick]
        alive = alive & (best > float("-inf"))
        earlier = torch.bmm(rows[crop, :step, pick].unsqueeze(1), rows[:, :step]).squeeze(1)  # [C, N]
        update = (kernel[crop, pick] - earlier) / torch.where(alive, best, 1.0).sqrt()[:, None]
        update = torch.where(alive[:, None], update, 0.0)
        rows[:, step] = update
        gains = gains - update * update
        gains[crop, pick] = torch.where(alive, float("-inf"), gains[crop, pick])
        picks[:, step] = torch.where(alive, pick, -1)
    return picks


if triton is not None:

    @triton.jit
    def _dpp_greedy_kernel(
        src_ptr, q_ptr, cand_ptr, gains_ptr, floors_ptr, rows_ptr, picks_ptr,
        n, dim, steps, tolerance,
        stride_sc, stride_sr, stride_sk,
        stride_qc, stride_cc, stride_gc, stride_rc, stride_rt, stride_pc,
        FROM_FEATURES: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per crop. src: L [C, N, N] (strides sc, sr, sk), or with FROM_FEATURES the unit features
        # [C, N, D] (sc, sr = row stride, sk = feature stride) from which rows of L are computed
        crop = tl.program_id(0).to(tl.int64)
        src = src_ptr + crop * stride_sc
        q_row = q_ptr + crop * stride_qc
        gains = gains_ptr + crop * stride_gc
        floors = floors_ptr + crop * stride_gc
        rows = rows_ptr + crop * stride_rc
        arange_n = tl.arange(0, BLOCK_N)

        # d2 = diag(L) over the candidates; each token's floor: tolerance * its diagonal entry
        for start in range(0, n, BLOCK_N):
            offs = start + arange_n
            inside = offs < n
            q = tl.load(q_row + offs, mask=inside, other=0.0)
            if FROM_FEATURES:
                norm = tl.zeros([BLOCK_N], tl.float32)
                for d0 in range(0, dim, BLOCK_D):
                    offs_d = d0 + tl.arange(0, BLOCK_D)
                    u = tl.load(src + offs[:, None] * stride_sr + offs_d[None, :] * stride_sk,
                                mask=inside[:, None] & (offs_d[None, :] < dim), other=0.0)  # fmt: skip
                    norm += tl.sum(u * u, axis=1)
                diag = q * norm * q
            else:
                diag = tl.load(src + offs * stride_sr + offs * stride_sk, mask=inside, other=0.0)
            candidate = tl.load(cand_ptr + crop * stride_cc + offs, mask=inside, other=0) != 0
            tl.store(gains + offs, tl.where(candidate, diag, float("-inf")), mask=inside)
            tl.store(floors + offs, tolerance * diag, mask=inside)

        alive = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0) + 1  # 1 while some token adds something
        for step in range(0, steps):
            tl.debug_barrier()  # the previous step's stores are visible to every thread of the program
            best = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
            pick = tl.sum(tl.zeros([BLOCK_N], tl.int64), axis=0)
            for start in range(0, n, BLOCK_N):
                offs = start + arange_n
                block = tl.load(gains + offs, mask=offs < n, other=float("-inf"))
                above = block > tl.load(floors + offs, mask=offs < n, other=0.0)
                block = tl.where(above, block, float("-inf"))
                block_best = tl.max(block, axis=0)
                block_pick = tl.argmax(block, axis=0, tie_break_left=True).to(tl.int64) + start
                better = block_best > best  # strictly: an earlier block keeps its ties
                pick = tl.where(better, block_pick, pick)
                best = tl.where(better, block_best, best)
            alive = alive * (best > float("-inf")).to(tl.int32)
            live = alive != 0
            inverse = 1.0 / tl.sqrt(tl.where(live, best, 1.0))
            q_pick = tl.load(q_row + pick)
            for start in range(0, n, BLOCK_N):
                offs = start + arange_n
                inside = offs < n
                if FROM_FEATURES:
                    dot = tl.zeros([BLOCK_N], tl.float32)
                    for d0 in range(0, dim, BLOCK_D):
                        offs_d = d0 + tl.arange(0, BLOCK_D)
                        in_d = offs_d < dim
                        u_pick = tl.load(src + pick * stride_sr + offs_d * stride_sk, mask=in_d, other=0.0)
                        u = tl.load(src + offs[:, None] * stride_sr + offs_d[None, :] * stride_sk,
                                    mask=inside[:, None] & in_d[None, :], other=0.0)  # fmt: skip
                        dot += tl.sum(u * u_pick[None, :], axis=1)
                    q = tl.load(q_row + offs, mask=inside, other=0.0)
                    row = q_pick * dot * q
                else:
                    row = tl.load(src + pick * stride_sr + offs * stride_sk, mask=inside, other=0.0)
                earlier = tl.zeros([BLOCK_N], tl.float32)
                for t0 in range(0, step, BLOCK_T):
                    offs_t = t0 + tl.arange(0, BLOCK_T)
                    in_t = offs_t < step
                    c_pick = tl.load(rows + offs_t * stride_rt + pick, mask=in_t, other=0.0)
                    c = tl.load(rows + offs_t[:, None] * stride_rt + offs[None, :],
                                mask=in_t[:, None] & inside[None, :], other=0.0)  # fmt: skip
                    earlier += tl.sum(c_pick[:, None] * c, axis=0)
                update = tl.where(live & inside, (row - earlier) * inverse, 0.0)
                tl.store(rows + step * stride_rt + offs, update, mask=inside)
                gain = tl.load(gains + offs, mask=inside, other=float("-inf"))
                gain = gain - update * update
                gain = tl.where(live & (offs == pick), float("-inf"), gain)
                tl.store(gains + offs, gain, mask=inside)
            tl.store(picks_ptr + crop * stride_pc + step, tl.where(live, pick, -1))


def dpp_greedy_triton(
    unit: torch.Tensor, quality: torch.Tensor, candidates: torch.Tensor, steps: int, tolerance: float
) -> torch.Tensor:
    """Triton version of `dpp_greedy_reference` (same signature and result up to rounding): one launch."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    crops, n, dim = unit.shape
    quality = quality.float().contiguous()
    candidates = candidates.to(torch.int8).contiguous()
    from_features = n > MATRIX_LIMIT
    source = unit.float().contiguous() if from_features else dpp_kernel_matrix(unit, quality)
    gains = torch.empty(crops, n, device=unit.device, dtype=torch.float32)
    floors = torch.empty_like(gains)
    rows = torch.empty(crops, max(steps, 1), n, device=unit.device, dtype=torch.float32)
    picks = torch.empty(crops, steps, device=unit.device, dtype=torch.int64)
    if crops == 0 or steps == 0:
        return picks
    _dpp_greedy_kernel[(crops,)](
        source, quality, candidates, gains, floors, rows, picks,
        n, dim, steps, float(tolerance),
        source.stride(0), source.stride(1), source.stride(2),
        quality.stride(0), candidates.stride(0), gains.stride(0), rows.stride(0), rows.stride(1), picks.stride(0),
        FROM_FEATURES=from_features,
        BLOCK_N=min(256, triton.next_power_of_2(max(n, 16))),
        BLOCK_T=16,
        BLOCK_D=min(64, triton.next_power_of_2(max(dim, 16))),
        num_warps=4,
    )  # fmt: skip
    return picks


@torch.library.custom_op("vtoken::dpp_greedy", mutates_args=())
def dpp_greedy(
    unit: torch.Tensor, quality: torch.Tensor, candidates: torch.Tensor, steps: int, tolerance: float
) -> torch.Tensor:
    """Greedy DPP picks per crop, [C, steps] int64 (-1 past exhaustion): see `dpp_greedy_reference`. One Triton
    launch on CUDA (when triton is installed); the PyTorch reference elsewhere."""
    return dpp_greedy_reference(unit, quality, candidates, steps, tolerance)


@dpp_greedy.register_fake
def _dpp_greedy_fake(unit, quality, candidates, steps, tolerance):
    return unit.new_empty(quality.shape[0], steps, dtype=torch.int64)


register_cuda(dpp_greedy, dpp_greedy_triton, dpp_greedy_reference)
