"""Block-sparse causal attention through PyTorch's FlexAttention: the plan becomes a `BlockMask`, compiled.

Same signature and result as `block_sparse_attention_reference` (see `block_sparse_attention`). The plan's key
blocks split into full blocks (strictly below the diagonal, every key valid, every pair inside the A-shape: no
element mask) and partial ones, where a `mask_mod` applies the causal, padding and A-shape limits per element.
`flex_attention` is compiled once per process (`torch.compile`, static shapes: inductor's Triton template on CUDA,
its C++ template on CPU). Lengths are padded up to one of four buckets per octave (and plan widths likewise), so
prompts of nearby lengths share one compiled kernel instead of compiling one each; the padded rows list no blocks
and the padded keys are invalid, so padding changes no result.
"""

from __future__ import annotations

import inspect
import threading

import torch
import torch.nn.functional as F

RECOMPILE_LIMIT = 64  # compiled variants per process: length buckets x shapes x dtypes (dynamo's default is 8)
_compiled = None
_lock = threading.Lock()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _flex():
    """torch's FlexAttention module, or None before torch 2.5 (imported on first use: it takes a second)."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def flex_unavailable(device_type: str | None = None) -> str | None:
    """Why FlexAttention cannot run the plans (on `device_type`, if given) with this torch; None where it can."""
    if _flex() is None:
        return f"torch {torch.__version__} has no FlexAttention (torch 2.5 or newer has it)"
    if device_type is None:
        return None
    if device_type == "cpu" and _torch_version() < (2, 6):
        return f"FlexAttention runs on CPU from torch 2.6 (this is {torch.__version__})"
    if device_type not in ("cpu", "cuda"):
        return f"FlexAttention runs on cpu and cuda, not {device_type}"
    return None


def bucket(n: int, floor: int = 1) -> int:
    """n rounded up to one of four values per octave (a multiple of `floor`): at most 25 % more."""
    step = max(floor, 1 << max(n.bit_length() - 3, 0))
    return -(-n // step) * step


def _compiled_flex():
    global _compiled
    with _lock:
        if _compiled is None:
            _compiled = torch.compile(_flex().flex_attention, dynamic=False)
    return _compiled


def _compact(selected: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected entries of each row first (in their order): counts [..., Qb] int32, index [..., Qb, K] int32."""
    order = (~selected).to(torch.int8).argsort(dim=-1, stable=True)
    return selected.sum(-1).to(torch.int32), index.gather(-1, order).to(torch.int32).contiguous()


def _mask_mod(valid: torch.Tensor, sink: int, window: int):
    """Causal, key padding (`valid` [B, L]) and the A-shape (j < sink or i - j < window; window 0: none). `sink` and
    `window` are Python ints, constants of the compiled kernel: no tensor made from them per layer (on CUDA each
    would be a blocking host-to-device copy), and no A-shape term at all without a window."""
    if window <= 0:

        def causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & valid[b, kv_idx]

        return causal

    def a_shape(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sink) | (q_idx - kv_idx < window)) & valid[b, kv_idx]

    return a_shape


def flex_block_mask(
    block_counts: torch.Tensor,
    block_index: torch.Tensor,
    block_size: int,
    length: int,
    valid: torch.Tensor,
    sink: int,
    window: int,
):
    """The `BlockMask` of a plan over `length` (padded) tokens; valid [B, length] bool (False: padding)."""
    batch = valid.shape[0]
    heads = block_counts.shape[1]
    blocks = length // block_size
    counts = block_counts.expand(batch, heads, -1)
    index = block_index.expand(batch, heads, *block_index.shape[2:]).long()
    rows, width = index.shape[2], index.shape[3]
    # inductor's CPU template wants a list as wide as the key blocks; CUDA's reads only the listed entries
    width_padded = blocks if index.device.type == "cpu" else min(bucket(max(width, 1)), blocks)
    counts = F.pad(counts, (0, blocks - rows))
    index = F.pad(index[..., :width_padded], (0, max(width_padded - width, 0), 0, blocks - rows))
    listed = torch.arange(width_padded, device=index.device) < counts[..., None].long()
    query_block = torch.arange(blocks, device=index.device)[:, None]
    block_valid = valid.view(batch, blocks, block_size).all(-1)  # [B, Kb]
    whole = block_valid[:, None, None, :].expand(batch, heads, blocks, blocks).gather(-1, index.clamp(0, blocks - 1))
    full = listed & (index < query_block) & whole
    if window > 0:  # every pair of the block inside the A-shape
        last_query = query_block * block_size + block_size - 1
        full = full & (((index + 1) * block_size <= sink) | (last_query - index * block_size < window))
    partial_counts, partial_index = _compact(listed & ~full, index)
    full_counts, full_index = _compact(full, index)
    mod = _mask_mod(valid, int(sink), int(window))
    extra = {}
    block_mask = _flex().BlockMask
    parameters = inspect.signature(block_mask.from_kv_blocks).parameters
    if "seq_lengths" in parameters:
        extra["seq_lengths"] = (length, length)
    if "compute_q_blocks" in parameters:  # the transposed lists serve the backward pass only
        extra["compute_q_blocks"] = False
    return block_mask.from_kv_blocks(partial_counts, partial_index, full_counts, full_index, BLOCK_SIZE=block_size,
                                    mask_mod=mod, **extra)  # fmt: skip


def block_sparse_attention_flex(
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
    """FlexAttention version of `block_sparse_attention_reference` (same signature and result)."""
    reason = flex_unavailable(q.device.type)
    if reason is not None:
        raise RuntimeError(reason)
    batch, heads, seq_len, _ = q.shape
    length = bucket(seq_len, block_size)
    valid = key_valid.bool() if key_valid is not None else torch.ones(batch, seq_len, dtype=torch.bool, device=q.device)
    valid = F.pad(valid, (0, length - seq_len))  # padded keys are never seen
    q, k, v = (F.pad(x, (0, 0, 0, length - seq_len)).contiguous() for x in (q, k, v))
    block_mask = flex_block_mask(block_counts, block_index, block_size, length, valid, int(sink), int(window))
    options = {}
    if q.is_cuda and block_size < 128:  # tiles inside the mask's blocks (newer torch shrinks its own to fit)
        options["kernel_options"] = {"BLOCK_M": block_size, "BLOCK_N": block_size}
    if heads != k.shape[1]:
        if "enable_gqa" in inspect.signature(_flex().flex_attention).parameters:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(heads // k.shape[1], dim=1) for x in (k, v))
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: max(getattr(torch._dynamo.config, limit), RECOMPILE_LIMIT)}):
        out = _compiled_flex()(q, k, v, block_mask=block_mask, scale=float(scale), **options)
    return out[:, :, :seq_len]
