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
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop

BLOCK = 1024  # columns of D per block when finding each token's nearest other token


def nearest_other_distance(unit: torch.Tensor) -> torch.Tensor:
    """[L]: the second-smallest entry of every column of D = 1 - unit unit^T (each token's distance to its nearest
    other token; +inf when L < 2). unit [L, D] L2-normalised fp32; D is built BLOCK columns at a time."""
    length = unit.shape[0]
    if length < 2:
        return unit.new_full((length,), float("inf"))
    return torch.cat([(1 - unit @ unit[start : start + BLOCK].T).kthvalue(2, dim=0).values
                      for start in range(0, length, BLOCK)])  # fmt: skip


def max_min_diversity(features: torch.Tensor, count: int) -> torch.Tensor:
    """DivPrune's greedy picks for one image, in pick order: [count] indices of its tokens `features` [L, D].
    (One image at a time: a batched matmul rounds an image's distances differently in different batches.)"""
    unit = F.normalize(features.float(), dim=-1)
    first = nearest_other_distance(unit).argmax()  # the first maximum
    picks = [first]
    blocked = torch.zeros(len(unit), dtype=torch.bool, device=unit.device)
    blocked[first] = True
    closest = 1 - unit @ unit[first]  # [L] distance to the nearest pick
    for _ in range(count - 1):
        pick = closest.masked_fill(blocked, float("-inf")).argmax()
        picks.append(pick)
        blocked[pick] = True
        closest = torch.minimum(closest, 1 - unit @ unit[pick])
    return torch.stack(picks)


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
        rank = torch.full((tokens.num_crops, n), float("-inf"), device=features.device)
        for c, count in enumerate(counts):
            index = valid[c].nonzero().squeeze(1)
            if count == len(index):  # keep all
                rank[c, index] = 0.0
            elif count:
                picks = index[max_min_diversity(features[c, index], count)]
                rank[c, picks] = -torch.arange(count, device=features.device, dtype=torch.float)
        return topk_per_crop(rank, counts)
