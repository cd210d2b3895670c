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

Every crop is selected and merged at once on the device (D and C per crop from the host-side valid counts and,
on the device, from the same counts): no host sync, no loop over crops. Cosines are products summed over the key
channels, so a crop's assignments do not depend on the other crops of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget, tokens_to_keep, tokens_to_keep_tensor
from ..errors import VTokenError
from ..params import Int, Kept, OrNone
from ..tokens import CLS, MERGED, Selection, VisualTokens
from .base import EncoderMethod, valid_mask

OFFICIAL = (54, 10)  # dominant, contextual


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

    def splits(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`split` of every crop's n [C] on n's device: (D, C) as tensors, the host's arithmetic."""
        if self.budget is None:
            return torch.full_like(n, self.dominant), torch.full_like(n, self.contextual)
        total = tokens_to_keep_tensor(self.budget, n).clamp(min=1)  # a crop of no tokens: (1, 0), as `split(0)`
        contextual = torch.floor((total * OFFICIAL[1]).double() / sum(OFFICIAL) + 0.5).long()
        return total - contextual, contextual

    def select(self, tokens: VisualTokens) -> Selection:
        scores = tokens.signals["cls_attention"].float()
        keys, features = tokens.signals["keys"], tokens.features
        cls = tokens.signals.get("cls_token")
        crops, n, device = tokens.num_crops, tokens.num_tokens, features.device
        valid = valid_mask(tokens, device)
        # host: what every crop sends (its shape); device: the same from the same counts
        sizes = tokens.host_valid_counts()
        host_splits = [self.split(size) for size in sizes]
        counts = [size if sum(split) >= size else sum(split) for size, split in zip(sizes, host_splits, strict=True)]
        slots = max(max((c for (d, c), size in zip(host_splits, sizes, strict=True) if d + c < size), default=0), 1)
        size = valid.sum(1)
        dominant, contextual = self.splits(size)
        # crops of at most D + C valid tokens send them all, unchanged, without [CLS] (the host knows which)
        any_kept_all = any(sum(split) >= n_valid for split, n_valid in zip(host_splits, sizes, strict=True))
        keep_all = (dominant + contextual >= size)[:, None] if any_kept_all else None
        patches = dominant - 1 if cls is not None else dominant
        # dominant: the top patches by [CLS] attention (stable: the lower index first on ties)
        order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=device).expand(crops, n))
        is_dominant = rank < patches[:, None]
        remaining = valid & ~is_dominant
        if keep_all is not None:
            is_dominant, remaining = is_dominant & ~keep_all, remaining & ~keep_all
        # contextual: targets at every step-th remaining token, the others merged into the closest target
        position = remaining.cumsum(1, dtype=torch.long) - 1  # in the ascending list of remaining tokens
        step = ((size - patches) // contextual.clamp(min=1)).clamp(min=1)[:, None]
        slot = position // step
        is_target = remaining & (position % step == 0) & (slot < contextual[:, None])
        target = torch.full((crops, slots + 1), n, device=device).scatter_(
            1, torch.where(is_target, slot, slots), torch.arange(n, device=device).expand(crops, n)
        )[:, :slots]  # [C, slots] token index of every target (n: none)
        has_target = target < n
        target = target.clamp(max=max(n - 1, 0))
        unit = F.normalize(keys.float(), dim=-1)
        unit_targets = unit.gather(1, target[..., None].expand(-1, -1, unit.shape[-1]))
        similarity = (unit[:, :, None, :] * unit_targets[:, None, :, :]).sum(-1)  # [C, N, slots]
        assign = similarity.masked_fill(~has_target[:, None, :], float("-inf")).argmax(-1)  # the first on ties
        member = (
            (assign[..., None] == torch.arange(slots, device=device)) & (remaining > is_target)[..., None]
        ).float()
        features32 = features.float()
        sums = torch.bmm(member.transpose(1, 2), features32)
        rows = features32.gather(1, target[..., None].expand(-1, -1, features.shape[-1]))
        merged = rows + sums / member.sum(1).clamp(min=1)[..., None]
        # output rows: [CLS], dominant ascending, contextual in target order; kept-all crops: valid tokens
        width = max(counts, default=0)
        offset = 1 if cls is not None else 0
        token_place = torch.where(is_dominant, is_dominant.cumsum(1, dtype=torch.long) + (offset - 1), width)
        merged_place = torch.where(
            has_target, patches[:, None] + torch.arange(offset, slots + offset, device=device), width
        )
        cls_place = torch.zeros(crops, 1, dtype=torch.long, device=device)
        if keep_all is not None:
            token_place = torch.where(keep_all, torch.where(valid, valid.cumsum(1, dtype=torch.long) - 1, width),
                                      token_place)  # fmt: skip
            merged_place = torch.where(keep_all, width, merged_place)
            cls_place = torch.where(keep_all, width, cls_place)
        sources = [features, merged.to(features.dtype)]
        places = [token_place, merged_place]
        origins = [torch.arange(n, device=device).expand(crops, n), torch.full((crops, slots), MERGED, device=device)]
        if cls is not None:
            sources.insert(0, cls[:, None].to(features.dtype))
            places.insert(0, cls_place)
            origins.insert(0, torch.full((crops, 1), CLS, device=device))
        place = torch.cat(places, dim=1)
        out = features.new_zeros(crops, width + 1, features.shape[-1]).scatter_(
            1, place[..., None].expand(-1, -1, features.shape[-1]), torch.cat(sources, dim=1)
        )[:, :width]
        origin = torch.full((crops, width + 1), MERGED, dtype=torch.long, device=device).scatter_(
            1, place, torch.cat(origins, dim=1)
        )[:, :width]
        return Selection(features=out, counts=None if len(set(counts)) == 1 else counts, origin=origin)
