"""DivPrune's greedy max-min diversity selection as one custom op, `vtoken::max_min_diversity`.

For every image b of a batch, its valid tokens x_1..x_L (L2-normalised in fp32) and D[i, j] = 1 - cos(x_i, x_j):
the first pick is argmax_j of the second-smallest entry of column j of D, each next pick argmax_j min over the
picks s of D[s, j] among the tokens not yet picked; the first index wins ties; a count of L or more keeps every
valid token. The op returns each image's picks in pick order (kept-all images: ascending), padded with L.

CPU (and any device without triton): `max_min_diversity_reference`, the PyTorch reference, one image at a time.
CUDA: `max_min_diversity_triton`, every image of the call in one launch of the greedy kernel (all k steps inside
it, one program per image), after one exact-fp32 Gram matrix (`gram_triton`) and one pass that finds every
column's second-smallest distance. A launch counter sees the op as one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import register_cuda
from .gram import gram_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

BLOCK = 1024  # columns of D per block when finding each token's nearest other token (reference)
MAX_BLOCK_L = 2048  # tokens per chunk of the greedy kernel's pass over an image


def nearest_other_distance(unit: torch.Tensor) -> torch.Tensor:
    """[L]: the second-smallest entry of every column of D = 1 - unit unit^T (each token's distance to its nearest
    other token; +inf when L < 2). unit [L, D] L2-normalised fp32; D is built BLOCK columns at a time."""
    length = unit.shape[0]
    if length < 2:
        return unit.new_full((length,), float("inf"))
    return torch.cat([(1 - unit @ unit[start : start + BLOCK].T).kthvalue(2, dim=0).values
                      for start in range(0, length, BLOCK)])  # fmt: skip


def greedy_picks(features: torch.Tensor, count: int) -> torch.Tensor:
    """DivPrune's greedy picks for one image, in pick order: [count] indices of its tokens `features` [L, D].
    (One image at a time: a batched matmul rounds an image's distances differently in different batches.)"""
    unit = F.normalize(features.float(), dim=-1)
    first = nearest_other_distance(unit).argmax()  # the first maximum
    picks = [first]
    blocked = torch.zeros(len(unit), dtype=torch.bool, device=unit.device)
    blocked[first] = True
    closest = 1 - unit @ unit[first]  # [L] distance to the nearest pick
    for _ in range(count - 1):
        pick = closest.masked_fill(blocked, float("-inf")).argmax()
        picks.append(pick)
        blocked[pick] = True
        closest = torch.minimum(closest, 1 - unit @ unit[pick])
    return torch.stack(picks)


def max_min_diversity_reference(
    features: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """features [B, L, D], valid [B, L] bool, counts [B] (picks per image, at most its valid tokens) -> [B, width]
    int64 picks in pick order, padded with L: the PyTorch reference, one image at a time."""
    batch, length = valid.shape
    picks = torch.full((batch, width), length, dtype=torch.long, device=features.device)
    for b, count in enumerate(counts.tolist()):
        index = valid[b].nonzero().squeeze(1)
        if count >= len(index):  # keep all
            picks[b, : len(index)] = index
        elif count:
            picks[b, :count] = index[greedy_picks(features[b, index], count)]
    return picks


if triton is not None:

    @triton.jit
    def _second_nearest_kernel(
        gram_ptr, valid_ptr, out_ptr, length, stride_gb, stride_gl, stride_vb, stride_ob, BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # per row i (= column i: the Gram matrix is exactly symmetric) the second-smallest 1 - G[i, j] over valid j,
        # with multiplicity (a distance seen twice is both the smallest and the second-smallest)
        b, block = tl.program_id(0).to(tl.int64), tl.program_id(1)  # 64-bit offsets into the batch's Gram matrices
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        smallest = tl.full([BLOCK_R], float("inf"), tl.float32)
        second = tl.full([BLOCK_R], float("inf"), tl.float32)
        for start in range(0, length, BLOCK_C):
            cols = start + tl.arange(0, BLOCK_C)
            ok = tl.load(valid_ptr + b * stride_vb + cols, mask=cols < length, other=0) != 0
            g = tl.load(gram_ptr + b * stride_gb + rows[:, None] * stride_gl + cols[None, :],
                        mask=(rows[:, None] < length) & ok[None, :], other=0.0)  # fmt: skip
            d = tl.where((rows[:, None] < length) & ok[None, :], 1 - g, float("inf"))
            low = tl.min(d, axis=1)
            seen = tl.sum((d == low[:, None]).to(tl.int32), axis=1)
            next_low = tl.min(tl.where(d == low[:, None], float("inf"), d), axis=1)
            low2 = tl.where(seen >= 2, low, next_low)
            second = tl.minimum(tl.maximum(smallest, low), tl.minimum(second, low2))
            smallest = tl.minimum(smallest, low)
        tl.store(out_ptr + b * stride_ob + rows, second, mask=rows < length)

    @triton.jit
    def _greedy_kernel(
        gram_ptr, valid_ptr, second_ptr, counts_ptr, picks_ptr, closest_ptr, length, stride_gb, stride_gl,
        stride_vb, stride_sb, stride_pb, stride_cb, BLOCK_L: tl.constexpr,
    ):  # fmt: skip
        # one program per image, all of its greedy steps: `closest` (distance to the nearest pick, -inf for picked
        # and invalid tokens) lives in a scratch row; each step reads one row of the Gram matrix
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets into the batch's Gram matrices
        count = tl.load(counts_ptr + b)
        valid_row, closest_row = valid_ptr + b * stride_vb, closest_ptr + b * stride_cb
        total = 0
        for start in range(0, length, BLOCK_L):
            cols = start + tl.arange(0, BLOCK_L)
            total += tl.sum((tl.load(valid_row + cols, mask=cols < length, other=0) != 0).to(tl.int32), axis=0)
        if count >= total:  # keep every valid token, ascending
            placed = 0
            for start in range(0, length, BLOCK_L):
                cols = start + tl.arange(0, BLOCK_L)
                ok = (tl.load(valid_row + cols, mask=cols < length, other=0) != 0).to(tl.int32)
                where = placed + tl.cumsum(ok, axis=0) - 1
                tl.store(picks_ptr + b * stride_pb + where, cols.to(tl.int64), mask=ok != 0)
                placed += tl.sum(ok, axis=0)
        elif count > 0:
            # first pick: the largest distance to the nearest other token (the first on ties)
            best = float("-inf")
            pick = 0
            for start in range(0, length, BLOCK_L):
                cols = start + tl.arange(0, BLOCK_L)
                ok = tl.load(valid_row + cols, mask=cols < length, other=0) != 0
                s = tl.load(second_ptr + b * stride_sb + cols, mask=ok, other=float("-inf"))
                s = tl.where(ok, s, float("-inf"))
                high = tl.max(s, axis=0)
                at = start + tl.argmax(s, axis=0, tie_break_left=True)
                pick = tl.where(high > best, at, pick)
                best = tl.maximum(best, high)
            for step in range(0, count):
                tl.store(picks_ptr + b * stride_pb + step, pick.to(tl.int64))
                gram_row = gram_ptr + b * stride_gb + pick * stride_gl
                best = float("-inf")
                following = 0
                for start in range(0, length, BLOCK_L):
                    cols = start + tl.arange(0, BLOCK_L)
                    inside = cols < length
                    ok = tl.load(valid_row + cols, mask=inside, other=0) != 0
                    before = tl.load(closest_row + cols, mask=inside, other=float("-inf"))
                    before = tl.where(step == 0, tl.where(ok, float("inf"), float("-inf")), before)
                    g = tl.load(gram_row + cols, mask=inside, other=0.0)
                    now = tl.minimum(before, 1 - g)
                    now = tl.where((cols == pick) | ~inside, float("-inf"), now)
                    tl.store(closest_row + cols, now, mask=inside)
                    high = tl.max(now, axis=0)
                    at = start + tl.argmax(now, axis=0, tie_break_left=True)
                    following = tl.where(high > best, at, following)
                    best = tl.maximum(best, high)
                pick = following


def max_min_diversity_triton(
    features: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, width: int
) -> torch.Tensor:
    """`max_min_diversity_reference`'s signature and picks, computed by the Triton kernels (CUDA, or CPU under
    TRITON_INTERPRET=1): every image of the batch in one launch."""
    if triton is None:
        raise RuntimeError("max_min_diversity_triton needs triton (pip install 'vtoken[kernels]')")
    batch, length = valid.shape
    picks = torch.full((batch, width), length, dtype=torch.long, device=features.device)
    if batch == 0 or length == 0 or width == 0:
        return picks
    valid = valid.to(torch.int8).contiguous()
    unit = F.normalize(features.float(), dim=-1)
    gram = gram_triton(unit)
    second = torch.empty(batch, length, device=features.device, dtype=torch.float32)
    block_r, block_c = 16, min(triton.next_power_of_2(length), 256, MAX_BLOCK_L)
    _second_nearest_kernel[(batch, triton.cdiv(length, block_r))](
        gram, valid, second, length, gram.stride(0), gram.stride(1), valid.stride(0), second.stride(0),
        BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip
    closest = torch.empty(batch, length, device=features.device, dtype=torch.float32)
    counts = counts.to(device=features.device, dtype=torch.int32).contiguous()
    _greedy_kernel[(batch,)](
        gram, valid, second, counts, picks, closest, length, gram.stride(0), gram.stride(1), valid.stride(0),
        second.stride(0), picks.stride(0), closest.stride(0), BLOCK_L=min(triton.next_power_of_2(length), MAX_BLOCK_L),
        num_warps=8,
    )  # fmt: skip
    return picks


@torch.library.custom_op("vtoken::max_min_diversity", mutates_args=())
def max_min_diversity(features: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """DivPrune's picks for every image of a batch (see the module): features [B, L, D], valid [B, L] bool, counts
    [B] int64 (at most each image's valid tokens) -> [B, width] int64 in pick order, padded with L."""
    return max_min_diversity_reference(features, valid, counts, width)


@max_min_diversity.register_fake
def _(features: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    return features.new_empty(valid.shape[0], width, dtype=torch.long)


# the reference reads each image's count back and runs its greedy steps one launch burst at a time
register_cuda(max_min_diversity, max_min_diversity_triton, max_min_diversity_reference, host_loop=True)
