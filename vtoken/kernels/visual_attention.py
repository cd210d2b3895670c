"""The attention statistic an LLM-stage drop scores visual tokens with, as one custom op (`vtoken::visual_attention`).

For R query rows of a decoder layer (FastV's last token, SparseVLM's raters, MustDrop's text tokens), the causal
post-softmax attention to V chosen key slots (the visual tokens), mean over heads, normalised over every key the row
sees: [B, R, V] float32. The layer itself keeps running SDPA/flash; this reads its queries (rows only, rotary
applied) and keys again, in O(R * S * d) per head, without the [S, S] map. On CUDA it is two Triton launches (the
rows' softmax normalisers, then the visual columns summed over heads, deterministic: no atomics); on every other
device the PyTorch reference, which is also its definition. `vtoken::rotary_visual_attention` is the same read
from the layer's queries before rotary, the rotate-half rotary applied inside (to the keys too where the cache does
not hold them rotated); both ops launch the same two kernels.
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


def visual_attention_triton(
    query: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor, visual: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `visual_attention_reference` (same signature and result, to rounding): the rotary kernels
    with the query rows given as they are (rotary applied, [B, H, R, d]: row r at index r)."""
    query = query if query.stride(-1) == 1 else query.contiguous()
    by_row = (query.stride(0), query.stride(2), query.stride(1))  # batch, row, head
    return _launch(query, by_row, query.shape[1], keys, None, None, rows, key_valid, visual, scale, False)


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


# --------------------------------------------------------------------------- rotary applied inside
def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, R, d] rotated by the rotate-half rotary of Llama-style models, cos/sin [B, R, d]: x * cos +
    rotate_half(x) * sin with rotate_half(x) = [-x2, x1] (as transformers' `apply_rotary_pos_emb` computes it)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rotary_visual_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
    key_valid: torch.Tensor, visual: torch.Tensor, scale: float, rotate_keys: bool,
) -> torch.Tensor:  # fmt: skip
    """`visual_attention_reference` of the query rows `rows` [B, R] of `query` [B, S, H, d] (before rotary), with the
    rotate-half rotary of cos/sin [B or 1, S, d] applied to those rows and, if `rotate_keys`, to `keys`
    [B, Hkv, S, d] (else the keys are rotated already, as a layer's cache holds them). -1 rows read row 0 (their
    output is 0). Returns [B, R, V] float32."""
    batch, _, heads, dim = query.shape
    cos, sin = cos.expand(batch, *cos.shape[1:]), sin.expand(batch, *sin.shape[1:])
    safe = rows.clamp(min=0)
    q = query.gather(1, safe[:, :, None, None].expand(-1, -1, heads, dim)).transpose(1, 2)  # [B, H, R, d]
    row_cos, row_sin = (t.gather(1, safe[:, :, None].expand(-1, -1, dim)) for t in (cos, sin))
    q = rotate_half_reference(q, row_cos, row_sin)
    keys = rotate_half_reference(keys, cos, sin) if rotate_keys else keys
    return visual_attention_reference(q, keys, rows, key_valid, visual, scale)


if triton is not None:

    @triton.jit
    def _rotated(ptr, offs, partner, sign, cos, sin, mask):
        # x * cos + rotate_half(x) * sin, x read at `offs` and its partner half at `partner`, in float32
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(ptr + partner, mask=mask, other=0.0).to(tl.float32)
        return x * cos + sign * y * sin

    @triton.jit
    def _normalisers_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, rows_ptr, valid_ptr, max_ptr, sum_ptr,
        seq_len, head_dim, group, heads, num_rows,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_ks, stride_cb, stride_cs, stride_sb, stride_ss,
        stride_rb, stride_vb,
        scale,
        ROTARY: tl.constexpr, ROTATE_KEYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, head, row): the running max and sum of exp over the keys the row sees. ROTARY: the
        # queries are every sequence position before rotary (row r read at its sequence index, rotated here); else
        # the rows alone, rotated (row r at index r). ROTATE_KEYS: the keys are before rotary too.
        b, h, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        half = head_dim // 2
        offs_d = tl.arange(0, BLOCK_D)
        in_d = offs_d < head_dim
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        last = tl.load(rows_ptr + b * stride_rb + r)
        if ROTARY:
            row = tl.maximum(last, 0)
            row_cos = tl.load(cos_ptr + b * stride_cb + row * stride_cs + offs_d, mask=in_d, other=0.0).to(tl.float32)
            row_sin = tl.load(sin_ptr + b * stride_sb + row * stride_ss + offs_d, mask=in_d, other=0.0).to(tl.float32)
            q = _rotated(q_ptr + b * stride_qb + row * stride_qs + h * stride_qh, offs_d, partner, sign, row_cos,
                         row_sin, in_d)  # fmt: skip
        else:
            q = tl.load(q_ptr + b * stride_qb + r * stride_qs + h * stride_qh + offs_d, mask=in_d,
                        other=0.0).to(tl.float32)  # fmt: skip
        k_row = k_ptr + b * stride_kb + (h // group) * stride_kh
        running_max = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
        for start in range(0, seq_len, BLOCK_S):
            offs_s = start + tl.arange(0, BLOCK_S)
            in_seq = offs_s < seq_len
            valid = tl.load(valid_ptr + b * stride_vb + offs_s, mask=in_seq, other=0) != 0
            seen = in_seq & valid & (offs_s <= last)
            tile = in_seq[:, None] & in_d[None, :]
            if ROTATE_KEYS:
                cos = tl.load(cos_ptr + b * stride_cb + offs_s[:, None] * stride_cs + offs_d[None, :], mask=tile,
                              other=0.0).to(tl.float32)  # fmt: skip
                sin = tl.load(sin_ptr + b * stride_sb + offs_s[:, None] * stride_ss + offs_d[None, :], mask=tile,
                              other=0.0).to(tl.float32)  # fmt: skip
                k = _rotated(k_row + offs_s[:, None] * stride_ks, offs_d[None, :], partner[None, :],
                             sign[None, :], cos, sin, tile)  # fmt: skip
            else:
                k = tl.load(k_row + offs_s[:, None] * stride_ks + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
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
        q_ptr, k_ptr, cos_ptr, sin_ptr, rows_ptr, valid_ptr, visual_ptr, max_ptr, sum_ptr, out_ptr,
        num_visual, head_dim, group, heads, num_rows,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_kh, stride_ks, stride_cb, stride_cs, stride_sb, stride_ss,
        stride_rb, stride_vb, stride_xb, stride_ob, stride_or,
        scale,
        ROTARY: tl.constexpr, ROTATE_KEYS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, row, block of visual slots): each head's probability there, summed, / heads
        # (ROTARY, ROTATE_KEYS: as `_normalisers_kernel`)
        b, r, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        half = head_dim // 2
        offs_v = block * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_d = tl.arange(0, BLOCK_D)
        in_d = offs_d < head_dim
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        in_range = offs_v < num_visual
        slots = tl.load(visual_ptr + b * stride_xb + offs_v, mask=in_range, other=-1)
        last = tl.load(rows_ptr + b * stride_rb + r)
        row = tl.maximum(last, 0)
        safe = tl.where(slots >= 0, slots, 0)
        valid = tl.load(valid_ptr + b * stride_vb + safe, mask=in_range, other=0) != 0
        seen = in_range & (slots >= 0) & valid & (slots <= last) & (last >= 0)
        tile = seen[:, None] & in_d[None, :]
        if ROTARY:
            row_cos = tl.load(cos_ptr + b * stride_cb + row * stride_cs + offs_d, mask=in_d, other=0.0).to(tl.float32)
            row_sin = tl.load(sin_ptr + b * stride_sb + row * stride_ss + offs_d, mask=in_d, other=0.0).to(tl.float32)
        if ROTATE_KEYS:  # the visual keys' tables, the same for every head
            cos = tl.load(cos_ptr + b * stride_cb + safe[:, None] * stride_cs + offs_d[None, :], mask=tile,
                          other=0.0).to(tl.float32)  # fmt: skip
            sin = tl.load(sin_ptr + b * stride_sb + safe[:, None] * stride_ss + offs_d[None, :], mask=tile,
                          other=0.0).to(tl.float32)  # fmt: skip
        total = tl.zeros([BLOCK_V], tl.float32)
        for h in range(0, heads):
            if ROTARY:
                q = _rotated(q_ptr + b * stride_qb + row * stride_qs + h * stride_qh, offs_d, partner, sign, row_cos,
                             row_sin, in_d)  # fmt: skip
            else:
                q = tl.load(q_ptr + b * stride_qb + r * stride_qs + h * stride_qh + offs_d, mask=in_d,
                            other=0.0).to(tl.float32)  # fmt: skip
            k_rows = k_ptr + b * stride_kb + (h // group) * stride_kh + safe[:, None] * stride_ks
            if ROTATE_KEYS:
                k = _rotated(k_rows, offs_d[None, :], partner[None, :], sign[None, :], cos, sin, tile)
            else:
                k = tl.load(k_rows + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
            index = (b * heads + h) * num_rows + r
            row_max, row_sum = tl.load(max_ptr + index), tl.load(sum_ptr + index)
            logits = tl.sum(k * q[None, :], axis=1) * scale
            probs = tl.exp(logits - row_max) / tl.where(row_sum > 0, row_sum, 1.0)
            total += tl.where(seen, probs, 0.0)
        tl.store(out_ptr + b * stride_ob + r * stride_or + offs_v, total / heads, mask=in_range)


def _launch(
    query: torch.Tensor, query_strides: tuple[int, int, int], heads: int, keys: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, rows: torch.Tensor, key_valid: torch.Tensor,
    visual: torch.Tensor, scale: float, rotate_keys: bool,
) -> torch.Tensor:  # fmt: skip
    """Both ops' two launches. query_strides: (batch, row, head) strides of `query` (row: the sequence index where
    cos/sin are given, the row's index otherwise); cos/sin [B or 1, S, d] (None: the queries are rotated already)."""
    if triton is None:
        raise RuntimeError("triton is not installed; install vtoken[kernels]")
    batch, head_dim = query.shape[0], query.shape[-1]
    kv_heads, seq_len = keys.shape[1], keys.shape[2]
    num_rows, num_visual = rows.shape[1], visual.shape[1]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    rotary = cos is not None
    if rotary:
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
        table = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), sin.stride(0) if sin.shape[0] > 1 else 0,
                 sin.stride(1))  # fmt: skip
    else:
        cos = sin = query  # never read
        table = (0, 0, 0, 0)
    rows = rows.to(torch.int64).contiguous()
    key_valid = key_valid.to(torch.int8).contiguous()
    visual = visual.to(torch.int64).contiguous()
    out = torch.empty(batch, num_rows, num_visual, device=query.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    row_max = torch.empty(batch, heads, num_rows, device=query.device, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    block_d = triton.next_power_of_2(head_dim)
    common = (head_dim, heads // kv_heads, heads, num_rows, *query_strides, keys.stride(0), keys.stride(1),
              keys.stride(2), *table, rows.stride(0), key_valid.stride(0))  # fmt: skip
    flags = dict(ROTARY=rotary, ROTATE_KEYS=bool(rotate_keys), BLOCK_D=block_d)
    # tiles without register spills on sm_90 at head_dim 128 and 256, rotated or not (ptxas's report:
    # tests/test_selection_kernels.py); 64 x 128 tiles at 4 warps spilled up to 1.5 KB per thread
    _normalisers_kernel[(batch, heads, num_rows)](
        query, keys, cos, sin, rows, key_valid, row_max, row_sum, seq_len, *common, float(scale),
        BLOCK_S=64 if block_d <= 128 else 32, num_warps=8, **flags,
    )  # fmt: skip
    block_v = 16
    _visual_columns_kernel[(batch, num_rows, triton.cdiv(num_visual, block_v))](
        query, keys, cos, sin, rows, key_valid, visual, row_max, row_sum, out, num_visual, *common, visual.stride(0),
        out.stride(0), out.stride(1), float(scale), BLOCK_V=block_v, num_warps=4, **flags,
    )  # fmt: skip
    return out


def rotary_visual_attention_triton(
    query: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
    key_valid: torch.Tensor, visual: torch.Tensor, scale: float, rotate_keys: bool,
) -> torch.Tensor:  # fmt: skip
    """Triton version of `rotary_visual_attention_reference` (same signature and result, to rounding): the rotary
    is applied in registers, to the query rows and (`rotate_keys`) to every key tile as it is read."""
    query = query if query.stride(-1) == 1 else query.contiguous()
    by_position = (query.stride(0), query.stride(1), query.stride(2))  # batch, sequence, head
    return _launch(query, by_position, query.shape[2], keys, cos, sin, rows, key_valid, visual, scale, rotate_keys)


@torch.library.custom_op("vtoken::rotary_visual_attention", mutates_args=())
def rotary_visual_attention(
    query: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
    key_valid: torch.Tensor, visual: torch.Tensor, scale: float, rotate_keys: bool,
) -> torch.Tensor:  # fmt: skip
    """`visual_attention` of query rows read from the layer's queries before rotary, the rotate-half rotary applied
    inside (see `rotary_visual_attention_reference`); one op: Triton on CUDA, the reference elsewhere."""
    return rotary_visual_attention_reference(query, keys, cos, sin, rows, key_valid, visual, scale, rotate_keys)


@rotary_visual_attention.register_fake
def _(query, keys, cos, sin, rows, key_valid, visual, scale, rotate_keys):
    return query.new_empty(query.shape[0], rows.shape[1], visual.shape[1], dtype=torch.float32)


register_cuda(rotary_visual_attention, rotary_visual_attention_triton, rotary_visual_attention_reference)
