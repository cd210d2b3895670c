"""SCOPE: saliency-weighted coverage greedy ("SCOPE: Saliency-Coverage Oriented Token Pruning for
Efficient Multimodel LLMs", NeurIPS 2025; official code kinredon/SCOPE). Written from vtoken's METHODS-4-images.md.

Per crop of N tokens with features x (the feature layer's patch hidden states, before the projector) and saliency
s (the [CLS] row's attention at the feature layer, head mean), in fp32:

    x^ = x / max(|x|, 1e-12);  C = max(x^ x^T, 0)  [N, N];  w = s ** alpha;  m = 0  [N]
    T steps: g_j = w_j * sum_i max(C_ij - m_i, 0) over all rows i, for unpicked j (picked: -inf);
             j* = argmax g (the first index on ties); m <- max(m, C[j*, :])

a greedy on the facility-location coverage f(S) = sum_i max_{j in S} max(cos_ij, 0), each gain weighted by the
token's saliency. When every gain is 0 (all covered, or zero saliency) the lowest unpicked index follows, as the
official. Kept: the T picks, ascending. Invalid tokens (LLaVA-NeXT's unpadded border in the native layout) are
neither candidates nor rows to cover, and T is capped at a crop's valid tokens.

The T steps are inherently sequential: they run as the custom op `vtoken::greedy_weighted_coverage`
(`vtoken.kernels.coverage`, the step kernel MMTok's greedy shares: one Triton launch per step over every crop on
CUDA, the PyTorch reference elsewhere); C is one batched matmul. No host sync: counts from the budget and the
host valid counts.

`saliency="received"` (AngelSlim's Qwen form, a documented variant for towers without [CLS]): s = the attention
each token receives in the feature layer's block (Qwen: the last full-attention block, per merge group), x = the
projected tokens. `scope="split"`: an image's budget shared equally by its crops (the official LLaVA-NeXT run: 160
per image on 5 crops, 32 each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vtoken.kernels.coverage import greedy_weighted_coverage

from ..budget import Budget
from ..params import Choice, Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, valid_mask

if TYPE_CHECKING:
    from ..modelview import ModelView

SALIENCY = {"cls": ("cls_attention", "vision_features"), "received": ("received_attention", "projected")}


def coverage_of(features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """C = max(cos, 0) of every crop's tokens [B, N, D] -> [B, N, N] fp32, rows of invalid tokens ([B, N] False)
    zero (nothing to cover there)."""
    x = features.float()
    unit = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return (unit @ unit.transpose(1, 2)).clamp_(min=0).mul_(valid[..., None])


@dataclass
class SCOPE(EncoderMethod):
    """`budget`: tokens kept per crop (scope "crop") or per image shared equally by its crops ("split"), a count
    or a fraction; official 64 on LLaVA-1.5, 160 per image on LLaVA-NeXT (scope="split", layout="official").
    `alpha` >= 0: the saliency's exponent (official env ALPHA, 1.0). `saliency`: "cls" (official) or "received"
    (AngelSlim's form for towers without [CLS])."""

    budget: Budget = 64
    alpha: float = 1.0
    saliency: str = "cls"
    scope: str = "crop"

    name = "scope"
    scopes = ("crop", "split")
    modalities = ("image",)
    params = {
        "alpha": Real("[0, inf)", hint="the saliency's exponent"),
        "saliency": Choice(tuple(SALIENCY), hint="'cls' official; 'received' for towers without [CLS]"),
    }
    layouts = ("native", "official")
    controls = ("budget", "alpha", "saliency", "scope")

    @property
    def requires(self) -> tuple[str, ...]:
        return SALIENCY[self.saliency]

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """The received-attention saliency (`saliency="received"`, AngelSlim's form) where there is no [CLS] but the
        tower serves it (the Qwen towers, OneVision, Gemma 3)."""
        if "cls_attention" not in model.signals and "received_attention" in model.signals:
            return {"saliency": "received"}
        return {}

    def missing_signal_hint(self, missing: list[str]) -> str:
        if "cls_attention" in missing:
            return (
                'SCOPE\'s saliency is [CLS] attention; saliency="received" is the documented variant for towers '
                "without [CLS]"
            )
        if "received_attention" in missing:
            return (
                "saliency='received' reads the attention tokens receive in a tower block's softmax, which this tower "
                "does not expose (FastVLM's FastViTHD has no attention maps)"
            )
        return ""

    def select(self, tokens: VisualTokens) -> Selection:
        saliency, features = (tokens.signals[name] for name in self.requires)
        device = features.device
        valid = valid_mask(tokens, device)
        counts = self.crop_counts(tokens)
        limit = self.crop_counts_tensor(valid, tokens)
        weight = saliency.to(device).float().clamp(min=0).pow(self.alpha)
        width = max(max(counts, default=0), 1)
        picks = greedy_weighted_coverage(coverage_of(features, valid), weight, ~valid, limit, width)
        return Selection(kept=picks.sort(dim=-1).values, counts=None if all(k == width for k in counts) else counts)
