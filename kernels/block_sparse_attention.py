"""Block-sparse causal attention (prefill), flash-style: only the key blocks a plan lists are read.

A plan gives, per (batch, head, query block), how many key blocks to visit (`block_counts` [B, H, Qb]) and which
(`block_index` [B, H, Qb, K]; entries past a count are never read, so they may hold anything). Inside the visited
blocks the mask is exact, element by element: causal (key j <= query i), key padding (`key_valid` [B, S]) and an
optional local limit (`window` > 0: j < `sink` or i - j < `window`, the A-shape). A query row that sees no key
gives 0. q is [B, H, S, d], k/v are [B, Hkv, S, d] with H a multiple of Hkv (grouped-query attention: head h reads
kv head h // (H / Hkv), as `repeat_kv` groups them); fp16/bf16/fp32 in, fp32 accumulation, output in q's dtype.

`block_sparse_attention` dispatches to the Triton kernel on CUDA and to the PyTorch reference elsewhere; both
have one signature and are tested against each other (on CPU through `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def block_mask_from_plan(block_counts: torch.Tensor, block_index: torch.Tensor, num_key_blocks: int) -> torch.Tensor:
    """[B, H, Qb, Kb] bool: the key blocks each query block visits (only the first `count` indices are read)."""
    listed = torch.arange(block_index.shape[-1], device=block_index.device) < block_counts[..., None].long()
    index = torch.where(listed, block_index.long(), num_key_blocks)  # unread entries go to a spare column
    mask = torch.zeros(*block_index.shape[:-1], num_key_blocks + 1, dtype=torch.bool, device=block_index.device)
    return mask.scatter_(-1, index.clamp(0, num_key_blocks), True)[..., :num_key_blocks]


def element_mask(
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    seq_len: int,
    key_valid: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """[B, H, S, S] bool: which (query, key) pairs a plan computes, with the causal, padding and local limits."""
    num_blocks = -(-seq_len // block_size)
    blocks = block_mask_from_plan(block_counts, block_index, num_blocks)
    seen = blocks.repeat_interleave(block_size, 2).repeat_interleave(block_size, 3)[:, :, :seq_len, :seq_len]
    pos = torch.arange(seq_len, device=block_index.device)
    allowed = pos[None, :] <= pos[:, None]
    if window > 0:
        allowed = allowed & ((pos[None, :] < sink) | (pos[:, None] - pos[None, :] < window))
    seen = seen & allowed
    if key_valid is not None:
        seen = seen & key_valid.bool()[:, None, None, :]
    return seen


def block_sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Dense PyTorch reference: the plan expanded to a [B, H, S, S] mask, softmax in fp32. Returns [B, H, S, d]."""
    heads, kv_heads, seq_len = q.shape[1], k.shape[1], q.shape[2]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    seen = element_mask(block_counts, block_index, block_size, seq_len, key_valid, sink, window)
    logits = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    probs = logits.masked_fill(~seen, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v).to(q.dtype)


if triton is not None:

    @triton.jit
    def _block_sparse_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, counts_ptr, index_ptr, valid_ptr,
        seq_len, head_dim, heads, group, num_query_blocks, sink, window, scale,
        stride_qb, stride_qh, stride_qs,
        stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os,
        stride_cb, stride_ch,
        stride_ib, stride_ih, stride_iq,
        stride_valid,
        HAS_VALID: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # one program per (query block, batch x head); the longest (last) query blocks are launched first
        qblock = num_query_blocks - 1 - tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh // heads, bh % heads
        kvh = h // group
        offs_m = qblock * BLOCK + tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=(offs_m < seq_len)[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        count = tl.load(counts_ptr + b * stride_cb + h * stride_ch + qblock)
        index_row = index_ptr + b * stride_ib + h * stride_ih + qblock * stride_iq
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
        for t in range(0, count):
            kblock = tl.load(index_row + t)
            for sub in tl.static_range(BLOCK // BLOCK_N):  # key tiles of BLOCK_N <= 64 keep registers in bounds
                k_start = kblock * BLOCK + sub * BLOCK_N
                offs_k = k_start + offs_n
                in_seq = offs_k < seq_len
                k = tl.load(k_base + offs_k[:, None] * stride_ks + offs_d[None, :],
                            mask=in_seq[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                # element masks only where they can bite: tiles crossing the diagonal or the end, padding, A-shape
                below = k_start + BLOCK_N - 1 <= qblock * BLOCK
                if HAS_VALID or (window > 0) or (not below) or (k_start + BLOCK_N > seq_len):
                    allowed = (offs_k[None, :] <= offs_m[:, None]) & in_seq[None, :]
                    local = (offs_k[None, :] < sink) | (offs_m[:, None] - offs_k[None, :] < window)
                    allowed = allowed & ((window <= 0) | local)
                    if HAS_VALID:
                        valid = tl.load(valid_ptr + b * stride_valid + offs_k, mask=in_seq, other=0) != 0
                        allowed = allowed & valid[None, :]
                    s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + offs_k[:, None] * stride_vs + offs_d[None, :],
                            mask=in_seq[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key: acc is 0
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(offs_m < seq_len)[:, None] & d_ok[None, :])  # fmt: skip


def block_sparse_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Triton version of `block_sparse_attention_reference` (same signature and result).

    `block_size` must be a power of two >= 16: the query tile, and the key tile up to 64 (larger key blocks are
    read in tiles of 64, which keeps a 128 x 128 block from spilling registers)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}; the Triton kernel needs a power of two >= 16")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    counts = block_counts.to(torch.int32)
    index = block_index.to(torch.int32)
    if index.stride(-1) != 1:
        index = index.contiguous()
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else counts  # unused when absent
    out = torch.empty_like(q)
    num_query_blocks = triton.cdiv(seq_len, block_size)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _block_sparse_kernel[(num_query_blocks, batch * heads)](
        q, k, v, out, counts, index, valid,
        seq_len, head_dim, heads, heads // kv_heads, num_query_blocks, int(sink), int(window), float(scale),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        counts.stride(0), counts.stride(1),
        index.stride(0), index.stride(1), index.stride(2),
        valid.stride(0) if key_valid is not None else 0,
        HAS_VALID=key_valid is not None,
        BLOCK=block_size,
        BLOCK_N=min(block_size, 64),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION=precision,
        num_warps=4 if block_size <= 64 else 8,
        num_stages=2,
    )  # fmt: skip
    return out


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Dispatching entry point: Triton on CUDA, the PyTorch reference elsewhere."""
    if q.is_cuda and triton is not None:
        return block_sparse_attention_triton(q, k, v, block_counts, block_index, block_size, scale, key_valid,
                                             sink, window)  # fmt: skip
    return block_sparse_attention_reference(q, k, v, block_counts, block_index, block_size, scale, key_valid,
                                            sink, window)  # fmt: skip
