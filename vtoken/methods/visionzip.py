"""VisionZip: dominant tokens by [CLS] attention plus contextual tokens merged from the rest (Yang et al.,
"VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025; official code
dvlab-research/VisionZip).

Per crop of N patches, with D dominant and C contextual tokens (`dominant=54, contextual=10`, official):

1. Dominant: the top D - 1 patches by head-mean [CLS] attention at the feature layer, ascending, after the
   crop's [CLS] token, which counts among the D and reaches the LLM (the official behaviour). On models whose
   LLM cannot take the [CLS] token (InternVL's pixel shuffle, PerceptionLM's pooling projector) the top D
   patches are dominant, so a crop still sends D + C tokens.
2. Contextual: the R remaining patches, ascending; their keys at the feature layer (mean over heads),
   L2-normalised. Targets: positions arange(0, R, max(1, R // C))[:C] of that list; every other remaining patch
   goes to the target of highest cosine (the first on ties). A contextual token = the target's feature + the
   mean feature of its assignees (target *plus* mean; a target without assignees stays as it is), in fp32.
3. Output per crop: [CLS, dominant ascending, contextual in target order], D + C tokens, before the projector.

A crop of N <= D + C tokens passes every patch unchanged and no [CLS] (vtoken's rule: a count >= N keeps all N).
`budget=` instead of (dominant, contextual) sets D + C per crop (a count, or a fraction of the crop's tokens),
split as the official settings (54 + 10, 108 + 20, 162 + 30): C = round(total * 10 / 64), D = total - C.
Records report the dominant patches as kept; `tokens_out` is D + C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget, tokens_to_keep
from ..errors import VTokenError
from ..params import Int, Kept, OrNone
from ..tokens import CLS, MERGED, Selection, VisualTokens
from .base import EncoderMethod

OFFICIAL = (54, 10)  # dominant, contextual


def contextual_tokens(features: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """VisionZip's merge of one crop's R remaining tokens (ascending) into `count` contextual tokens.

    features [R, Dv], keys [R, d] -> [count, Dv] in fp32: target + mean of the tokens assigned to it. (One crop
    at a time: a batched matmul rounds a crop's cosines differently in different batches.)
    """
    remaining = features.shape[0]
    step = max(1, remaining // count)
    is_target = torch.zeros(remaining, dtype=torch.bool, device=features.device)
    is_target[torch.arange(0, remaining, step, device=features.device)[:count]] = True
    unit = F.normalize(keys.float(), dim=-1)
    similarity = unit[~is_target] @ unit[is_target].T  # [R - count, count]
    assign = F.one_hot(similarity.argmax(-1), count).float()  # argmax: the first target on ties
    sums = assign.T @ features[~is_target].float()
    return features[is_target].float() + sums / assign.sum(0).clamp(min=1)[:, None]


@dataclass
class VisionZip(EncoderMethod):
    """`dominant` (D, [CLS] included) and `contextual` (C) tokens per crop; or `budget`: D + C per crop."""

    budget: Budget | None = None
    dominant: int | None = None
    contextual: int | None = None

    name = "visionzip"
    requires = ("cls_attention", "keys")
    uses = ("cls_token",)  # sent first where the model can take it
    scopes = ("crop",)
    params = {
        "budget": OrNone(Kept(hint="D + C per crop, split 54:10 as the official settings")),
        "dominant": OrNone(Int(1, hint="tokens kept by [CLS] attention per crop, [CLS] included")),
        "contextual": OrNone(Int(0, hint="merged tokens per crop")),
    }
    layouts = ("native", "official")
    official_packing = ("newline after base-only image",)
    merges = True
    controls = ("budget",)
    budget_alternatives = ("dominant", "contextual")  # the CLI sets no default budget when one is given

    def __post_init__(self) -> None:
        if self.budget is not None and (self.dominant is not None or self.contextual is not None):
            raise VTokenError(
                f"visionzip: budget={self.budget!r} with dominant={self.dominant!r}, "
                f"contextual={self.contextual!r}; give either the budget (D + C per crop, split 54:10 as the "
                "official settings) or dominant/contextual"
            )
        super().__post_init__()
        if self.budget is None:
            dominant, contextual = OFFICIAL
            self.dominant = dominant if self.dominant is None else self.dominant
            self.contextual = contextual if self.contextual is None else self.contextual

    def split(self, n: int) -> tuple[int, int]:
        """(D, C) of a crop of n tokens."""
        if self.budget is None:
            return self.dominant, self.contextual
        total = tokens_to_keep(self.budget, n)
        contextual = math.floor(total * OFFICIAL[1] / sum(OFFICIAL) + 0.5)
        return total - contextual, contextual

    def keep_count(self, n: int) -> int:
        """Tokens a crop of n sends to the LLM: D + C, or all n when D + C >= n."""
        return min(sum(self.split(n)), n)

    def planned_count(self, n: int) -> int | None:
        return self.keep_count(n)

    def select(self, tokens: VisualTokens) -> Selection:
        scores = tokens.signals["cls_attention"].float()
        keys, features = tokens.signals["keys"], tokens.features
        cls = tokens.signals.get("cls_token")
        device = features.device
        valid = tokens.valid if tokens.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        valid = valid.to(device)
        order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        sizes = valid.sum(1).tolist()
        rows: list[torch.Tensor] = [features.new_empty(0, features.shape[-1])] * tokens.num_crops
        origins: list[torch.Tensor] = [torch.empty(0, dtype=torch.long, device=device)] * tokens.num_crops
        for size in sorted(set(sizes)):  # crops with as many valid tokens run as one batch
            crops = [c for c in range(tokens.num_crops) if sizes[c] == size]
            dominant, contextual = self.split(size)
            if dominant + contextual >= size:  # keep all: every valid token, unchanged, no [CLS]
                for c in crops:
                    index = valid[c].nonzero().squeeze(1)
                    rows[c], origins[c] = features[c, index], index
                continue
            patches = dominant - 1 if cls is not None else dominant
            picked = order[crops, :patches].sort(dim=-1).values  # [G, patches]
            rest = valid[crops].scatter(1, picked, False)
            remaining = rest.nonzero()[:, 1].view(len(crops), size - patches)  # ascending per crop
            group = torch.arange(len(crops), device=device)[:, None]
            parts = [features[crops][group, picked]]
            if contextual:
                merged = [contextual_tokens(features[c, remaining[i]], keys[c, remaining[i]], contextual)
                          for i, c in enumerate(crops)]  # fmt: skip
                parts.append(torch.stack(merged).to(features.dtype))
            if cls is not None:
                parts.insert(0, cls[crops][:, None].to(features.dtype))
            out = torch.cat(parts, dim=1)
            marks = [torch.full((len(crops), 1), CLS, device=device)] if cls is not None else []
            marks += [picked, torch.full((len(crops), contextual), MERGED, device=device)]
            origin = torch.cat(marks, dim=1)
            for i, c in enumerate(crops):
                rows[c], origins[c] = out[i], origin[i]
        counts = [len(r) for r in rows]
        width = max(counts)
        merged = features.new_zeros(tokens.num_crops, width, features.shape[-1])
        origin = torch.full((tokens.num_crops, width), MERGED, dtype=torch.long, device=device)
        for c, (r, o) in enumerate(zip(rows, origins, strict=True)):
            merged[c, : len(r)], origin[c, : len(o)] = r, o
        return Selection(features=merged, counts=None if len(set(counts)) == 1 else counts, origin=origin)
