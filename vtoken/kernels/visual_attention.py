"""The attention statistic an LLM-stage drop scores visual tokens with, as one custom op (`vtoken::visual_attention`).

For R query rows of a decoder layer (FastV's last token, SparseVLM's raters, MustDrop's text tokens), the causal
post-softmax attention to V chosen key slots (the visual tokens), mean over heads, normalised over every key the row
sees: [B, R, V] float32. The layer itself keeps running SDPA/flash; this reads its queries (rows only, rotary
applied) and keys again, in O(R * S * d) per head, without the [S, S] map. On CUDA it is two Triton launches (the
rows' softmax normalisers, then the visual columns summed over heads, deterministic: no atomics); on every other
device the PyTorch reference, which is also its definition.
"""

from __future__ import annotations

import torch

from .attention_rows import causal_rows_probs_reference
from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def visual_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Head-mean causal attention of R query rows to V key slots.

    query: [B, H, R, d] rotary applied; keys: [B, Hkv, S, d] rotary applied (head h reads kv head h // (H / Hkv));
    rows: [B, R] each row's sequence index (it sees keys 0..rows[b, r]; -1: no row); key_valid: [B, S] bool (False:
    padding); visual: [B, V] key slots (-1: none). Returns [B, R, V] float32, 0 for a missing row or slot.
    """
    probs = causal_rows_probs_reference(query, keys, rows.clamp(min=0), key_valid, scale).mean(dim=1)  # [B, R, S]
    taken = probs.gather(2, visual.clamp(min=0)[:, None, :].expand(-1, probs.shape[1], -1))
    return taken * (rows >= 0)[:, :, None] * (visual >= 0)[:, None, :]


if triton is not None:

    @triton.jit
    def _normalisers_kernel(
        q_ptr, k_ptr, rows_ptr, valid_ptr, max_ptr, sum_ptr,
        seq_len, head_dim, group, heads, num_rows,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_rb, stride_vb,
        scale,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, head, row): the running max and sum of exp over the keys the row sees
        b, h, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + r * stride_qr + offs_d, mask=offs_d < head_dim,
                    other=0.0).to(tl.float32)  # fmt: skip
        last = tl.load(rows_ptr + b * stride_rb + r)
        k_row = k_ptr + b * stride_kb + (h // group) * stride_kh
        running_max = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
        for start in range(0, seq_len, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            in_seq = offs_s < seq_len
            valid = tl.load(valid_ptr + b * stride_vb + offs_s, mask=in_seq, other=0) != 0
            seen = in_seq & valid & (offs_s <= last)
            k = tl.load(k_row + offs_s[:, None] * stride_ks + offs_d[None, :],
                        mask=in_seq[:, None] & (offs_d[None, :] < head_dim), other=0.0).to(tl.float32)  # fmt: skip
            logits = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, axis=0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(logits - safe_max), axis=0)
            running_max = new_max
        index = (b * heads + h) * num_rows + r
        tl.store(max_ptr + index, tl.where(running_max == float("-inf"), 0.0, running_max))
        tl.store(sum_ptr + index, running_sum)

    @triton.jit
    def _visual_columns_kernel(
        q_ptr, k_ptr, rows_ptr, valid_ptr, visual_ptr, max_ptr, sum_ptr, out_ptr,
        num_visual, head_dim, group, heads, num_rows,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_rb, stride_vb, stride_xb,
        stride_ob, stride_or,
        scale,
        BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, row, block of visual slots): each head's probability there, summed, / heads
        b, r, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_v = block * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_d = tl.arange(0, BLOCK_D)
        in_range = offs_v < num_visual
        slots = tl.load(visual_ptr + b * stride_xb + offs_v, mask=in_range, other=-1)
        last = tl.load(rows_ptr + b * stride_rb + r)
        safe = tl.where(slots >= 0, slots, 0)
        valid = tl.load(valid_ptr + b * stride_vb + safe, mask=in_range, other=0) != 0
        seen = in_range & (slots >= 0) & valid & (slots <= last) & (last >= 0)
        total = tl.zeros([BLOCK_V], tl.float32)
        for h in range(0, heads):
            q = tl.load(q_ptr + b * stride_qb + h * stride_qh + r * stride_qr + offs_d, mask=offs_d < head_dim,
                        other=0.0).to(tl.float32)  # fmt: skip
            k = tl.load(k_ptr + b * stride_kb + (h // group) * stride_kh + safe[:, None] * stride_ks + offs_d[None, :],
                        mask=seen[:, None] & (offs_d[None, :] < head_dim), other=0.0).to(tl.float32)  # fmt: skip
            index = (b * heads + h) * num_rows + r
            row_max, row_sum = tl.load(max_ptr + index), tl.load(sum_ptr + index)
            logits = tl.sum(k * q[None, :], axis=1) * scale
            probs = tl.exp(logits - row_max) / tl.where(row_sum > 0, row_sum, 1.0)
            total += tl.where(seen, probs, 0.0)
        tl.store(out_ptr + b * stride_ob + r * stride_or + offs_v, total / heads, mask=in_range)


def visual_attention_triton(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `visual_attention_reference` (same signature and result, to rounding)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, heads, num_rows, head_dim = query.shape
    kv_heads, seq_len = keys.shape[1], keys.shape[2]
    num_visual = visual.shape[1]
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    rows = rows.to(torch.int64).contiguous()
    key_valid = key_valid.to(torch.int8).contiguous()
    visual = visual.to(torch.int64).contiguous()
    out = torch.empty(batch, num_rows, num_visual, device=query.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    row_max = torch.empty(batch, heads, num_rows, device=query.device, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    block_d = triton.next_power_of_2(head_dim)
    common = (head_dim, heads // kv_heads, heads, num_rows, query.stride(0), query.stride(1), query.stride(2),
              keys.stride(0), keys.stride(1), keys.stride(2), rows.stride(0), key_valid.stride(0))  # fmt: skip
    _normalisers_kernel[(batch, heads, num_rows)](
        query, keys, rows, key_valid, row_max, row_sum, seq_len, *common, float(scale), BLOCK_S=64, BLOCK_D=block_d
    )
    block_v = 64
    _visual_columns_kernel[(batch, num_rows, triton.cdiv(num_visual, block_v))](
        query, keys, rows, key_valid, visual, row_max, row_sum, out, num_visual, *common, visual.stride(0),
        out.stride(0), out.stride(1), float(scale), BLOCK_V=block_v, BLOCK_D=block_d,
    )  # fmt: skip
    return out


@torch.library.custom_op("vtoken::visual_attention", mutates_args=())
def visual_attention(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Head-mean causal attention of query rows to visual key slots (see `visual_attention_reference`); one op:
    Triton on CUDA, the reference elsewhere."""
    return visual_attention_reference(query, keys, rows, key_valid, visual, scale)


@visual_attention.register_fake
def _(query, keys, rows, key_valid, visual, scale):
    return query.new_empty(query.shape[0], query.shape[2], visual.shape[1], dtype=torch.float32)


register_cuda(visual_attention, visual_attention_triton, visual_attention_reference)
