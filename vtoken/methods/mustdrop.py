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

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import VTokenError
from ..params import Choice, Layers, Real
from ..tokens import LayerTokens, Selection, VisualTokens
from .base import PrefillMethod, droppable_layers, topk_mask

POSITIONS = ("renumber", "original")


@dataclass
class WindowMerge:
    """The encoder-stage merge of a batch of crops.

    merged: [C, r] merged windows, by descending score (window w covers grid rows 3*(w // cols)...);
    unmerged: [C, N - 9r] ascending token indices of the windows left alone; scores: [C, num_windows].
    """

    merged: torch.Tensor
    unmerged: torch.Tensor
    scores: torch.Tensor
    window_tokens: torch.Tensor  # [num_windows, window*window] token indices of every window

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


def plan_merge(patches: torch.Tensor, grid: tuple[int, int], window: int, threshold: float) -> WindowMerge:
    """Which windows of crops [C, N, D] merge (one r for every crop)."""
    windows = window_tokens(grid, window, patches.device)
    scores = window_similarity(patches, windows)
    r = int((scores >= threshold).sum(dim=1).min())
    merged = scores.topk(r, dim=1).indices  # descending score
    taken = torch.zeros_like(scores, dtype=torch.bool).scatter(1, merged, True)  # [C, W]
    token_taken = torch.zeros(patches.shape[:2], dtype=torch.bool, device=patches.device)
    token_taken[:, windows.flatten()] = taken.repeat_interleave(windows.shape[1], dim=1)
    unmerged = (~token_taken).nonzero()[:, 1].view(patches.shape[0], -1)
    return WindowMerge(merged, unmerged, scores, windows)


def dual_attention_filter(tokens: LayerTokens, global_thr: float, individual_thr: float) -> torch.Tensor:
    """[B, V] bool: visual tokens kept by MustDrop's dual-attention filter (key set not yet added)."""
    attention = tokens.attention.float()  # [B, R, V], zero on padded rows / tokens
    total = attention.sum(dim=1)  # [B, V] global attention of each token
    peak = attention.masked_fill(~tokens.row_valid[:, :, None], float("-inf")).amax(dim=1)
    drop = (total < global_thr * total.sum(dim=1, keepdim=True)) & (peak < individual_thr)
    return ~drop & tokens.valid


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

    def plan_merge(self, patches: torch.Tensor, grid: tuple[int, int]) -> WindowMerge:
        """The merge after ViT layer 0 for crops [C, N, D] on `grid`."""
        self.check_grid(grid)
        return plan_merge(patches, grid, self.window, self.merge_threshold)

    def planned_count(self, n: int) -> None:
        return None  # the merge decides from the data

    def select(self, tokens: VisualTokens) -> Selection:
        """Keep every (merged) token; mark the key set by the last ViT layer's [CLS] attention."""
        scores = tokens.signals["cls_attention@-1"].float()  # [C, N'] (crops of other images: padded)
        valid = tokens.valid if tokens.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        lengths = valid.sum(1)
        counts = torch.ceil(self.key_rate * lengths.double()).long().tolist()
        protected = topk_mask(scores.masked_fill(~valid, float("-inf")), counts)
        kept = torch.arange(tokens.num_tokens, device=scores.device).expand(tokens.num_crops, -1)
        if tokens.valid is None:
            return Selection(kept=kept, protected=protected)
        return Selection(kept=kept, counts=lengths.tolist(), protected=protected)

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
