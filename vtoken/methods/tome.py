"""ToMe: token merging inside the vision tower (Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023), as
LightCompress ports it to LLaVA's CLIP tower. Written from vtoken's METHODS-4-tower.md only (clean room).

In every block 0..F (F: the block whose output is the LLM's feature layer), between the attention and the MLP, on
the T tokens of every crop ([CLS] first where the tower has one, p = 1; else p = 0):

1. h = x + Attn(LN1(x)); with `prop_attn` the attention logits get + log s_j for every key j (s: how many
   original patches each token stands for; no bias before the first merge). The metric m = this block's keys
   k_proj(LN1(x)) split into heads, mean over heads [T, head_dim], divided by its norm (clamped at 1e-12).
2. r' = min(r_l, (T - p) // 2); nothing happens when r' <= 0.
3. Bipartite soft matching: A = tokens 0, 2, 4, ..., B = tokens 1, 3, 5, ...; S = m_A m_B^T with the [CLS] row at
   -inf; every A token's best score and its best B token (the first on ties). A is ranked by best score
   descending, ties by position (a stable sort; the official unstable `argsort` merges arbitrary tokens among
   tied scores): the top r' merge into their B token, the others stay, in ascending order.
4. `weighted`: B_j <- (s_j B_j + sum_{i -> j} s_i A_i) / (s_j + sum s_i), s_j += sum s_i (sizes carried across
   blocks from 1); without it (LightCompress): B_j <- the plain mean of B_j and its sources (weights 1 in that
   block). Sums in fp32, cast back to the model's dtype.
5. The sequence becomes [unmerged A, all of B] ([CLS] stays first), T -= r', and x = h' + MLP(LN2(h')).

What reaches the LLM is block F's output without [CLS]: N' = N - sum_{l <= F} r'_l tokens per crop, in the order
the merges left them (`order="merged"`, the official) or by their smallest source patch (`order="raster"`).
LLaVA-1.5 with r = 16: 577 -> 209 -> 208 tokens.

Schedules: `r` an int (every merging block), a list (block 0, 1, ...; missing blocks merge none), or
(r, inflection) as ToMe's `parse_r`. A `budget` (fraction or count of a crop's N patches) replaces `r`:
R = N - k merges, front-loaded: r_l = min(cap_l, ceil(R_left / (L - l))) (k = 64 of 576 over 23 blocks: 23 six
times, then 22). Everything here is a pure tensor function of shapes known on the host: per block a fixed burst
of kernels (one batched [C, T/2, T/2] product, a row max, a stable sort, gathers, one scatter-add per merged
quantity), no host sync. The adapter (`vtoken.adapters.tower`) replaces the blocks' forwards and calls these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..budget import Budget, tokens_to_keep
from ..errors import VTokenError
from ..params import Choice, Flag, Kept, MergeSchedule, OrNone
from .base import TowerMethod, TowerShape

ORDERS = ("merged", "raster")

QWEN_REFUSAL = (
    "its 2x2 patch merger concatenates 4 consecutive tower tokens into one LLM token, so merging single tokens "
    "breaks the groups; Qwen2.5-VL's window blocks fix windows from the patch grid, and the tower's 2-D rotary and "
    "the LLM's M-RoPE need one (h, w) per token (a group-level variant is unpublished). Use pixelprune, which "
    "drops whole 2x2 groups before the tower"
)


def parse_r(layers: int, r: int | list[int] | tuple[int, float]) -> list[int]:
    """Tokens to merge in each of `layers` blocks, as ToMe's `parse_r`: an int r everywhere; a list per block
    (missing blocks 0); (r, inflection): from lo = int(r * (1 - inflection)) to hi = 2r - lo, linearly,
    r_l = int(lo + (hi - lo) / (layers - 1) * l) (one block: [lo])."""
    if isinstance(r, list):
        return list(r) + [0] * (layers - len(r))
    inflection = 0.0
    if isinstance(r, tuple):
        r, inflection = r
    low = int(r * (1.0 - inflection))
    high = 2 * r - low
    if layers == 1:
        return [low]
    step = (high - low) / (layers - 1)
    return [int(low + step * layer) for layer in range(layers)]


def capped(tokens: int, schedule: list[int], cls: bool) -> list[int]:
    """The merges that happen, r'_l = min(r_l, (T_l - p) // 2) (at least 0), for crops of `tokens` tokens entering
    block 0 ([CLS] included where `cls`)."""
    out, current, p = [], tokens, int(cls)
    for r in schedule:
        step = max(0, min(r, (current - p) // 2))
        out.append(step)
        current -= step
    return out


def budget_schedule(tokens: int, keep: int, layers: int, cls: bool) -> list[int]:
    """A front-loaded schedule merging R = (tokens - p) - keep tokens over `layers` blocks: each block merges
    ceil(R_left / blocks left), capped at (T_l - p) // 2; exactly `keep` patches remain when the caps allow."""
    p = int(cls)
    left, current, out = max(tokens - p - keep, 0), tokens, []
    for layer in range(layers):
        step = min((current - p) // 2, math.ceil(left / (layers - layer))) if left > 0 else 0
        step = max(step, 0)
        out.append(step)
        left -= step
        current -= step
    return out


@dataclass
class Matching:
    """One block's bipartite matching of C crops of T tokens (A = even positions, B = odd positions).

    unmerged: [C, |A| - r] the A tokens that stay (indices into A, ascending); merged: [C, r] the A tokens that
    merge (by descending best score); targets: [C, r] the B token each merges into (indices into B)."""

    unmerged: torch.Tensor
    merged: torch.Tensor
    targets: torch.Tensor
    tokens: int

    @property
    def r(self) -> int:
        return self.merged.shape[1]

    def positions(self) -> torch.Tensor:
        """[C, T] every old token's index in the merged sequence [unmerged A, B]."""
        crops, kept = self.unmerged.shape
        device = self.unmerged.device
        a_size, b_size = (self.tokens + 1) // 2, self.tokens // 2
        new_a = torch.empty(crops, a_size, dtype=torch.long, device=device)
        new_a.scatter_(1, self.unmerged, torch.arange(kept, device=device).expand(crops, -1))
        new_a.scatter_(1, self.merged, self.targets + kept)
        out = torch.empty(crops, self.tokens, dtype=torch.long, device=device)
        out[:, 0::2] = new_a
        out[:, 1::2] = torch.arange(kept, kept + b_size, device=device)
        return out


def bipartite_matching(metric: torch.Tensor, r: int, cls: bool) -> Matching:
    """ToMe's bipartite soft matching of `metric` [C, T, d] (the block's keys, head mean), merging r tokens per
    crop (r <= (T - cls) // 2): cosine scores between A and B in fp32, [CLS] (token 0) never merged, A ranked by
    its best score with a stable sort (ties: the earlier token first)."""
    tokens = metric.shape[1]
    unit = metric.float()
    unit = unit / unit.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scores = unit[:, 0::2] @ unit[:, 1::2].transpose(1, 2)  # [C, |A|, |B|]
    if cls:
        scores[:, 0] = float("-inf")
    best, target = scores.max(dim=-1)  # the first maximum on ties
    ranked = best.argsort(dim=-1, descending=True, stable=True)
    merged = ranked[:, :r]
    unmerged = ranked[:, r:].sort(dim=-1).values
    return Matching(unmerged, merged, target.gather(1, merged), tokens)


def merge_tokens(
    x: torch.Tensor, matching: Matching, sizes: torch.Tensor | None, weighted: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [C, T, D] -> [C, T - r, D]: [unmerged A, B], every B token the (size-weighted with `weighted` and
    `sizes` [C, T], else plain) mean of itself and the A tokens merged into it, summed in fp32 and cast back.
    Returns the new sizes [C, T - r] too (None when `sizes` is None)."""
    a, b = x[:, 0::2], x[:, 1::2]
    width = x.shape[-1]
    keep = a.gather(1, matching.unmerged[:, :, None].expand(-1, -1, width))
    src = a.gather(1, matching.merged[:, :, None].expand(-1, -1, width)).float()
    targets = matching.targets
    new_sizes = None
    if sizes is not None:
        size_a, size_b = sizes[:, 0::2], sizes[:, 1::2]
        moved = size_a.gather(1, matching.merged)
        new_sizes = torch.cat([size_a.gather(1, matching.unmerged), size_b.scatter_add(1, targets, moved)], dim=1)
    if weighted and sizes is not None:
        weight_b, weight_src = size_b, moved
    else:
        weight_b = torch.ones(b.shape[:2], dtype=torch.float32, device=x.device)
        weight_src = torch.ones(targets.shape, dtype=torch.float32, device=x.device)
    total = (b.float() * weight_b[:, :, None]).scatter_add(
        1, targets[:, :, None].expand(-1, -1, width), src * weight_src[:, :, None]
    )
    norm = weight_b.scatter_add(1, targets, weight_src)
    merged_b = (total / norm[:, :, None]).to(x.dtype)
    return torch.cat([keep, merged_b], dim=1), new_sizes


@dataclass
class MergeState:
    """One tower call's merging, carried across blocks (one per call and thread: the adapter creates it when block
    0 starts). sizes: [C, T] fp32 original patches per token (None until needed: before the first merge, or never
    without `prop_attn`/`weighted`); sources: [C, T0] every input token's index in the current sequence; schedule:
    r'_l per merging block, from the shapes; done: the merges each block made (records)."""

    cls: bool
    schedule: list[int]
    sources: torch.Tensor
    sizes: torch.Tensor | None = None
    done: list[int] = field(default_factory=list)

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[C, 1, 1, T] log sizes, added to every query's logits (proportional attention); None before a merge."""
        return None if self.sizes is None else self.sizes.log().to(dtype)[:, None, None, :]

    def patch_sources(self) -> torch.Tensor:
        """[C, N] every original patch's output token (indices among the patch tokens, [CLS] excluded)."""
        p = int(self.cls)
        return self.sources[:, p:] - p


@dataclass
class ToMe(TowerMethod):
    """Merge `r` tokens per tower block (see the module). `budget` (fraction or count of a crop's patches) replaces
    `r` with a front-loaded schedule. `prop_attn=False, weighted=False` is LightCompress's variant (its VLM
    numbers). `order`: "merged" (the official compounded order) or "raster" (by smallest source patch)."""

    r: Any = 16
    budget: Budget | None = None
    prop_attn: bool = True
    weighted: bool = True
    order: str = "merged"

    name = "tome"
    acts = "layers"
    merges = True
    params = {
        "r": MergeSchedule(),
        "budget": OrNone(Kept(hint="of a crop's patch tokens; replaces r")),
        "prop_attn": Flag(hint="proportional attention: + log(size) on the attention logits"),
        "weighted": Flag(hint="size-weighted merges (False: plain means, LightCompress)"),
        "order": Choice(ORDERS, hint="the merged order (official) or raster order by smallest source"),
    }
    budget_param = "budget"
    budget_alternatives = ("r",)
    controls = ("r", "budget", "prop_attn", "weighted", "order")
    families = {
        "llava-1.5": "official (LightCompress): CLIP, every block up to the feature layer",
        "llava-next": "extension: every crop alike, flat layout (base crop then grid crops, no unpad, no newline)",
        "video-llava": "extension: images (the image tower)",
        "llava-onevision": "extension: SigLIP images (no [CLS], p = 0), layout='official' only: every crop alike, "
        "flat (base view then grid crops, no unpadding, downsampling or newline); videos refused (2x2 pooling after "
        "the tower)",
        "llava-next-video": "extension: images as LLaVA-NeXT (videos refused: 2x2 pooling after the tower)",
    }
    refusals: ClassVar[dict[str, str]] = {
        "qwen2-vl": QWEN_REFUSAL,
        "qwen2.5-vl": QWEN_REFUSAL,
        "qwen3-vl": QWEN_REFUSAL,
        "qwen3.5": QWEN_REFUSAL,
        "internvl": "its pixel shuffle folds the tower's token grid 2x2 after the tower; merged tokens have no grid",
        "gemma3": "it pools the tower's token grid 4x4 after the tower; merged tokens have no grid",
        "perception-lm": "it pools the tower's token grid 2x2 after the tower; merged tokens have no grid",
        "fastvlm": "its tower is convolutional (FastViTHD): there are no attention blocks to merge in",
    }
    positions = "renumber"

    def schedule(self, tokens: int, tower: TowerShape) -> list[int]:
        """r'_l for blocks 0..F of crops entering the tower with `tokens` tokens ([CLS] included where the tower
        has one): the merges that happen (host integers)."""
        layers = tower.merging_layers
        if layers < 1:
            raise VTokenError(
                f"tome: the LLM reads {tower.family}'s embeddings (no tower block before its feature layer); there "
                "is no block to merge in"
            )
        if self.budget is not None:
            return budget_schedule(tokens, tokens_to_keep(self.budget, tokens - int(tower.cls)), layers, tower.cls)
        if isinstance(self.r, list) and len(self.r) > layers:
            raise VTokenError(
                f"tome: r has {len(self.r)} entries, but {tower.family}'s tower merges in blocks 0..{layers - 1} "
                f"({layers}: the blocks up to its feature layer); give at most {layers}"
            )
        return capped(tokens, parse_r(layers, self.r), tower.cls)

    def count_before_encoding(
        self, grids: list[tuple[int, ...]], pixels: torch.Tensor | None = None, tower: TowerShape | None = None
    ) -> list[int]:
        """N - sum r'_l per crop of (H, W) patches: host integers only."""
        if tower is None:
            raise VTokenError("tome: count_before_encoding needs the tower (its depth to the feature layer, [CLS])")
        out = []
        for grid in grids:
            patches = math.prod(grid[-2:])
            out.append(patches - sum(self.schedule(patches + int(tower.cls), tower)))
        return out

    def start(self, x: torch.Tensor, tower: TowerShape) -> MergeState:
        """The merge state of a tower call whose block 0 gets x [C, T, D]."""
        crops, tokens = x.shape[:2]
        sources = torch.arange(tokens, device=x.device).expand(crops, -1)
        return MergeState(tower.cls, self.schedule(tokens, tower), sources)

    def merge_block(
        self, h: torch.Tensor, keys: torch.Tensor, heads: int, block: int, state: MergeState
    ) -> torch.Tensor:
        """Block `block`'s merge of h [C, T, D] (its output after the attention's residual), from the block's keys
        [C, T, heads * head_dim] (k_proj of LN1(x), bias included); updates `state`. At the last merging block
        with `order="raster"`, the tokens are put in the order of their smallest source patch."""
        r = state.schedule[block] if block < len(state.schedule) else 0
        if r > 0:
            crops, tokens = keys.shape[:2]
            metric = keys.view(crops, tokens, heads, -1).mean(dim=2)
            matching = bipartite_matching(metric, r, state.cls)
            tracked = self.prop_attn or self.weighted
            sizes = state.sizes
            if sizes is None and tracked:
                sizes = torch.ones(crops, tokens, dtype=torch.float32, device=h.device)
            h, sizes = merge_tokens(h, matching, sizes, self.weighted)
            state.sizes = sizes if tracked else None
            state.sources = matching.positions().gather(1, state.sources)
            state.done.append(r)
        elif block < len(state.schedule):
            state.done.append(0)
        if block == len(state.schedule) - 1 and self.order == "raster":
            h = self._raster(h, state)
        return h

    def _raster(self, h: torch.Tensor, state: MergeState) -> torch.Tensor:
        """Put the tokens of h [C, T', D] in the order of their smallest source ([CLS], source 0, stays first)."""
        crops, tokens = h.shape[:2]
        origin = torch.arange(state.sources.shape[1], device=h.device).expand(crops, -1)
        first = torch.full((crops, tokens), state.sources.shape[1], dtype=torch.long, device=h.device)
        first = first.scatter_reduce(1, state.sources, origin, reduce="amin")
        order = first.argsort(dim=1, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(tokens, device=h.device).expand(crops, -1))
        state.sources = rank.gather(1, state.sources)
        if state.sizes is not None:
            state.sizes = state.sizes.gather(1, order)
        return h.gather(1, order[:, :, None].expand(-1, -1, h.shape[-1]))
