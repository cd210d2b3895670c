"""DivPrune: keep the most diverse visual tokens, a greedy max-min diversity subset (Alvar et al., "DivPrune:
Diversity-based Visual Token Pruning for Large Multimodal Models", CVPR 2025). Implemented from the paper's
description and vtoken's METHODS-2.md only.

Candidates: an image's (or video's) visual tokens as the LLM would receive them: after the projector, packed by
the model's own layout, newline tokens included (`acts_on = "placed"`). For L candidates x_1..x_L, with
D[i, j] = 1 - cos(x_i, x_j) in fp32, and k = the budget of L:

    first pick  = argmax_j (second-smallest entry of column j of D)      (its distance to its nearest other token)
    next picks  = argmax_j min_{s in S} D[s, j] over the tokens not yet picked        (S: the tokens picked so far)

argmax takes the first index on ties. The k picks are kept in ascending order; a budget of L or more keeps all.
The greedy runs as the custom op `vtoken::max_min_diversity` (`vtoken.kernels.diversity`): every image of a call in
one Triton launch on CUDA after one exact-fp32 Gram matrix; its PyTorch reference elsewhere, where the
second-smallest distances are computed in column blocks and the greedy steps one row of D at a time (memory
O(L * block), not O(L^2)). Counts come from the host-side valid counts: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtoken.kernels.diversity import max_min_diversity

from ..budget import Budget
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, valid_mask


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
        valid = valid_mask(tokens, features.device)
        counts = [self.keep_count(v) if v else 0 for v in tokens.host_valid_counts()]
        picks = max_min_diversity(features, valid, self.keep_counts(valid.sum(1)), max(max(counts, default=0), 1))
        return Selection(kept=picks.sort(dim=-1).values, counts=counts)  # padded with N past each count
