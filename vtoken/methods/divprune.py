"""DivPrune: keep the most diverse visual tokens, a greedy max-min diversity subset (Alvar et al., "DivPrune:
Diversity-based Visual Token Pruning for Large Multimodal Models", CVPR 2025). Implemented from the paper's
description and vtoken's METHODS-2.md only.

Candidates: an image's (or video's) visual tokens as the LLM would receive them: after the projector, packed by
the model's own layout, newline tokens included (`acts_on = "placed"`). For L candidates x_1..x_L, with
D[i, j] = 1 - cos(x_i, x_j) in fp32, and k = the budget of L:

    first pick  = argmax_j (second-smallest entry of column j of D)      (its distance to its nearest other token)
    next picks  = argmax_j min_{s in S} D[s, j] over the tokens not yet picked        (S: the tokens picked so far)

argmax takes the first index on ties. The k picks are kept in ascending order; a budget of L or more keeps all.
The second-smallest distances are computed in column blocks, the greedy steps one row of D at a time: memory
O(L * block), not O(L^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..registry import register_method
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop

BLOCK = 1024  # columns of D per block when finding each token's nearest other token


def nearest_other_distance(unit: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L]: the second-smallest distance 1 - cos in each column of D over the valid rows (+inf where a column
    has fewer than two valid rows). unit [B, L, D] L2-normalised fp32, valid [B, L] bool."""
    batch, length = valid.shape
    if length < 2:
        return unit.new_full((batch, length), float("inf"))
    out = []
    for start in range(0, length, BLOCK):
        block = 1 - unit @ unit[:, start : start + BLOCK].transpose(1, 2)  # [B, L, b]
        block = block.masked_fill(~valid[:, :, None], float("inf"))
        out.append(block.kthvalue(2, dim=1).values)
    return torch.cat(out, dim=1)


def max_min_diversity(features: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
    """DivPrune's greedy picks, in pick order: [B, steps] indices of features [B, L, D] (valid [B, L] bool)."""
    unit = F.normalize(features.float(), dim=-1)
    batch = unit.shape[0]
    rows = torch.arange(batch, device=unit.device)
    first = nearest_other_distance(unit, valid).masked_fill(~valid, float("-inf")).argmax(-1)
    picks = [first]
    blocked = ~valid.clone()
    blocked[rows, first] = True
    closest = 1 - (unit @ unit[rows, first][:, :, None]).squeeze(-1)  # [B, L] min distance to the picks
    for _ in range(steps - 1):
        pick = closest.masked_fill(blocked, float("-inf")).argmax(-1)  # the first maximum
        picks.append(pick)
        blocked[rows, pick] = True
        closest = torch.minimum(closest, 1 - (unit @ unit[rows, pick][:, :, None]).squeeze(-1))
    return torch.stack(picks, dim=1)


@register_method
@dataclass
class DivPrune(EncoderMethod):
    """`budget`: tokens kept per image or video, a fraction of its placed tokens (official 0.098: 56 of LLaVA-1.5's
    576) or a count."""

    budget: Budget = 0.098
    scope: str = "image"

    name = "divprune"
    scopes = ("image",)
    acts_on = "placed"

    def planned_count(self, n: int) -> int | None:
        """n: the image's placed tokens (its placeholders in the prompt)."""
        return self.keep_count(n)

    def select(self, tokens: VisualTokens) -> Selection:
        """Every row of `tokens` is one image's placed tokens (padding marked invalid)."""
        features = tokens.features
        valid = tokens.valid if tokens.valid is not None else torch.ones(features.shape[:2], dtype=torch.bool)
        valid = valid.to(features.device)
        counts = [self.keep_count(int(v)) if v else 0 for v in valid.sum(1).tolist()]
        n = tokens.num_tokens
        rank = torch.full((tokens.num_crops, n + 1), float("-inf"), device=features.device)
        todo = [c for c, count in enumerate(counts) if 0 < count < int(valid[c].sum())]
        for c, count in enumerate(counts):
            if c not in todo and count:  # keep all
                rank[c, :n] = rank[c, :n].masked_fill(valid[c], 0.0)
        if todo:
            steps = max(counts[c] for c in todo)
            picks = max_min_diversity(features[todo], valid[todo], steps)
            order = torch.arange(steps, device=features.device)
            limit = torch.tensor([counts[c] for c in todo], device=features.device)[:, None]
            picks = torch.where(order < limit, picks, n)  # a crop keeps its first counts[c] picks
            rank[todo] = rank[todo].scatter(1, picks, -order.float().expand_as(picks))
        return topk_per_crop(rank[:, :n], counts)
