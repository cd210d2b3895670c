"""Block-sparse causal attention (prefill), flash-style: only the key blocks a plan lists are read.

A plan gives, per (batch, head, query block), how many key blocks to visit (`block_counts` [B, H, Qb]) and which
(`block_index` [B, H, Qb, K]; entries past a count are never read, so they may hold anything; any order). Inside the
visited blocks the mask is exact, element by element: causal (key j <= query i), key padding (`key_valid` [B, S])
and an optional local limit (`window` > 0: j < `sink` or i - j < `window`, the A-shape). A query row that sees no
key gives 0. q is [B, H, S, d], k/v are [B, Hkv, S, d] with H a multiple of Hkv (grouped-query attention: head h
reads kv head h // (H / Hkv), as `repeat_kv` groups them); fp16/bf16/fp32 in, fp32 accumulation, output in q's dtype.

`block_sparse_attention` is the custom op `vtoken::block_sparse_attention`: the Triton kernel on CUDA, the PyTorch
reference elsewhere (one launch to `torch.compile` and to `vtoken.launches.count_launches`); both have one signature
and are tested against each other (on CPU through `TRITON_INTERPRET=1`). FlexAttention runs the same plans in
`block_sparse_flex`.

The Triton kernel, FlashAttention-2 style:
- 128-row query tiles: where the plan's block is smaller (64), one program serves two (or more) plan rows; the
  launcher merges their key-block lists into one ascending list per tile (`tile_plan`), each entry flagged with the
  plan rows that listed it, so a key tile is loaded once for both and rows that did not list it are masked;
- the block loop is a `tl.range` software pipeline: the index of a later iteration and its K/V tiles are fetched
  while the current tile computes (`num_stages`);
- softmax in base 2 (`exp2`) with log2(e) folded into the scale;
- the query heads sharing one KV head (grouped-query attention) are adjacent programs: they read the same K/V tiles
  at the same time, which the L2 cache serves once;
- tile sizes, warps and pipeline depth are autotuned per (length bucket, head dim, GQA group, plan block, padding);
  under the Triton interpreter one fixed configuration runs (no tuning).
"""

from __future__ import annotations

import math
import os

import torch

from .dispatch import register_cuda

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is optional
    triton = None

LOG2E = math.log2(math.e)
TILE_ROWS = 128  # the query tile the kernel merges plan rows into
ROW_BITS = 8  # a merged entry is key_block << ROW_BITS | (bit r: plan row r of the tile lists it); rows <= 8


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


def tile_plan(block_counts: torch.Tensor, block_index: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every `rows` consecutive plan rows into one tile's list (the kernel's 128-row tiles over a finer plan).

    block_counts [B, H, Qb], block_index [B, H, Qb, K] (any order; entries past a count ignored) -> counts [B, H, T]
    (T = ceil(Qb / rows)) and entries [B, H, T, rows * K] int32: the union of the rows' key blocks, ascending, each
    `key_block << 8 | flags` with bit r of `flags` set where plan row r of the tile lists the block. A device-side
    burst of a few kernels (one sort), no host sync."""
    batch, heads, qb, width = block_index.shape
    tiles = -(-qb // rows)
    counts = block_counts.expand(batch, heads, qb)
    index = block_index.expand(batch, heads, qb, width)
    if tiles * rows != qb:
        counts = torch.nn.functional.pad(counts, (0, tiles * rows - qb))
        index = torch.nn.functional.pad(index, (0, 0, 0, tiles * rows - qb))
    listed = torch.arange(width, device=index.device) < counts[..., None].long()
    spare = 1 << 22  # sorts after every real block (a block index stays below 2^22: 2^26+ tokens at block 16)
    row = torch.arange(tiles * rows, device=index.device).remainder(rows)[:, None]  # [Qb', 1]
    key = torch.where(listed, index.long(), spare) * rows + row  # [B, H, Qb', K]: block-major, then plan row
    key = key.view(batch, heads, tiles, rows * width).sort(dim=-1).values
    block, owner = key.div(rows, rounding_mode="floor"), key.remainder(rows)
    first = torch.ones_like(block, dtype=torch.bool)
    first[..., 1:] = block[..., 1:] != block[..., :-1]
    segment = first.long().cumsum(-1) - 1  # entries of one block share a segment; segments ascend from 0
    flags = torch.zeros_like(block).scatter_add_(-1, segment, (1 << owner) * (block < spare))
    blocks = torch.zeros_like(block).scatter_(-1, segment, block)  # every entry of a segment writes the same block
    tile_counts = (first & (block < spare)).sum(-1)
    return tile_counts.to(torch.int32), ((blocks << ROW_BITS) | flags).to(torch.int32)


if triton is not None:

    @triton.jit
    def _block_sparse_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, counts_ptr, index_ptr, valid_ptr,
        seq_len, head_dim, kv_heads, group, sink, window, scale,
        stride_qb, stride_qh, stride_qs,
        stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs,
        stride_ob, stride_oh, stride_os,
        stride_cb, stride_ch,
        stride_ib, stride_ih, stride_iq,
        stride_valid,
        tune_length,
        HAS_VALID: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PIPELINE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # BLOCK: the plan's block; BLOCK_M query rows per program (> BLOCK: the launcher's merged tile plan, entries
        # key_block << 8 | row flags); BLOCK_N keys per step (<= BLOCK). `scale` is in log2 units (x log2 e).
        # tune_length: the autotuner's length bucket, unused here.
        num_tiles = tl.cdiv(seq_len, BLOCK_M)
        pid = tl.program_id(0)
        tile = num_tiles - 1 - pid // group  # the longest (last) tiles first; a GQA group's heads adjacent
        bkv = tl.program_id(1).to(tl.int64)
        b, kvh = bkv // kv_heads, bkv % kv_heads
        h = kvh * group + pid % group
        m_start = tile * BLOCK_M
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        row_ok = offs_m < seq_len
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        if BLOCK_M > BLOCK:
            plan_row = tile
            row_bit = 1 << ((offs_m - m_start) // BLOCK)  # [BLOCK_M]: this row's flag in a merged entry
            all_rows = (1 << (BLOCK_M // BLOCK)) - 1
        else:
            plan_row = m_start // BLOCK
        count = tl.load(counts_ptr + b * stride_cb + h * stride_ch + plan_row)
        index_row = index_ptr + b * stride_ib + h * stride_ih + plan_row * stride_iq
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for t in tl.range(0, count * (BLOCK // BLOCK_N), num_stages=PIPELINE):
            entry = tl.load(index_row + t // (BLOCK // BLOCK_N))
            if BLOCK_M > BLOCK:
                kblock = entry >> 8
                listed_by = entry & 255
            else:
                kblock = entry
            k_start = kblock * BLOCK + (t % (BLOCK // BLOCK_N)) * BLOCK_N
            offs_k = k_start + offs_n
            in_seq = offs_k < seq_len
            k = tl.load(k_base + offs_k[:, None] * stride_ks + offs_d[None, :],
                        mask=in_seq[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            # element masks only where they can bite: tiles crossing the diagonal or the end, padding, the
            # A-shape's limits, and (merged tiles) rows that did not list this block
            crosses = (k_start + BLOCK_N - 1 > m_start) | (k_start + BLOCK_N > seq_len)
            # the A-shape bites where some pair of the tile is neither a sink key nor inside the local band
            outside = (k_start + BLOCK_N > sink) & (m_start + BLOCK_M - 1 - k_start >= window)
            crosses = crosses | ((window > 0) & outside)
            if BLOCK_M > BLOCK:
                crosses = crosses | (listed_by != all_rows)
            if HAS_VALID or crosses:
                allowed = (offs_k[None, :] <= offs_m[:, None]) & in_seq[None, :]
                local = (offs_k[None, :] < sink) | (offs_m[:, None] - offs_k[None, :] < window)
                allowed = allowed & ((window <= 0) | local)
                if BLOCK_M > BLOCK:
                    allowed = allowed & ((listed_by & row_bit) != 0)[:, None]
                if HAS_VALID:
                    valid = tl.load(valid_ptr + b * stride_valid + offs_k, mask=in_seq, other=0) != 0
                    allowed = allowed & valid[None, :]
                s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_k[:, None] * stride_vs + offs_d[None, :],
                        mask=in_seq[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key: acc is 0
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip

    def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
        return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "PIPELINE": stages}, num_warps=warps,
                             num_stages=stages)  # fmt: skip

    # FlashAttention-2's forward tiles and their neighbours (Ampere/Hopper); `_fitting` keeps those the plan allows
    CONFIGS = [
        _config(m, n, w, s)
        for m, n, w, s in [
            (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2),
            (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2), (16, 16, 4, 2),
        ]
    ]  # fmt: skip

    def _fitting(configs, named_args, **kwargs):
        """The configs a call allows: key steps inside a plan block; 128-row query tiles over a finer plan (the
        launcher merged its rows), 64 or 128 rows inside a coarser one; the widest tiles only up to head dim 128."""
        block, head_dim = kwargs["BLOCK"], named_args["head_dim"]
        rows = (TILE_ROWS,) if block < TILE_ROWS else (64, TILE_ROWS)
        keep = [
            c
            for c in configs
            if c.kwargs["BLOCK_N"] <= block
            and c.kwargs["BLOCK_M"] in rows
            and (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] < 128 * 128 or head_dim <= 128)
        ]
        return keep or [_config(TILE_ROWS, min(block, 64), 4, 2)]

    _block_sparse_tuned = triton.autotune(
        CONFIGS,
        key=["tune_length", "head_dim", "group", "HAS_VALID", "BLOCK"],
        prune_configs_by={"early_config_prune": _fitting},
    )(_block_sparse_kernel)


def interpreter_config(block_size: int) -> dict:
    """The one configuration the Triton interpreter runs (no autotuning there): 128-row tiles, as on a GPU."""
    return {"BLOCK_M": TILE_ROWS if block_size <= TILE_ROWS else 64, "BLOCK_N": min(block_size, 64), "PIPELINE": 2,
            "num_warps": 4, "num_stages": 2}  # fmt: skip


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

    `block_size` must be a power of two >= 16. Autotuned on a GPU; one fixed configuration under the interpreter."""
    config = interpreter_config(block_size) if os.environ.get("TRITON_INTERPRET") == "1" else None
    return launch(q, k, v, block_counts, block_index, block_size, scale, key_valid, sink, window, config)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    scale: float,
    key_valid: torch.Tensor | None,
    sink: int,
    window: int,
    config: dict | None,
) -> torch.Tensor:
    """Run the kernel with `config` (BLOCK_M, BLOCK_N, PIPELINE, num_warps, num_stages) or, when None, autotuned."""
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
    merged = block_size < TILE_ROWS and (config is None or config["BLOCK_M"] > block_size)
    if merged:  # 128-row tiles over a finer plan: merge its rows' lists (every tuned config takes this plan)
        counts, index = tile_plan(counts, index, TILE_ROWS // block_size)
    valid = key_valid.to(torch.int8).contiguous() if key_valid is not None else counts  # unused when absent
    out = torch.empty_like(q)
    group = heads // kv_heads
    args = (
        q, k, v, out, counts, index, valid,
        seq_len, head_dim, kv_heads, group, int(sink), int(window), float(scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        counts.stride(0), counts.stride(1),
        index.stride(0), index.stride(1), index.stride(2),
        valid.stride(0) if key_valid is not None else 0,
        triton.next_power_of_2(seq_len),
    )  # fmt: skip
    constants = dict(
        HAS_VALID=key_valid is not None,
        BLOCK=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if config is None:  # autotuned: `_fitting` keeps the tiles the prepared plan serves
        grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_M"]) * group, batch * kv_heads)  # noqa: E731
        _block_sparse_tuned[grid](*args, **constants)
        return out
    tiles = config["BLOCK_M"]
    if (tiles > block_size) != merged or (merged and tiles != TILE_ROWS):
        raise ValueError(f"config {config}: query tiles of {TILE_ROWS} rows or within one plan block ({block_size})")
    _block_sparse_kernel[(triton.cdiv(seq_len, tiles) * group, batch * kv_heads)](*args, **constants, **config)
    return out


# --------------------------------------------------------------------- the custom op
_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor block_counts, Tensor block_index, int block_size, float scale, "
    "Tensor? key_valid=None, int sink=0, int window=0) -> Tensor"
)


def _reference_op(q, k, v, block_counts, block_index, block_size, scale, key_valid=None, sink=0, window=0):
    return block_sparse_attention_reference(q, k, v, block_counts, block_index, block_size, scale, key_valid, sink,
                                            window)  # fmt: skip


block_sparse_attention_op = torch.library.custom_op(
    "vtoken::block_sparse_attention", _reference_op, mutates_args=(), schema=_SCHEMA
)


@block_sparse_attention_op.register_fake
def _(q, k, v, block_counts, block_index, block_size, scale, key_valid=None, sink=0, window=0):
    return torch.empty_like(q)


def _triton_op(q, k, v, block_counts, block_index, block_size, scale, key_valid=None, sink=0, window=0):
    return block_sparse_attention_triton(q, k, v, block_counts, block_index, block_size, scale, key_valid, sink,
                                         window)  # fmt: skip


# without triton: the dense reference, warned (sparse prefill's "auto" picks FlexAttention or dense attention first)
register_cuda(block_sparse_attention_op, _triton_op, _reference_op)


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
    """Dispatching entry point (the custom op `vtoken::block_sparse_attention`): Triton on CUDA, the PyTorch
    reference elsewhere."""
    return block_sparse_attention_op(q, k, v, block_counts, block_index, int(block_size), float(scale), key_valid,
                                     int(sink), int(window))  # fmt: skip
