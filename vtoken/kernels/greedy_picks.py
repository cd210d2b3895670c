"""A greedy of pivots over a shrinking pool, as one custom op (`vtoken::greedy_least_similar`): DART's picks.

Each row visits its pivots in order; pivot p takes the `takes[b, p]` pool tokens least similar to it (ties: the lower
index first, as a stable sort), and they leave the pool. A Python loop of sorts launches a handful of kernels per
pivot; this is one launch on CUDA (one program per row, the row's similarities in registers), and the PyTorch
reference elsewhere, which is also its definition.
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def greedy_least_similar_reference(similarity: torch.Tensor, pool: torch.Tensor, takes: torch.Tensor) -> torch.Tensor:
    """similarity: [B, P, V] float (pivot p of row b against its V tokens, in visiting order); pool: [B, V] bool,
    the tokens the pivots pick from; takes: [B, P] int64, how many pivot p takes (at most what the pool has left).
    Returns [B, V] bool, every token some pivot took."""
    batch, steps, length = similarity.shape
    kept = torch.zeros(batch, length + 1, dtype=torch.bool, device=similarity.device)
    pool = pool.clone()
    rank = torch.arange(length, device=similarity.device)
    for step in range(steps):
        order = torch.sort(similarity[:, step].masked_fill(~pool, float("inf")), dim=1, stable=True).indices
        picks = order.masked_fill(rank >= takes[:, step, None], length)
        chosen = torch.zeros_like(kept).scatter_(1, picks, True)[:, :length]
        kept[:, :length] |= chosen
        pool &= ~chosen
    return kept[:, :length]


if triton is not None:

    @triton.jit
    def _greedy_kernel(
        sim_ptr, pool_ptr, takes_ptr, out_ptr, steps, length,
        stride_sb, stride_sp, stride_pb, stride_tb, stride_ob,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # one program per row: the minimum of the pool's similarities, `take` times per pivot
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_V)
        inside = offs < length
        pool = tl.load(pool_ptr + b * stride_pb + offs, mask=inside, other=0) != 0
        kept = tl.zeros([BLOCK_V], tl.int32)
        for p in range(0, steps):
            take = tl.load(takes_ptr + b * stride_tb + p)
            s = tl.load(sim_ptr + b * stride_sb + p * stride_sp + offs, mask=inside, other=float("inf"))
            s = tl.where(pool & (kept == 0), s.to(tl.float32), float("inf"))
            for _ in range(0, take):
                low = tl.min(s, axis=0)
                first = tl.min(tl.where(s == low, offs, BLOCK_V), axis=0)  # ties: the lower index
                chosen = offs == first  # takes never exceed what the pool holds: the minimum is a pool token's
                kept = tl.where(chosen, 1, kept)
                s = tl.where(chosen, float("inf"), s)
        tl.store(out_ptr + b * stride_ob + offs, kept.to(tl.int8), mask=inside)


def greedy_least_similar_triton(similarity: torch.Tensor, pool: torch.Tensor, takes: torch.Tensor) -> torch.Tensor:
    """Triton version of `greedy_least_similar_reference` (same signature and result)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, steps, length = similarity.shape
    pool = pool.to(torch.int8).contiguous()
    takes = takes.to(torch.int64).contiguous()
    similarity = similarity if similarity.stride(-1) == 1 else similarity.contiguous()
    out = torch.zeros(batch, length, dtype=torch.int8, device=similarity.device)
    if out.numel() == 0 or steps == 0:
        return out.bool()
    _greedy_kernel[(batch,)](
        similarity, pool, takes, out, steps, length,
        similarity.stride(0), similarity.stride(1), pool.stride(0), takes.stride(0), out.stride(0),
        BLOCK_V=triton.next_power_of_2(length),
    )  # fmt: skip
    return out.bool()


@torch.library.custom_op("vtoken::greedy_least_similar", mutates_args=())
def greedy_least_similar(similarity: torch.Tensor, pool: torch.Tensor, takes: torch.Tensor) -> torch.Tensor:
    """The pivots' greedy picks (see `greedy_least_similar_reference`); one op: Triton on CUDA, the reference
    elsewhere."""
    return greedy_least_similar_reference(similarity, pool, takes)


@greedy_least_similar.register_fake
def _(similarity, pool, takes):
    return pool.new_empty(pool.shape, dtype=torch.bool)


register_cuda(greedy_least_similar, greedy_least_similar_triton, greedy_least_similar_reference)
