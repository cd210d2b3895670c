"""The vertical-slash estimate of sparse prefill: how much attention the last query rows pay along each key column
(vertical lines) and along each diagonal (slashes), from their causal softmax.

`line_sums(q_rows, keys, rows, key_valid, scale)` -> (vertical [B, H, S], slash [B, H, S]) float32: vertical[j] is
the mean over the R rows of the probability row r gives key j; slash[o] the mean probability row r gives the key
`o` positions before it (key rows[r] - o). The reference materialises the rows' probabilities with
`causal_rows_probs_reference` and sums them; the Triton path (CUDA) computes the rows' logits as tensor-core tiles
(rows x keys, so K is read twice per head instead of once per row), keeps only each row's log-sum-exp between its two
passes, writes the probabilities once with the column sums fused in, and reads them back once along the diagonals.
Three launches and no host sync, against a Python loop over the rows before (issue 32).
"""

from __future__ import annotations

import torch

from .attention_rows import causal_rows_probs_reference
from .dispatch import warn_missing

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

LOG2E = 1.4426950408889634
CHUNK = 4096  # keys per program of the log-sum-exp pass (programs = heads x chunks)


def line_sums_reference(
    q_rows: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rows [B, H, R, d] (rotary applied); keys [B, Hkv, S, d]; rows [B, R] the rows' positions; key_valid [B, S]
    bool. Returns vertical, slash [B, H, S] float32."""
    probs = causal_rows_probs_reference(q_rows, keys, rows, key_valid, scale)  # [B, H, R, S]
    count, seq = rows.shape[1], keys.shape[2]
    vertical = probs.sum(2) / count
    key = rows[:, :, None] - torch.arange(seq, device=rows.device)  # [B, R, S]: the key at offset o of row r
    on_diagonal = probs.gather(-1, key.clamp(min=0)[:, None].expand_as(probs))
    slash = on_diagonal.masked_fill((key < 0)[:, None], 0.0).sum(2) / count
    return vertical, slash


if triton is not None:

    @triton.jit
    def _rows_logits(q, k_base, offs_k, offs_d, rows, valid_row, seq_len, head_dim, stride_ks, scale,
                     PRECISION: tl.constexpr):  # fmt: skip
        """[R, N] logits (log2 units) of the rows against keys offs_k, -inf where a row may not see the key."""
        in_seq = offs_k < seq_len
        k = tl.load(k_base + offs_k[:, None] * stride_ks + offs_d[None, :],
                    mask=in_seq[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = tl.load(valid_row + offs_k, mask=in_seq, other=0) != 0
        seen = (offs_k[None, :] <= rows[:, None]) & (in_seq & valid)[None, :]
        return tl.where(seen, s, float("-inf"))

    @triton.jit
    def _rows_lse_kernel(
        q_ptr, k_ptr, rows_ptr, valid_ptr, max_ptr, sum_ptr,
        seq_len, head_dim, num_rows, heads, group, scale,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_rb, stride_vb,
        stride_mb, stride_mh, stride_mc,
        CHUNK_KEYS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch x head, chunk of keys): each row's running max and sum over the chunk
        bh, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        r_ok = offs_r < num_rows
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_r[:, None] * stride_qr + offs_d[None, :],
                    mask=r_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
        rows = tl.load(rows_ptr + b * stride_rb + offs_r, mask=r_ok, other=-1)
        k_base = k_ptr + b * stride_kb + (h // group) * stride_kh
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        for start in range(chunk * CHUNK_KEYS, tl.minimum(chunk * CHUNK_KEYS + CHUNK_KEYS, seq_len), BLOCK_N):
            offs_k = start + tl.arange(0, BLOCK_N)
            s = _rows_logits(q, k_base, offs_k, offs_d, rows, valid_ptr + b * stride_vb, seq_len, head_dim, stride_ks,
                             scale, PRECISION)  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.sum(tl.math.exp2(s - m_safe[:, None]), axis=1)
            m_i = m_new
        out = b * stride_mb + h * stride_mh + chunk * stride_mc + offs_r
        tl.store(max_ptr + out, m_i, mask=r_ok)
        tl.store(sum_ptr + out, l_i, mask=r_ok)

    @triton.jit
    def _rows_probs_kernel(
        q_ptr, k_ptr, rows_ptr, valid_ptr, lse_ptr, probs_ptr, vertical_ptr,
        seq_len, head_dim, num_rows, heads, group, scale,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_rb, stride_vb,
        stride_lb, stride_lh, stride_pb, stride_ph, stride_pr, stride_ob, stride_oh,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch x head, key tile): the rows' probabilities of its keys, and their mean (vertical)
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = offs_r < num_rows
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_r[:, None] * stride_qr + offs_d[None, :],
                    mask=r_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # fmt: skip
        rows = tl.load(rows_ptr + b * stride_rb + offs_r, mask=r_ok, other=-1)
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_r, mask=r_ok, other=float("-inf"))
        k_base = k_ptr + b * stride_kb + (h // group) * stride_kh
        s = _rows_logits(q, k_base, offs_k, offs_d, rows, valid_ptr + b * stride_vb, seq_len, head_dim, stride_ks,
                         scale, PRECISION)  # fmt: skip
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)  # a row that sees no key: its logits are all -inf
        p = tl.math.exp2(s - lse_safe[:, None])
        in_seq = offs_k < seq_len
        tl.store(probs_ptr + b * stride_pb + h * stride_ph + offs_r[:, None] * stride_pr + offs_k[None, :], p,
                 mask=r_ok[:, None] & in_seq[None, :])  # fmt: skip
        tl.store(vertical_ptr + b * stride_ob + h * stride_oh + offs_k, tl.sum(p, axis=0) / num_rows, mask=in_seq)

    @triton.jit
    def _slash_kernel(
        probs_ptr, rows_ptr, slash_ptr, seq_len, num_rows, heads,
        stride_pb, stride_ph, stride_pr, stride_rb, stride_ob, stride_oh,
        BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch x head, tile of offsets): the mean probability along each diagonal
        bh, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_o = tile * BLOCK_O + tl.arange(0, BLOCK_O)
        acc = tl.zeros([BLOCK_O], tl.float32)
        row_base = probs_ptr + b * stride_pb + h * stride_ph
        for r in range(0, num_rows):
            position = tl.load(rows_ptr + b * stride_rb + r)
            key = position - offs_o
            acc += tl.load(row_base + r * stride_pr + key, mask=(key >= 0) & (offs_o < seq_len), other=0.0)
        tl.store(slash_ptr + b * stride_ob + h * stride_oh + offs_o, acc / num_rows, mask=offs_o < seq_len)


def line_sums_triton(
    q_rows: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `line_sums_reference` (same signature and result)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, heads, num_rows, head_dim = q_rows.shape
    kv_heads, seq_len = keys.shape[1], keys.shape[2]
    q_rows = q_rows if q_rows.stride(-1) == 1 else q_rows.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    rows = rows.to(torch.int64).contiguous()
    valid = key_valid.to(torch.int8).contiguous()
    device = q_rows.device
    chunks = triton.cdiv(seq_len, CHUNK)
    row_max = torch.empty(batch, heads, chunks, num_rows, device=device, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    common = dict(BLOCK_R=max(16, triton.next_power_of_2(num_rows)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                  PRECISION="ieee" if q_rows.dtype == torch.float32 else "tf32")  # fmt: skip
    strides = (q_rows.stride(0), q_rows.stride(1), q_rows.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
               rows.stride(0), valid.stride(0))  # fmt: skip
    shape = (seq_len, head_dim, num_rows, heads, heads // kv_heads, float(scale) * LOG2E)
    _rows_lse_kernel[(batch * heads, chunks)](
        q_rows, keys, rows, valid, row_max, row_sum, *shape, *strides,
        row_max.stride(0), row_max.stride(1), row_max.stride(2), CHUNK_KEYS=CHUNK, BLOCK_N=64, **common,
    )  # fmt: skip
    top = row_max.amax(2, keepdim=True)
    top_safe = torch.where(top == float("-inf"), 0.0, top)
    lse = (top_safe + torch.log2((row_sum * torch.exp2(row_max - top_safe)).sum(2, keepdim=True)))[:, :, 0]
    lse = torch.where(top[:, :, 0] == float("-inf"), float("-inf"), lse).contiguous()  # [B, H, R]
    probs = torch.empty(batch, heads, num_rows, seq_len, device=device, dtype=torch.float32)
    vertical = torch.empty(batch, heads, seq_len, device=device, dtype=torch.float32)
    _rows_probs_kernel[(batch * heads, triton.cdiv(seq_len, 64))](
        q_rows, keys, rows, valid, lse, probs, vertical, *shape, *strides,
        lse.stride(0), lse.stride(1), probs.stride(0), probs.stride(1), probs.stride(2),
        vertical.stride(0), vertical.stride(1), BLOCK_N=64, **common,
    )  # fmt: skip
    slash = torch.empty_like(vertical)
    _slash_kernel[(batch * heads, triton.cdiv(seq_len, 256))](
        probs, rows, slash, seq_len, num_rows, heads, probs.stride(0), probs.stride(1), probs.stride(2),
        rows.stride(0), slash.stride(0), slash.stride(1), BLOCK_O=256,
    )  # fmt: skip
    return vertical, slash


def line_sums(
    q_rows: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point: Triton on CUDA, the PyTorch reference elsewhere."""
    if q_rows.is_cuda:
        if triton is not None:
            return line_sums_triton(q_rows, keys, rows, key_valid, scale)
        warn_missing("line_sums")
    return line_sums_reference(q_rows, keys, rows, key_valid, scale)
