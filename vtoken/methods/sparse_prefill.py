"""Sparse prefill: every token stays, but each attention layer of the LLM prefill computes only some key blocks.

Token pruning shortens the sequence; sparse prefill keeps it and skips attention work, which dominates long
visual prompts (for a 7B LLM attention is ~14 % of prefill FLOPs at 8k tokens, 40 % at 32k, 73 % at 128k; the
whole-prefill bound at attention density rho is 1 / (1 - a + a * rho)). Patterns, as in MInference / MMInference
(written here from their descriptions):
- "a_shape": query i sees key j iff j <= i and (j < sink or i - j < window): attention sinks plus a local band,
  exact to the token, in every layer, head and row. No estimation.
- "vertical_slash": per layer and head, estimated online from the attention of the last 64 query rows (the
  row-attention kernel): column sums give vertical lines (keys everyone reads), sums along diagonals give
  slashes (fixed relative offsets). With `density`, every query block keeps that fraction of its causal key blocks,
  ranked by the attention mass the lines predict for each block; with `vertical` / `slash` counts, the blocks the
  top lines cross. The sink columns and the local diagonal (`window`) are always kept.
- "grid" (video): a query token of a video frame keeps the same spatial position in every earlier frame of its
  video (a slash every `stride` tokens when frames follow each other; frames may also be separate placeholder runs
  with text between them, as Qwen3-VL's timestamps or InternVL's "FrameN:" labels), plus the text before the video,
  the sink and the local window; query blocks holding any text token stay dense.

This module plans (which blocks); `vtoken.adapters.sparse_prefill` runs the plans inside the model through
transformers' AttentionInterface, and `vtoken.kernels.block_sparse_attention` computes them. Plans are
(counts [B, H, Qb] int32, index [B, H, Qb, K] int32): per query block, how many key blocks, and which (ascending);
entries past a count are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from vtoken.kernels import block_mask_from_plan
from vtoken.kernels.block_sparse_flex import flex_unavailable
from vtoken.kernels.line_sums import line_sums
from vtoken.kernels.sparse_speed import BreakEven

from ..errors import VTokenError
from ..params import Choice, Int, OrNone, Param, Real
from .base import Method

PATTERNS = ("a_shape", "vertical_slash", "grid")
BACKENDS = ("auto", "triton", "flex", "torch")
ESTIMATE_ROWS = 64  # query rows the vertical-slash estimate reads (the last ones of the prompt)
DEFAULT_MIN_LENGTH = 32768  # below ~32k tokens attention is too small a share of the prefill to gain much
DEFAULT_WINDOW = {"a_shape": 1024, "vertical_slash": 64, "grid": 64}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SparsePrefill(Method):
    """Block-sparse attention in the LLM prefill (see the module docstring for the patterns).

    pattern: "a_shape", "vertical_slash" (default) or "grid". density: vertical_slash's fraction of causal key
    blocks computed per query block, in (0, 1] (default 0.1; 1.0 runs the model's own attention, the identity).
    vertical / slash: instead of density, the number of vertical lines and slashes kept per head.
    sink: leading tokens every query sees (default 64). window: local band in tokens (default 1024 for a_shape,
    64 otherwise). block_size: the tile in tokens (a power of two, 16..256; default 64). min_length: prompts
    shorter than this run the model's own dense attention (default 32768). layers: LLM layer indices made sparse
    (default all). backend: "auto" (on CUDA the faster of the Triton kernel and FlexAttention, measured once per
    shape class; elsewhere the PyTorch reference, or FlexAttention once the reference's dense scores grow large),
    "triton", "flex" (`torch.nn.attention.flex_attention`, compiled) or "torch" (the reference). break_even: True
    (default) runs the model's own attention wherever the recorded speed model of the device
    (`vtoken.kernels.sparse_speed`) predicts no gain at the prompt's length and the plan's density; False leaves
    the choice to min_length alone; or a `BreakEven` of your own measurements.
    Decoding steps and prompts with a cached prefix always use the model's own attention. Token indices (sink,
    frames, blocks) count from each row's first real token: left padding does not move a row's pattern.
    """

    pattern: str = "vertical_slash"
    density: float | None = None
    vertical: int | None = None
    slash: int | None = None
    sink: int = 64
    window: int | None = None
    block_size: int = 64
    min_length: int = DEFAULT_MIN_LENGTH
    layers: Sequence[int] | None = None
    backend: str = "auto"
    break_even: bool | BreakEven = True

    name = "sparse_prefill"
    stages: ClassVar[tuple[str, ...]] = ("sparse",)
    params = {
        "pattern": Choice(PATTERNS),
        "density": OrNone(Real("(0, 1]", hint="vertical_slash's fraction of causal key blocks per query block")),
        "vertical": OrNone(Int(0, hint="vertical lines kept per head")),
        "slash": OrNone(Int(0, hint="slashes kept per head")),
        "sink": Int(0, hint="leading tokens every query sees"),
        "window": OrNone(Int(1, hint="the local band in tokens; None: the pattern's default")),
        "block_size": Choice((16, 32, 64, 128, 256), hint="the tile in tokens"),
        "min_length": Int(1, hint="prompts shorter than this run dense"),
        "layers": OrNone(Param(hint="LLM layer indices made sparse; None: all")),
        "backend": Choice(BACKENDS),
        "break_even": Param(
            hint="True: the device's recorded break-even model decides where sparse attention gains; False: "
            "min_length alone; or a vtoken.kernels.sparse_speed.BreakEven of your own measurements"
        ),
    }
    controls = ("pattern", "density", "sink", "block_size", "min_length")
    # its defaults run dense below 32k tokens: a demo prompt is far shorter
    demo_params = {"sink": 4, "block_size": 16, "min_length": 64}

    def __post_init__(self) -> None:
        super().__post_init__()
        where = "sparse_prefill"
        lines = self.vertical is not None or self.slash is not None
        if self.pattern != "vertical_slash" and (lines or self.density is not None):
            raise VTokenError(
                f"{where}: density / vertical / slash apply to pattern='vertical_slash'; {self.pattern} is set by "
                "sink and window" + (" (and the frame stride)" if self.pattern == "grid" else "")
            )
        if lines and self.density is not None:
            raise VTokenError(f"{where}: give either density or vertical/slash counts, not both")
        if lines and not (self.vertical or self.slash):
            raise VTokenError(f"{where}: vertical={self.vertical!r}, slash={self.slash!r}; keep at least one line")
        if self.layers is not None:
            layers = self.layers
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence | range):
                raise VTokenError(f"{where}: layers={layers!r}; expected a list of LLM layer indices (or None: all)")
            if not layers or not all(_is_int(i) and i >= 0 for i in layers):
                raise VTokenError(f"{where}: layers={list(layers)!r}; expected layer indices >= 0")
            self.layers = tuple(sorted(set(layers)))
        if self.backend == "triton":
            try:
                import triton  # noqa: F401
            except ImportError as error:
                raise VTokenError(f"{where}: backend='triton' needs triton; install vtoken[kernels]") from error
        if self.backend == "flex" and flex_unavailable() is not None:
            raise VTokenError(f"{where}: backend='flex': {flex_unavailable()}")
        if not isinstance(self.break_even, (bool, BreakEven)):
            raise VTokenError(
                f"{where}: break_even={self.break_even!r}; expected True (the recorded speed model), False (min_length "
                "alone) or a vtoken.kernels.sparse_speed.BreakEven"
            )

    # ----------------------------------------------------------------- resolved settings
    @property
    def local(self) -> int:
        """The local window in tokens."""
        return self.window if self.window is not None else DEFAULT_WINDOW[self.pattern]

    @property
    def resolved_density(self) -> float | None:
        """vertical_slash's density (None in line mode)."""
        if self.pattern != "vertical_slash" or self.vertical is not None or self.slash is not None:
            return None
        return 0.1 if self.density is None else float(self.density)

    @property
    def is_identity(self) -> bool:
        """density 1.0 computes every causal block: the model's own attention runs instead."""
        return self.resolved_density == 1.0

    def check_layers(self, num_layers: int) -> tuple[int, ...]:
        """The sparse layer indices of an LLM with `num_layers` layers (raises if some do not exist)."""
        if self.layers is None:
            return tuple(range(num_layers))
        missing = [i for i in self.layers if i >= num_layers]
        if missing:
            raise VTokenError(
                f"sparse_prefill: layers {missing} do not exist; this LLM has {num_layers} layers (0..{num_layers - 1})"
            )
        return tuple(self.layers)

    # ----------------------------------------------------------------- planning
    def plan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
        video: list[list[torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The block plan of one layer and the kernel's element-level window (0: none).

        q: [B, H, S, d] rotary applied; k: [B, Hkv, S, d]; key_valid: [B, S] or None; every row's real tokens
        start at column 0 (the caller aligns left-padded rows). video: for "grid", per row, per video, [F, 2]
        (start, end) columns of its frames. Returns (counts, index, window).
        """
        batch, heads, seq = q.shape[:3]
        block = self.block_size
        if self.pattern == "a_shape":
            counts, index = a_shape_plan(seq, block, self.sink, self.local, q.device)
            return counts.expand(batch, heads, -1), index.expand(batch, heads, -1, -1), self.local
        if self.pattern == "grid":
            mask = frame_grid_blocks(seq, block, video, self.sink, self.local, q.device)
            counts, index = plan_from_block_mask(mask[:, None])
            return counts.expand(-1, heads, -1), index.expand(-1, heads, -1, -1), 0
        rows = estimate_rows(key_valid, batch, seq, q.device)
        vertical, slash = vertical_slash_scores(q, k, rows, key_valid, scale)
        mandatory = a_shape_blocks(seq, block, self.sink, self.local, q.device)
        widest = a_shape_count(-(-seq // block) - 1, block, self.sink, self.local)  # the last row keeps the most
        if self.resolved_density is not None:
            counts, index = density_plan(vertical, slash, block, self.resolved_density, mandatory, widest)
        else:
            mask = line_blocks(vertical, slash, block, self.vertical or 0, self.slash or 0, mandatory)
            lines = (self.vertical or 0) + 2 * (self.slash or 0)  # a column crosses one block per row, a diagonal two
            counts, index = plan_from_block_mask(mask, width=min(widest + lines, mask.shape[-1]))
        return counts, index, 0

    def planned_density(self, seq: int, video: list[list[torch.Tensor]] | None = None) -> float:
        """The share of causal key blocks a plan at `seq` tokens computes, known before planning, on the host (no
        device work): exact for a_shape and density plans, an upper bound with vertical / slash counts, and for
        "grid" the mean over the rows of `video` (their frame layout, read to the host)."""
        block = self.block_size
        n = -(-seq // block)
        rows = np.arange(n)
        band_start = np.maximum((rows * block - self.local + 1) // block, 0)  # as `a_shape_counts`, in numpy
        mandatory = np.minimum(-(-self.sink // block), band_start) + rows - band_start + 1
        if self.pattern == "a_shape":
            counts = mandatory
        elif self.pattern == "grid":
            if not video:
                return 1.0
            host = [[frames.cpu() for frames in row] for row in video]
            grid = frame_grid_blocks(seq, block, host, self.sink, self.local)
            counts = grid.sum(-1).double().mean(0).numpy()
        elif self.resolved_density is not None:
            counts = np.maximum(np.ceil(self.resolved_density * (rows + 1.0)).astype(np.int64), mandatory)
        else:
            counts = mandatory + (self.vertical or 0) + 2 * (self.slash or 0)
        return float(np.minimum(counts, rows + 1).sum()) / (n * (n + 1) / 2)


# --------------------------------------------------------------------- plan builders (pure tensor functions)
def plan_from_block_mask(mask: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., Qb, Kb] bool -> counts [..., Qb] int32 and index [..., Qb, K] int32 (the listed blocks ascending,
    K = `width`, at least the largest count (None: the largest count, read from the device); entries past a count
    are other blocks, never read)."""
    counts = mask.sum(-1)
    if width is None:
        width = max(int(counts.max()), 1)
    order = (~mask).to(torch.int8).argsort(dim=-1, stable=True)[..., :width]
    return counts.to(torch.int32), order.to(torch.int32)


def causal_blocks(seq: int, block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[Qb, Kb] bool: key blocks at or below the diagonal."""
    n = -(-seq // block)
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def a_shape_blocks(seq: int, block: int, sink: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[Qb, Kb] bool: the blocks holding a key j <= i with j < sink or i - j < window for some query i."""
    n = -(-seq // block)
    qb = torch.arange(n, device=device)[:, None]
    kb = torch.arange(n, device=device)[None, :]
    sinks = kb * block < sink
    # the block's first query row reaches back to key qb*block - window + 1
    band = (kb + 1) * block - 1 >= qb * block - window + 1
    return (sinks | band) & (kb <= qb)


def a_shape_count(qb: int, block: int, sink: int, window: int) -> int:
    """How many key blocks query block `qb` keeps under the A-shape (host arithmetic; the count never decreases
    with qb, so the last block's is the widest)."""
    band_start = max(0, (qb * block - window + 1) // block)
    return min(-(-sink // block), band_start) + qb - band_start + 1


def a_shape_counts(
    seq: int, block: int, sink: int, window: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qb] the key blocks each query block keeps under the A-shape, and [Qb] where its band starts."""
    n = -(-seq // block)
    qb = torch.arange(n, device=device)
    band_start = torch.div(qb * block - window + 1, block, rounding_mode="floor").clamp(min=0)
    sinks = torch.minimum(torch.full_like(qb, -(-sink // block)), band_start)  # sink blocks below the band
    return sinks + qb - band_start + 1, band_start


def a_shape_plan(
    seq: int, block: int, sink: int, window: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan of `a_shape_blocks` built directly (no sort, no host sync): counts [Qb], index [Qb, K] ascending."""
    n = -(-seq // block)
    counts, band_start = a_shape_counts(seq, block, sink, window, device)
    sinks = counts - (torch.arange(n, device=device) - band_start + 1)
    t = torch.arange(a_shape_count(n - 1, block, sink, window), device=device)[None, :]
    index = torch.where(t < sinks[:, None], t, band_start[:, None] + t - sinks[:, None])
    index = torch.where(t < counts[:, None], index, 0)
    return counts.to(torch.int32), index.to(torch.int32)


def estimate_rows(key_valid: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
    """[B, R] the last R = min(64, S) real query rows of every sequence (repeated when a row has fewer)."""
    count = min(ESTIMATE_ROWS, seq)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    if key_valid is None:
        return positions[:, seq - count :].contiguous()
    ranked = torch.where(key_valid.bool(), positions, -1).topk(count, dim=1).values.flip(1)
    last = ranked[:, -1:].clamp(min=0)
    return torch.where(ranked < 0, last, ranked)


def vertical_slash_scores(
    q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, key_valid: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the estimation rows, summed along columns and along diagonals.

    q: [B, H, S, d]; k: [B, Hkv, S, d]; rows: [B, R]. Returns vertical [B, H, S] (mean attention a row pays to key
    j) and slash [B, H, S] (mean attention a row pays to the key `o` positions before it, o = 0..S-1), fp32.
    """
    batch, heads, seq, dim = q.shape
    valid = key_valid.bool() if key_valid is not None else torch.ones(batch, seq, dtype=torch.bool, device=q.device)
    q_rows = q.gather(2, rows[:, None, :, None].expand(-1, heads, -1, dim))
    return line_sums(q_rows, k, rows, valid, scale)  # the rows' probabilities summed by column and by diagonal


def density_blocks(
    vertical: torch.Tensor, slash: torch.Tensor, block: int, density: float, mandatory: torch.Tensor
) -> torch.Tensor:
    """[B, H, Qb, Kb] bool: the blocks of `density_plan`."""
    counts, index = density_plan(vertical, slash, block, density, mandatory)
    return block_mask_from_plan(counts, index, mandatory.shape[-1])


def density_plan(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    block: int,
    density: float,
    mandatory: torch.Tensor,
    mandatory_max: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query block keeps ceil(density * its causal blocks) key blocks (at least `mandatory` [Qb, Kb]),
    ranked by the attention mass per row the lines predict: the vertical mass of the key block plus the slash
    mass crossing it (a diagonal at offset o crosses block pair (qb, kb) on block - |o - (qb-kb)*block| of its
    rows). vertical, slash: [B, H, S] from `vertical_slash_scores`; mandatory_max: the most mandatory blocks of any
    row when the caller knows it (None: read from the device). Returns counts [B, H, Qb], index [B, H, Qb, K]."""
    batch, heads, seq = vertical.shape
    n = -(-seq // block)
    column_mass = F.pad(vertical, (0, n * block - seq)).view(batch, heads, n, block).sum(-1)  # [B, H, Kb]
    # diagonal block t = qb - kb: triangle-weighted window of slash offsets around t * block
    padded = F.pad(slash, (block - 1, n * block + block - seq))
    windows = padded.unfold(-1, 2 * block - 1, block)[..., :n, :]  # [B, H, n, 2*block-1]
    u = torch.arange(2 * block - 1, device=slash.device)
    weight = (block - (u - (block - 1)).abs()).float() / block
    diagonal_mass = (windows * weight).sum(-1)  # [B, H, n]
    qb = torch.arange(n, device=slash.device)[:, None]
    kb = torch.arange(n, device=slash.device)[None, :]
    offset = (qb - kb).clamp(min=0)
    scores = column_mass[:, :, None, :] + diagonal_mass[:, :, offset]
    scores = scores.masked_fill(mandatory, float("inf")).masked_fill(kb > qb, float("-inf"))
    budget = torch.ceil(density * (qb[:, 0] + 1).double()).long()  # [Qb]
    budget = torch.maximum(budget, mandatory.sum(-1)).clamp(max=n)
    if mandatory_max is None:
        mandatory_max = int(mandatory.sum(-1).max())
    width = min(max(math.ceil(density * n), mandatory_max), n)  # the last row's budget is the largest
    top = scores.topk(width, dim=-1).indices  # [B, H, Qb, K], best first
    rank = torch.arange(top.shape[-1], device=top.device)
    listed = rank < budget[:, None]
    index = torch.where(listed, top, n).sort(dim=-1).values  # the listed blocks ascending, then n
    index = torch.where(listed, index, 0)
    return budget.to(torch.int32).expand(batch, heads, n), index.to(torch.int32)


def line_blocks(
    vertical: torch.Tensor, slash: torch.Tensor, block: int, num_vertical: int, num_slash: int, mandatory: torch.Tensor
) -> torch.Tensor:
    """[B, H, Qb, Kb]: the blocks the top `num_vertical` columns and top `num_slash` diagonals cross, plus
    `mandatory` [Qb, Kb]."""
    batch, heads, seq = vertical.shape
    n = -(-seq // block)
    qb = torch.arange(n, device=vertical.device)
    mask = mandatory.expand(batch, heads, n, n).clone()
    if num_vertical:
        columns = vertical.topk(min(num_vertical, seq), dim=-1).indices  # [B, H, V]
        hit = torch.zeros(batch, heads, n, dtype=torch.bool, device=vertical.device)
        hit.scatter_(-1, columns // block, True)
        mask |= hit[:, :, None, :]
    if num_slash:
        offsets = slash.topk(min(num_slash, seq), dim=-1).indices  # [B, H, L]
        # rows qb*block .. qb*block + block - 1 at offset o read keys from (qb*block - o) to (qb*block + block-1 - o)
        first = torch.div(qb[None, None, :, None] * block - offsets[:, :, None, :], block, rounding_mode="floor")
        for kb in (first, first + 1):
            ok = (kb >= 0) & (kb <= qb[None, None, :, None])
            spill = torch.zeros(batch, heads, n, n + 1, dtype=torch.bool, device=vertical.device)
            spill.scatter_(-1, torch.where(ok, kb, n), True)
            mask |= spill[..., :n]
    return mask & torch.ones(n, n, dtype=torch.bool, device=vertical.device).tril()


def grid_blocks(seq: int, block: int, span: torch.Tensor, stride: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[B, Qb, Kb]: `frame_grid_blocks` of one video per row whose frames follow each other: the video's span
    [B, 2] (start, end) cut into frames of `stride` [B] tokens."""
    videos = []
    for (start, end), step in zip(span.tolist(), stride.tolist(), strict=True):
        step = max(int(step), 1)
        starts = torch.arange(start, end - step + 1, step)
        videos.append([torch.stack([starts, starts + step], 1)] if end - start >= step else [])
    return frame_grid_blocks(seq, block, videos, sink, window, span.device)


def frame_grid_blocks(
    seq: int, block: int, videos: list[list[torch.Tensor]], sink: int, window: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[B, Qb, Kb] bool: for query blocks whose every token belongs to a video frame, the key blocks holding the
    same spatial position (offset in the frame) in every earlier frame of that video, every block before the
    video's first frame (the text before it), the sink and the local window; other query blocks keep every causal
    block. videos: per row, per video, [F, 2] (start, end) columns of its frames in order."""
    n = -(-seq // block)
    base = a_shape_blocks(seq, block, sink, window, device)
    causal = causal_blocks(seq, block, device)
    masks = []
    for row in videos:
        mask = base.clone()
        in_frame = torch.zeros(n * block, dtype=torch.bool, device=device)
        for frames in row:
            frames = frames.to(device=device, dtype=torch.long)
            first = int(frames[0, 0])
            lengths = frames[:, 1] - frames[:, 0]
            for f in range(len(frames)):
                start, length = int(frames[f, 0]), int(lengths[f])
                in_frame[start : start + length] = True
                query_blocks = torch.arange(start, start + length, device=device) // block
                if first > 0:  # the text before the video
                    mask[query_blocks.min() : query_blocks.max() + 1, : (first - 1) // block + 1] = True
                if f == 0:
                    continue
                offsets = torch.arange(length, device=device)
                same = offsets[None, :] < lengths[:f, None]  # [f, length]: earlier frames holding that position
                keys = (frames[:f, :1] + offsets[None, :]) // block
                queries = query_blocks[None, :].expand_as(keys)
                mask[queries[same], keys[same]] = True
        inside = in_frame.view(n, block).all(1)
        masks.append(torch.where(inside[:, None], mask, causal) & causal)
    return torch.stack(masks)


def attention_share(seq_len: int, hidden: int = 3584, intermediate: int = 18944, kv_ratio: float = 4 / 28) -> float:
    """Share `a` of a decoder layer's prefill FLOPs spent in causal attention (QK^T and PV) at `seq_len` tokens, for
    a Qwen2-7B-shaped layer by default (projections with grouped KV heads, SwiGLU MLP)."""
    projections = 2 * hidden * hidden * (2 + 2 * kv_ratio)  # q, o and the k, v projections, per token
    mlp = 2 * 3 * hidden * intermediate
    attention = 2 * 2 * hidden * seq_len / 2  # QK^T and PV over half the keys on average (causal)
    return attention / (attention + projections + mlp)


def prefill_bound(share: float, density: float) -> float:
    """Whole-prefill speedup bound 1 / (1 - a + a * rho) at attention share `a` and density `rho`."""
    return 1 / (1 - share + share * density)
