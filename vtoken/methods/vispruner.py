"""VisPruner: important tokens by [CLS] attention, then diverse ones by similarity-based duplicate removal (Zhang
et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in VLMs", ICCV 2025;
official code Theia-4869/VisPruner).

Per crop of N tokens with a budget of T (`budget`; the official runs use 64, 128 or 192 of 576) and
T_imp = int(T * important_ratio), T_div = T - T_imp:

1. Sort the tokens by FasterVLM's score (head-mean [CLS] attention at the feature layer), descending. The first
   T_imp are the important tokens; the rest, in that order, is the residual.
2. Remove duplicates from the residual, on the L2-normalised pre-projector features, while
   r = min(8, R - T_div) > 0 (R = residual size): a = residual[0::2], b = residual[1::2] (positions in the
   current residual list); s_a = max over b of cos(a, b); the min(r, |a|) a-tokens with the highest s_a go; the
   residual becomes [the remaining a in descending-s_a order] + all of b.
3. Keep the important tokens and the residual (T in all), in ascending order.

The official code fails when the residual count is odd (its index shapes assume |a| = |b|, e.g. T = 22,
r = 0.5); here a has ceil(R/2) tokens, the intended behaviour. Sorts are stable (ties: the lower index first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..params import Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop


def deduplicate(unit: torch.Tensor, residual: torch.Tensor, keep: int) -> torch.Tensor:
    """VisPruner's iterative matching for one crop: residual token indices [R] (in attention order) -> [keep]
    after dropping near-duplicates; `unit` [N, D] the crop's L2-normalised features. (One crop at a time: a
    batched matmul rounds a crop's cosines differently in different batches, which would flip near-ties.)"""
    while keep > 0:
        step = min(8, len(residual) - keep)
        if step <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        similarity = (unit[a] @ unit[b].T).amax(-1)  # [|a|]
        order = similarity.argsort(descending=True, stable=True)[step:]  # the a-tokens that stay
        residual = torch.cat([a[order], b])
    return residual


@dataclass
class VisPruner(EncoderMethod):
    """`budget`: tokens kept per crop (a count, official 64/128/192 of 576) or a fraction. `important_ratio`: the
    share of the budget kept by [CLS] attention (official 0.5); the rest is kept for diversity."""

    budget: Budget = 64
    important_ratio: float = 0.5

    name = "vispruner"
    requires = ("cls_attention", "vision_features")
    scopes = ("crop",)
    params = {"important_ratio": Real("[0, 1]", hint="the share of the budget kept by [CLS] attention")}
    layouts = ("native", "official")
    controls = ("budget", "important_ratio")

    def select(self, tokens: VisualTokens) -> Selection:
        scores = tokens.signals["cls_attention"].float()
        features = tokens.signals["vision_features"]
        n = tokens.num_tokens
        valid = tokens.valid if tokens.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        valid = valid.to(scores.device)
        # invalid tokens sort last and are never residual candidates
        order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        sizes = valid.sum(1).tolist()
        counts = [self.keep_count(int(v)) if v else 0 for v in sizes]
        rank = torch.full((tokens.num_crops, n), float("-inf"), device=scores.device)
        for size, count in sorted(set(zip(sizes, counts, strict=True))):
            crops = [c for c in range(tokens.num_crops) if (sizes[c], counts[c]) == (size, count)]
            important = int(count * self.important_ratio)  # Python's int(), as the official code
            for c in crops:
                kept = order[c, :important]
                if count > important:
                    unit = F.normalize(features[c].float(), dim=-1)
                    kept = torch.cat([kept, deduplicate(unit, order[c, important:size], count - important)])
                rank[c, kept] = 1.0
        return topk_per_crop(rank, counts)
