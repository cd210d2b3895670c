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
Step 2 runs as the custom op `vtoken::duplicate_removal` (`vtoken.kernels.duplicates`): every crop in one Triton
launch on CUDA after one exact-fp32 Gram matrix; its PyTorch reference, one crop at a time, elsewhere. Counts come
from the host-side valid counts: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtoken.kernels.duplicates import deduplicate, duplicate_removal

from ..budget import Budget
from ..params import Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, valid_mask

__all__ = ["VisPruner", "deduplicate"]


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
        n, device = tokens.num_tokens, scores.device
        valid = valid_mask(tokens, device)
        # invalid tokens sort last and are never residual candidates
        order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        counts = [self.keep_count(v) if v else 0 for v in tokens.host_valid_counts()]
        important_counts = [int(c * self.important_ratio) for c in counts]  # Python's int(), as the official code
        # the same counts on the device, from the same data
        size = valid.sum(1)
        count = self.keep_counts(size)
        important = torch.floor(count.double() * self.important_ratio).long()
        # the residual of crop c is order[c, important_c:size_c]
        shifted = (torch.arange(n, device=device) + important[:, None]).clamp(max=max(n - 1, 0))
        diverse_width = max(max((c - i for c, i in zip(counts, important_counts, strict=True)), default=0), 1)
        diverse = duplicate_removal(tokens.signals["vision_features"], order.gather(1, shifted), size - important,
                                    count - important, diverse_width)  # fmt: skip
        first = max(important_counts, default=0)
        chosen = torch.where(torch.arange(first, device=device) < important[:, None], order[:, :first], n)
        width = max(max(counts, default=0), 1)
        kept = torch.cat([chosen, diverse], dim=1).sort(dim=-1).values[:, :width]
        return Selection(kept=kept, counts=counts)  # padded with N past each count
