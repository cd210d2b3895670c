"""VisPruner's duplicate removal as one custom op, `vtoken::duplicate_removal`.

For every crop b, its L2-normalised features, a residual list of token indices (in attention order) and a count to
keep: while r = min(8, len - keep) > 0, a = residual[0::2], b = residual[1::2], s_a = max over b of cos(a, b); the
min(r, |a|) a-tokens with the highest s_a go (ties: the earlier a first); the residual becomes the remaining a in
descending-s_a order, then all of b. The op returns each crop's final residual (exactly `keep` tokens), padded with
N.

CPU (and any device without triton): `duplicate_removal_reference`, the PyTorch reference, one crop at a time.
CUDA: `duplicate_removal_triton`, every crop in one launch (one program per crop running all of its rounds) after
one exact-fp32 Gram matrix of the crops' features (`gram_triton`): a round reads the cosines it needs from it.
A launch counter sees the op as one launch.
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

ROUND = 8  # a-tokens dropped per round, at most
MAX_BLOCK = 64  # list entries per chunk of the kernel's passes


def deduplicate(unit: torch.Tensor, residual: torch.Tensor, keep: int) -> torch.Tensor:
    """VisPruner's iterative matching for one crop: residual token indices [R] (in attention order) -> [keep]
    after dropping near-duplicates; `unit` [N, D] the crop's L2-normalised features. (One crop at a time: a
    batched matmul rounds a crop's cosines differently in different batches, which would flip near-ties.)"""
    while keep > 0:
        step = min(ROUND, len(residual) - keep)
        if step <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        similarity = (unit[a] @ unit[b].T).amax(-1)  # [|a|]
        order = similarity.argsort(descending=True, stable=True)[step:]  # the a-tokens that stay
        residual = torch.cat([a[order], b])
    return residual


def duplicate_removal_reference(
    features: torch.Tensor, residual: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, width: int
) -> torch.Tensor:
    """features [B, N, D], residual [B, N] int64 (each crop's first lengths[b] entries are its list), keep [B] (at
    most lengths[b]) -> [B, width] int64 residual after duplicate removal, padded with N: one crop at a time."""
    batch, n = features.shape[:2]
    out = torch.full((batch, width), n, dtype=torch.long, device=features.device)
    for b, (length, count) in enumerate(zip(lengths.tolist(), keep.tolist(), strict=True)):
        if count > 0:
            unit = F.normalize(features[b].float(), dim=-1)
            out[b, :count] = deduplicate(unit, residual[b, :length], count)
    return out


if triton is not None:

    @triton.jit
    def _dedup_kernel(
        gram_ptr, residual_ptr, lengths_ptr, keep_ptr, out_ptr, lists_ptr, sim_ptr, n, stride_gb, stride_gn,
        stride_rb, stride_ob, ROUND: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # one program per crop, every round: the list ping-pongs between two scratch rows of n entries
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets into the batch's Gram matrices
        length = tl.load(lengths_ptr + b)
        keep = tl.load(keep_ptr + b)
        lists = lists_ptr + b * 2 * n
        sim = sim_ptr + b * n
        gram = gram_ptr + b * stride_gb
        for start in range(0, length, BLOCK):
            i = start + tl.arange(0, BLOCK)
            tl.store(lists + i, tl.load(residual_ptr + b * stride_rb + i, mask=i < length), mask=i < length)
        tl.debug_barrier()
        current = 0  # which scratch row holds the list
        step = tl.minimum(ROUND, length - keep)
        step = tl.where(keep > 0, step, 0)
        while step > 0:
            src = lists + current * n
            dst = lists + (1 - current) * n
            na = (length + 1) // 2
            nb = length // 2
            for start in range(0, na, BLOCK):  # s_a = max over b of cos(a, b)
                i = start + tl.arange(0, BLOCK)
                a = tl.load(src + 2 * i, mask=i < na, other=0)
                high = tl.full([BLOCK], float("-inf"), tl.float32)
                for other in range(0, nb, BLOCK):
                    j = other + tl.arange(0, BLOCK)
                    bj = tl.load(src + 2 * j + 1, mask=j < nb, other=0)
                    s = tl.load(gram + a[:, None] * stride_gn + bj[None, :], mask=(i[:, None] < na) & (j[None, :] < nb),
                                other=float("-inf"))  # fmt: skip
                    high = tl.maximum(high, tl.max(s, axis=1))
                tl.store(sim + i, high, mask=i < na)
            tl.debug_barrier()
            for start in range(0, na, BLOCK):  # rank by (s_a descending, position): the first `step` go
                i = start + tl.arange(0, BLOCK)
                mine = tl.load(sim + i, mask=i < na, other=0.0)
                rank = tl.zeros([BLOCK], dtype=tl.int32)
                for other in range(0, na, BLOCK):
                    j = other + tl.arange(0, BLOCK)
                    theirs = tl.load(sim + j, mask=j < na, other=float("-inf"))
                    ahead = (theirs[None, :] > mine[:, None]) | (
                        (theirs[None, :] == mine[:, None]) & (j[None, :] < i[:, None])
                    )
                    rank += tl.sum((ahead & (j[None, :] < na)).to(tl.int32), axis=1)
                a = tl.load(src + 2 * i, mask=i < na, other=0)
                tl.store(dst + rank - step, a, mask=(i < na) & (rank >= step))
            first_b = tl.maximum(na - step, 0)
            for start in range(0, nb, BLOCK):
                j = start + tl.arange(0, BLOCK)
                tl.store(dst + first_b + j, tl.load(src + 2 * j + 1, mask=j < nb), mask=j < nb)
            tl.debug_barrier()
            length = first_b + nb
            current = 1 - current
            step = tl.minimum(ROUND, length - keep)
        src = lists + current * n
        for start in range(0, keep, BLOCK):
            i = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + b * stride_ob + i, tl.load(src + i, mask=i < keep), mask=i < keep)


def duplicate_removal_triton(
    features: torch.Tensor, residual: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, width: int
) -> torch.Tensor:
    """`duplicate_removal_reference`'s signature and result, every crop in one launch of the Triton kernel (CUDA, or
    CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("duplicate_removal_triton needs triton (pip install 'vtoken[kernels]')")
    batch, n = features.shape[:2]
    out = torch.full((batch, width), n, dtype=torch.long, device=features.device)
    if batch == 0 or n == 0 or width == 0:
        return out
    gram = gram_triton(F.normalize(features.float(), dim=-1))
    residual = residual.to(device=features.device, dtype=torch.int64).contiguous()
    lists = torch.empty(batch, 2, n, device=features.device, dtype=torch.int64)
    sim = torch.empty(batch, n, device=features.device, dtype=torch.float32)
    lengths = lengths.to(device=features.device, dtype=torch.int32).contiguous()
    keep = keep.to(device=features.device, dtype=torch.int32).contiguous()
    _dedup_kernel[(batch,)](
        gram, residual, lengths, keep, out, lists, sim, n, gram.stride(0), gram.stride(1), residual.stride(0),
        out.stride(0), ROUND=ROUND, BLOCK=min(triton.next_power_of_2(n), MAX_BLOCK), num_warps=4,
    )  # fmt: skip
    return out


@torch.library.custom_op("vtoken::duplicate_removal", mutates_args=())
def duplicate_removal(
    features: torch.Tensor, residual: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, width: int
) -> torch.Tensor:
    """VisPruner's duplicate removal for every crop of a batch (see the module): features [B, N, D], residual [B, N]
    int64 (attention order, the first lengths[b] real), keep [B] -> [B, width] int64 kept residual, padded with N."""
    return duplicate_removal_reference(features, residual, lengths, keep, width)


@duplicate_removal.register_fake
def _(features, residual, lengths, keep, width):  # noqa: ANN001, ANN202
    return features.new_empty(features.shape[0], width, dtype=torch.long)


# the reference reads each crop's counts back and deduplicates crop by crop
register_cuda(duplicate_removal, duplicate_removal_triton, duplicate_removal_reference, host_loop=True)
