"""How much attention each token receives: the mean over heads and query rows of a self-attention's softmax map.

HoliTom scores a frame's tokens by its vision tower's last-layer attention, averaged over heads and then over
queries (one value per key). The tower itself keeps running SDPA/flash; this recomputes only the column means
from the layer's hooked queries and keys, without the [B, H, S, S] map in memory: a Triton kernel on CUDA (two
passes per block of query rows: the rows' softmax normalisers, then their probabilities summed per key), the
PyTorch reference elsewhere. `attention_column_mean` is the custom op `vtoken::attention_column_mean` (one launch;
`meta` tensors and `torch.compile` see its shape through `register_fake`).
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def attention_column_mean_reference(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """query, keys: [B, S, H, d] (rotary applied, the layout q/k projections give reshaped); returns [B, S] float32:
    for each key j, the mean over heads h and query rows i of softmax_j(scale * q_i . k_j).

    One item at a time: a batched matmul rounds an item differently for different batch sizes, and a score that
    depends on the batch would break "a padded batch equals its rows alone"."""
    out = torch.empty(query.shape[0], query.shape[1], device=query.device, dtype=torch.float32)
    for b in range(query.shape[0]):
        q, k = query[b].float().transpose(0, 1), keys[b].float().transpose(0, 1)  # [H, S, d]
        probs = (torch.matmul(q, k.transpose(1, 2)) * scale).softmax(dim=-1)  # [H, S(query), S(key)]
        out[b] = probs.mean(dim=(0, 1))
    return out


if triton is not None:

    @triton.jit
    def _column_sums_kernel(
        q_ptr, k_ptr, part_ptr,
        seq_len, head_dim, heads, blocks,
        stride_qb, stride_qs, stride_qh,
        stride_kb, stride_ks, stride_kh,
        scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # one program per (item, head, block of query rows): the rows' running max and sum over every key block,
        # then each key block's probabilities summed over the rows, written to this program's slot of `part`
        b, h, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        rows = offs_m < seq_len
        q = tl.load(q_ptr + b * stride_qb + offs_m[:, None] * stride_qs + h * stride_qh + offs_d[None, :],
                    mask=rows[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
        k_base = k_ptr + b * stride_kb + h * stride_kh
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                        mask=(offs_n[:, None] < seq_len) & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
            if IEEE:
                logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                logits = tl.dot(q, tl.trans(k)) * scale
            logits = tl.where(offs_n[None, :] < seq_len, logits, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), 1)
            running_max = new_max
        out = part_ptr + ((b * heads + h) * blocks + m) * seq_len
        for start in range(0, seq_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                        mask=(offs_n[:, None] < seq_len) & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
            if IEEE:
                logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                logits = tl.dot(q, tl.trans(k)) * scale
            probs = tl.exp(logits - running_max[:, None]) / running_sum[:, None]
            probs = tl.where(rows[:, None] & (offs_n[None, :] < seq_len), probs, 0.0)
            tl.store(out + offs_n, tl.sum(probs, axis=0), mask=offs_n < seq_len)


def attention_column_mean_triton(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton version of `attention_column_mean_reference` (same signature and result; per-block partial sums
    added up afterwards in a fixed order, so a run repeats bit for bit)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, seq_len, heads, head_dim = query.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    block_m, block_n = 64, 64
    blocks = triton.cdiv(seq_len, block_m)
    part = torch.empty(batch, heads * blocks, seq_len, device=query.device, dtype=torch.float32)
    _column_sums_kernel[(batch, heads, blocks)](
        query, keys, part,
        seq_len, head_dim, heads, blocks,
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        float(scale),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=query.dtype == torch.float32,
    )  # fmt: skip
    return part.sum(1) / (heads * seq_len)


@torch.library.custom_op("vtoken::attention_column_mean", mutates_args=())
def attention_column_mean(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, S] mean attention each key receives (see `attention_column_mean_reference`): the reference here, the
    Triton kernel for CUDA tensors."""
    return attention_column_mean_reference(query, keys, scale)


@attention_column_mean.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1], dtype=torch.float32)


register_cuda(attention_column_mean, attention_column_mean_triton, attention_column_mean_reference)
