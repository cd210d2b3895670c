"""Post-softmax attention of chosen query rows to all keys, without the full attention matrix.

Used for [CLS]-attention scores in vision towers (one row) and for the query rows LLM-stage methods read
(FastV's last token, MustDrop's text tokens): the layer itself keeps running SDPA/flash; we recompute only those
rows from its q/k projections, in O(S * d) per row and head. `attention_row_probs` is the custom op
`vtoken::attention_row_probs` (key padding included: one launch on CUDA, the reference elsewhere);
`causal_rows_probs` dispatches to its Triton kernel for CUDA tensors and to the PyTorch reference elsewhere; each
pair has one signature and is tested against each other (on CPU through `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch

from .dispatch import register_cuda, warn_missing

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None


def attention_row_probs_reference(
    query: torch.Tensor, keys: torch.Tensor, scale: float, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention probabilities of one query per (batch, head) over all keys.

    query: [B, H, d]; keys: [B, S, H, d] (the layout k_proj outputs, reshaped); key_valid: [B, S] bool or None
    (a padded batch: keys outside it get no probability). Returns [B, H, S] float32.
    """
    # a product and a sum over d rather than einsum: einsum's batched matmul rounds row b differently for different
    # batch sizes, and a score that depends on the batch breaks "a padded batch equals its rows one by one" wherever
    # scores nearly tie (random-weight towers, VisPruner's duplicate removal)
    logits = (query.float()[:, None] * keys.float()).sum(-1).transpose(1, 2) * scale
    if key_valid is not None:
        logits = logits.masked_fill(~key_valid.bool()[:, None, :], float("-inf"))
    return logits.softmax(dim=-1)


if triton is not None:

    @triton.jit
    def _row_probs_kernel(
        q_ptr,
        k_ptr,
        valid_ptr,
        out_ptr,
        seq_len,
        head_dim,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_ob,
        stride_oh,
        scale,
        HAS_VALID: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # one program per (batch, head): logits block by block with an online max/sum, then normalise in place;
        # padding keys (HAS_VALID) get -inf logits, as the reference's masked softmax
        b, h = tl.program_id(0), tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
        out_row = out_ptr + b * stride_ob + h * stride_oh
        running_max = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
        for start in range(0, seq_len, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            in_seq = offs_s < seq_len
            k = tl.load(
                k_ptr + b * stride_kb + offs_s[:, None] * stride_ks + h * stride_kh + offs_d[None, :],
                mask=in_seq[:, None] & (offs_d[None, :] < head_dim),
                other=0.0,
            ).to(tl.float32)
            seen = in_seq
            if HAS_VALID:
                seen = seen & (tl.load(valid_ptr + b * stride_vb + offs_s, mask=in_seq, other=0) != 0)
            logits = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            tl.store(out_row + offs_s, logits, mask=in_seq)
            new_max = tl.maximum(running_max, tl.max(logits, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
            running_max = new_max
        for start in range(0, seq_len, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            in_seq = offs_s < seq_len
            logits = tl.load(out_row + offs_s, mask=in_seq, other=float("-inf"))
            tl.store(out_row + offs_s, tl.exp(logits - running_max) / running_sum, mask=in_seq)


def attention_row_probs_triton(
    query: torch.Tensor, keys: torch.Tensor, scale: float, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of `attention_row_probs_reference` (same signature and result): one launch, its grid and
    block sizes from the shapes."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, heads, head_dim = query.shape
    seq_len = keys.shape[1]
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else None
    out = torch.empty(batch, heads, seq_len, device=query.device, dtype=torch.float32)
    _row_probs_kernel[(batch, heads)](
        query, keys, valid if valid is not None else out, out, seq_len, head_dim,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        valid.stride(0) if valid is not None else 0, out.stride(0), out.stride(1), float(scale),
        HAS_VALID=valid is not None, BLOCK_S=128, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


@torch.library.custom_op("vtoken::attention_row_probs", mutates_args=())
def attention_row_probs(
    query: torch.Tensor, keys: torch.Tensor, scale: float, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, H, S] float32 (see `attention_row_probs_reference`): the reference here, the Triton kernel for CUDA
    tensors, padding (`key_valid` [B, S]) included in both."""
    return attention_row_probs_reference(query, keys, scale, key_valid)


@attention_row_probs.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, scale: float, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1], keys.shape[1], dtype=torch.float32)


register_cuda(attention_row_probs, attention_row_probs_triton, attention_row_probs_reference)


def causal_rows_probs_reference(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal softmax attention of R chosen query rows per (batch, head) over the keys they may see.

    query: [B, H, R, d] (rotary applied); keys: [B, Hkv, S, d] (H a multiple of Hkv; head h reads kv head
    h // (H / Hkv), as `repeat_kv` groups them); rows: [B, R] the rows' sequence positions (row r sees keys
    0..rows[b, r]); key_valid: [B, S] bool, False for padding. Returns [B, H, R, S] float32, 0 where not seen
    (a row that sees no key is all 0).
    """
    heads, kv_heads = query.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    seq = torch.arange(keys.shape[2], device=keys.device)
    seen = (seq[None, None, :] <= rows[:, :, None]) & key_valid[:, None, :]
    return logits.masked_fill(~seen[:, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


if triton is not None:

    @triton.jit
    def _causal_rows_kernel(
        q_ptr, k_ptr, rows_ptr, valid_ptr, out_ptr,
        seq_len, head_dim, group,
        stride_qb, stride_qh, stride_qr,
        stride_kb, stride_kh, stride_ks,
        stride_rb, stride_vb,
        stride_ob, stride_oh, stride_or,
        scale,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, head, row): masked logits with an online max/sum, then normalise in place
        b, h, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + r * stride_qr + offs_d, mask=offs_d < head_dim,
                    other=0.0).to(tl.float32)  # fmt: skip
        last = tl.load(rows_ptr + b * stride_rb + r)
        k_row = k_ptr + b * stride_kb + (h // group) * stride_kh
        out_row = out_ptr + b * stride_ob + h * stride_oh + r * stride_or
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
            tl.store(out_row + offs_s, logits, mask=in_seq)
            new_max = tl.maximum(running_max, tl.max(logits, axis=0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(logits - safe_max), axis=0)
            running_max = new_max
        safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
        total = tl.where(running_sum > 0, running_sum, 1.0)
        for start in range(0, seq_len, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            in_seq = offs_s < seq_len
            logits = tl.load(out_row + offs_s, mask=in_seq, other=float("-inf"))
            tl.store(out_row + offs_s, tl.exp(logits - safe_max) / total, mask=in_seq)


def causal_rows_probs_triton(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Triton version of `causal_rows_probs_reference` (same signature and result)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, heads, num_rows, head_dim = query.shape
    kv_heads, seq_len = keys.shape[1], keys.shape[2]
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    rows = rows.to(torch.int64).contiguous()
    key_valid = key_valid.to(torch.int8).contiguous()
    out = torch.empty(batch, heads, num_rows, seq_len, device=query.device, dtype=torch.float32)
    _causal_rows_kernel[(batch, heads, num_rows)](
        query, keys, rows, key_valid, out,
        seq_len, head_dim, heads // kv_heads,
        query.stride(0), query.stride(1), query.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        rows.stride(0), key_valid.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        float(scale),
        BLOCK_S=128, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


def causal_rows_probs(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dispatching entry point: Triton on CUDA, the PyTorch reference elsewhere."""
    if query.is_cuda:
        if triton is not None:
            return causal_rows_probs_triton(query, keys, rows, key_valid, scale)
        warn_missing("causal_rows_probs")
    return causal_rows_probs_reference(query, keys, rows, key_valid, scale)
