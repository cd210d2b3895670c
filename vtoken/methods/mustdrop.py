"""MustDrop: multi-stage visual-token dropping (Liu et al.; official code liuting20/MustDrop).

Three stages, composed:
- Encoder: after ViT layer 0 the patch grid is cut into non-overlapping 3x3 windows (row-major); a window's score
  is the mean cosine similarity over its 9*8 ordered token pairs. Windows scoring >= `merge_threshold` merge into
  one token (the plain mean of the 9); r = the smallest such count over the batch's crops, the top-r windows
  by score merge. New sequence: [CLS, merged tokens by descending score, tokens of unmerged windows ascending];
  the remaining ViT layers run on it. The key set is the top ceil(key_rate * N') tokens by the [CLS] attention
  of the last ViT layer (head mean); no later stage drops them.
- Prefill: after each LLM layer in `layers`, with A the layer's post-softmax attention (head mean) from the text
  tokens after the image to the current visual tokens, visual token j is dropped iff
  sum_t A[t, j] < global_thr * sum_j' sum_t A[t, j'] and max_t A[t, j] < individual_thr (key set kept).
  Later layers get contiguous renumbered positions (official), or `positions="original"`.
- Decode: after the prefill, the KV caches of layers first..last drop layer are cut to the visual tokens that
  survived every drop (layers before the first drop keep everything; later ones already hold the final set).
The threshold defaults (1.0, 0.0) drop nothing in the prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import VTokenError
from ..geometry.tables import on_device
from ..params import Choice, Layers, Real
from ..tokens import LayerTokens, Selection, VisualTokens
from .base import PrefillMethod, droppable_layers, keep_top

POSITIONS = ("renumber", "original")


class TowerMerge:
    """MustDrop's merge inside a vision tower, for one call's crops (`groups`: crops per image, in order), as the
    method supplies it: the adapter calls it on the output [C, 1 + N, D] ([CLS] first) of tower layer
    `after_layer`, runs the later layers with `attention_mask` (the key padding of images that merged less than the
    longest; None when every crop has the same length), and reads `valid` [C, N'] (real patch tokens) and
    `key_valid` [C, 1 + N'] afterwards. Every crop of the call runs in one tower batch: the counts per image (r, the
    windows at or above the threshold) are the stage's one host read."""

    def __init__(self, method: MustDrop, grid: tuple[int, int], groups: list[int]):
        method.check_grid(grid)
        self.method, self.grid, self.groups = method, grid, groups
        self.after_layer = method.merge_after_layer
        self.attention_mask: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None
        self.lengths: list[int] = []

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        """[C, 1 + N, D] -> [C, 1 + N', D]: [CLS, merged windows by descending score, the others' tokens ascending],
        right-padded with zeros to the longest crop."""
        cls, patches = output[:, :1], output[:, 1:]
        crops, device = patches.shape[0], patches.device
        plan = self.method.plan_merge(patches, self.grid, self.groups)
        size = plan.window_tokens.shape[1]
        merged, unmerged = plan.merged, plan.unmerged
        windows = patches[:, plan.window_tokens]  # [C, W, 9, D]
        means = windows.gather(1, merged[:, :, None, None].expand(-1, -1, size, patches.shape[-1])).mean(dim=2)
        real = torch.arange(merged.shape[1], device=device) < on_device(plan.counts, device)[:, None]
        flags = torch.cat([torch.ones(crops, 1, dtype=torch.bool, device=device), real, unmerged >= 0], 1)
        self.lengths = [1 + patches.shape[1] - (size - 1) * r for r in plan.counts]
        width = max(self.lengths)
        sources = packed_rows(flags, width, self.lengths)  # [C, 1 + N'] (-1: padding)
        rest = patches.gather(1, unmerged.clamp(min=0)[:, :, None].expand(-1, -1, patches.shape[-1]))
        candidates = torch.cat([cls, means, rest], 1)
        out = candidates.gather(1, sources.clamp(min=0)[:, :, None].expand(-1, -1, candidates.shape[-1]))
        self.key_valid = sources >= 0
        self.valid = self.key_valid[:, 1:]
        if any(n != width for n in self.lengths):
            out = out.masked_fill(~self.key_valid[:, :, None], 0.0)
            blocked = torch.zeros(crops, 1, 1, width, dtype=output.dtype, device=device)
            blocked = blocked.masked_fill(~self.key_valid[:, None, None, :], torch.finfo(output.dtype).min)
            self.attention_mask = blocked.expand(-1, 1, width, width)
        return out


@dataclass
class WindowMerge:
    """The encoder-stage merge of a batch of crops.

    merged: [C, r] merged windows, by descending score (window w covers grid rows 3*(w // cols)...);
    unmerged: [C, N - 9r] ascending token indices of the windows left alone; scores: [C, num_windows]. Crops of
    images that merge different numbers (`counts`: windows merged per crop) pad both on the right (merged: with
    their next windows by score, unmerged: with -1); `apply` needs one count for all.
    """

    merged: torch.Tensor
    unmerged: torch.Tensor
    scores: torch.Tensor
    window_tokens: torch.Tensor  # [num_windows, window*window] token indices of every window
    counts: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.merged.shape[1] + self.unmerged.shape[1]

    def apply(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [C, N, D] -> [C, r + N - 9r, D]: merged means, then the unmerged tokens."""
        windows = patches[:, self.window_tokens]  # [C, num_windows, 9, D]
        chosen = windows.gather(1, self.merged[:, :, None, None].expand(-1, -1, *windows.shape[2:]))
        rest = patches.gather(1, self.unmerged[:, :, None].expand(-1, -1, patches.shape[-1]))
        return torch.cat([chosen.mean(dim=2), rest], dim=1)


def window_tokens(grid: tuple[int, int], window: int, device=None) -> torch.Tensor:
    """[num_windows, window**2] raster token indices of each window, windows and their tokens row-major."""
    rows, cols = grid
    index = torch.arange(rows * cols, device=device).view(rows // window, window, cols // window, window)
    return index.permute(0, 2, 1, 3).reshape(-1, window * window)


def window_similarity(patches: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """[C, num_windows] mean pairwise cosine similarity of each window's tokens over ordered pairs i != j."""
    x = F.normalize(patches[:, windows].float(), dim=-1, eps=1e-8)  # [C, W, n, D]
    n = windows.shape[1]
    sims = x @ x.transpose(-1, -2)
    off_diagonal = sims.sum(dim=(-1, -2)) - sims.diagonal(dim1=-2, dim2=-1).sum(-1)
    return off_diagonal / (n * (n - 1))


def plan_merge(
    patches: torch.Tensor, grid: tuple[int, int], window: int, threshold: float, groups: list[int] | None = None
) -> WindowMerge:
    """Which windows of crops [C, N, D] merge: one r for the crops of each image (`groups`: crops per image; None:
    every crop is one image's), the smallest count of windows at or above `threshold` among them. The counts are
    read back once (the merge's one host sync); everything else is a fixed burst."""
    crops, count = patches.shape[:2]
    device = patches.device
    windows = window_tokens(grid, window, device)
    scores = window_similarity(patches, windows)
    above = (scores >= threshold).sum(dim=1).tolist()  # the one host read
    counts, first = [], 0
    for n in groups if groups is not None else [crops]:
        counts += [min(above[first : first + n])] * n
        first += n
    most = max(counts, default=0)
    merged = scores.topk(most, dim=1).indices  # descending score
    real = torch.arange(most, device=device) < on_device(counts, device)[:, None]
    taken = torch.zeros(crops, scores.shape[1] + 1, dtype=torch.bool, device=device)
    taken = taken.scatter_(1, merged.masked_fill(~real, scores.shape[1]), True)[:, :-1]  # [C, W]
    size = windows.shape[1]
    token_taken = torch.zeros(crops, count, dtype=torch.bool, device=device)
    token_taken[:, windows.flatten()] = taken.repeat_interleave(size, dim=1, output_size=taken.shape[1] * size)
    left = [count - size * r for r in counts]
    unmerged = packed_rows(~token_taken, max(left, default=0), left)
    return WindowMerge(merged, unmerged, scores, windows, counts)


def packed_rows(flags: torch.Tensor, width: int, counts: list[int]) -> torch.Tensor:
    """[C, width] ascending indices of each row's set `flags` [C, N], right-padded with -1 (`counts`: set per row)."""
    rank = flags.long().cumsum(1) - 1
    target = rank.masked_fill(~flags, width)
    slots = torch.full((flags.shape[0], width + 1), -1, dtype=torch.long, device=flags.device)
    source = torch.arange(flags.shape[1], device=flags.device).expand(flags.shape[0], -1)
    return slots.scatter_(1, target, source)[:, :width]


def dual_attention_filter(tokens: LayerTokens, global_thr: float, individual_thr: float) -> torch.Tensor:
    """[B, V] bool: visual tokens kept by MustDrop's dual-attention filter (key set not yet added)."""
    attention = tokens.attention.float()  # [B, R, V], zero on padded rows / tokens
    total = attention.sum(dim=1)  # [B, V] global attention of each token
    peak = attention.masked_fill(~tokens.row_valid[:, :, None], float("-inf")).amax(dim=1)
    # kept: not (below the global share and below the individual threshold)
    return ((total >= global_thr * total.sum(dim=1, keepdim=True)) | (peak >= individual_thr)) & tokens.valid


@dataclass
class MustDrop(PrefillMethod):
    """Encoder merge + key set, prefill dual-attention filter, decode KV cut (see the module docstring)."""

    merge_threshold: float = 0.8
    key_rate: float = 0.08
    layers: tuple[int, ...] = (2, 6, 10, 14)
    global_thr: float = 1.0
    individual_thr: float = 0.0
    positions: str = "renumber"

    name = "mustdrop"
    stages = ("encoder", "prefill", "decode")
    requires = ("tower_merge", "cls_attention@-1")
    query_rows = "text"
    params = {
        "merge_threshold": Real(
            hint="the windows' mean cosine similarity from which they merge, e.g. 0.8; above 1 none merge"
        ),
        "key_rate": Real("(0, 1]", hint="the key set's share, e.g. 0.08"),
        "layers": Layers("(2, 6, 10, 14)"),
        "global_thr": Real("[0, 1]", hint="e.g. 0.001"),
        "individual_thr": Real("[0, 1]", hint="e.g. 0.001"),
        "positions": Choice(POSITIONS),
    }
    layouts = ("native", "official")
    merges = True
    controls = ("layers", "global_thr", "individual_thr", "merge_threshold", "key_rate")
    demo_params = {"global_thr": 0.01, "individual_thr": 0.01}  # its own defaults drop none in the prefill
    window: ClassVar[int] = 3
    merge_after_layer: ClassVar[int] = 0

    @classmethod
    def fit(cls, model) -> dict:
        """The official layers the LLM has room for (a drop after each, scored by a softmax-attention layer), else
        the last such layer."""
        scored = droppable_layers(model)
        if not scored:
            return {}
        return {"layers": tuple(k for k in cls.defaults()["layers"] if k in scored) or (scored[-1],)}

    # ----------------------------------------------------------------- encoder
    def check_grid(self, grid: tuple[int, int]) -> None:
        """Raise unless a crop's (rows, cols) patch grid tiles into windows (adapters call this at `patch`)."""
        if grid[0] % self.window or grid[1] % self.window:
            raise VTokenError(
                f"mustdrop: a {grid[0]}x{grid[1]} patch grid cannot be cut into {self.window}x"
                f"{self.window} windows; it needs both sides divisible by {self.window} (e.g. "
                "CLIP-L/14 at 336 px: 24x24)"
            )

    def plan_merge(self, patches: torch.Tensor, grid: tuple[int, int], groups: list[int] | None = None) -> WindowMerge:
        """The merge after ViT layer 0 for crops [C, N, D] on `grid` (`groups`: crops per image, one r each)."""
        self.check_grid(grid)
        return plan_merge(patches, grid, self.window, self.merge_threshold, groups)

    def tower_merge(self, grid: tuple[int, int], groups: list[int]) -> TowerMerge:
        """The merge inside the vision tower for one call's crops (`groups`: crops per image), for the adapter to
        apply after tower layer `merge_after_layer` (see `TowerMerge`)."""
        return TowerMerge(self, grid, groups)

    def planned_count(self, n: int) -> None:
        return None  # the merge decides from the data

    def select(self, tokens: VisualTokens) -> Selection:
        """Keep every (merged) token; mark the key set by the last ViT layer's [CLS] attention."""
        scores = tokens.signals["cls_attention@-1"].float()  # [C, N'] (crops of other images: padded)
        valid = tokens.valid if tokens.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        lengths = valid.sum(1).tolist() if tokens.valid is not None else [tokens.num_tokens] * tokens.num_crops
        counts = [math.ceil(self.key_rate * n) for n in lengths]  # as torch.ceil of the float64 product
        protected = keep_top(scores.masked_fill(~valid, float("-inf")), counts)
        kept = torch.arange(tokens.num_tokens, device=scores.device).expand(tokens.num_crops, -1)
        if tokens.valid is None:
            return Selection(kept=kept, protected=protected)
        return Selection(kept=kept, counts=lengths, protected=protected)

    # ----------------------------------------------------------------- prefill and decode
    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layers[-1] >= num_layers - 1:
            raise VTokenError(
                f"mustdrop: layers={self.layers} needs drop points before the last layer; this LLM has "
                f"{num_layers} layers (0..{num_layers - 1})"
            )
        return self.layers

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        return dual_attention_filter(tokens, self.global_thr, self.individual_thr)

    def cut_layers(self, drop_layers: tuple[int, ...]) -> range:
        return range(drop_layers[0], drop_layers[-1] + 1)
