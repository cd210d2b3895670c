"""HiRED: high-resolution early dropping (Arif et al.; official code hasanar1f/HiRED), for anyres LLaVA-NeXT.

The image's token budget is split between the base view and the sub-images by [CLS] attention in an *early*
layer of the base view, then every crop keeps its share by [CLS] attention in the *final* (feature) layer. Both
scores are head-summed post-softmax [CLS]->patch attention (the same ranking as the head mean). For P crops of N
tokens, in this order and with these floors:

    total = int(P * N * rate);  full = min(int(total * alpha), N);  sub = min(total - full, (P - 1) * N)
    marked = top int(N * (1 - alpha)) base-view tokens by the early score; count_i = marked tokens in region i
    budget_i = min(int(count_i / sum(count) * sub), N)   (remainders are lost)

Region i is, in the official code, the i-th contiguous chunk of N / (rows * cols) raster-ordered base-view tokens
(`partition="bands"`, the default; horizontal bands for a 2 x 2 grid), in the paper the base-view tile that
matches sub-image i (`partition="tiles"`). A single-crop image (LLaVA-1.5) keeps the top min(N, int(N * rate)).

Every image's budgets are computed at once on the device (`device_counts`); how many tokens each crop keeps
depends on the early attention, so the counts are read back once: the one host sync HiRED's definition costs
(none for single-crop images, whose counts follow from N). `partition="tiles"` also copies each image's grid to the
device. An image with several crops must be in `crop_grid`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import Budget, check_budget
from ..params import Choice, Int, Kept, OrNone, Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, image_slots, topk_per_crop, valid_mask

PARTITIONS = ("bands", "tiles")
TOWER_LAYER = "a vision-tower layer index; negative counts from the end"


@dataclass
class HiRED(EncoderMethod):
    """`budget` (alias `rate`): fraction of the image's tokens kept, default 0.2. `alpha`: share of the base view."""

    budget: Budget = 0.2
    scope: str = "image"
    rate: float | None = None
    alpha: float = 0.5
    partition: str = "bands"
    layer_early: int = 0
    layer_final: int | None = None

    name = "hired"
    scopes = ("image",)  # HiRED splits each image's budget across its crops by design
    params = {
        "budget": Kept(counts=False),
        "rate": OrNone(Kept(counts=False, hint="another name for budget")),
        "alpha": Real("[0, 1]", hint="the base view's share of the budget"),
        "partition": Choice(PARTITIONS),
        "layer_early": Int(hint=TOWER_LAYER),
        "layer_final": OrNone(Int(hint=TOWER_LAYER + "; or None")),
    }
    layouts = ("native", "official")
    official_packing = ("unpad after selection",)  # it selects over the padded crops, then unpads
    controls = ("budget", "alpha", "partition")

    def __post_init__(self) -> None:
        if self.rate is not None:
            self.budget = check_budget(self.rate, "hired: rate")
        super().__post_init__()
        self.rate = self.budget

    @property
    def requires(self) -> tuple[str, ...]:
        final = "cls_attention" if self.layer_final is None else f"cls_attention@{self.layer_final}"
        return (f"cls_attention@{self.layer_early}", final)

    def single_crop_requires(self) -> tuple[str, ...]:
        """The signals it needs on images of one crop each: the final layer's only (no budget split)."""
        return self.requires[-1:]

    def planned_count(self, n: int) -> int | None:
        return None

    def count_before_encoding(self, n: int, grid: tuple[int, int], crops: int = 1) -> int | None:
        # a single-crop image keeps min(N, int(N * rate)); anyres shares follow the early-layer attention
        return min(n, int(n * self.rate)) if crops == 1 else None

    def regions(self, height: int, width: int, rows: int, cols: int) -> torch.Tensor:
        """[height * width] region index of every base-view token."""
        tokens = torch.arange(height * width)
        if self.partition == "bands":
            return (tokens // ((height * width) // (rows * cols))).clamp(max=rows * cols - 1)
        y, x = tokens // width, tokens % width
        return (y * rows // height) * cols + x * cols // width

    def crop_budgets(self, early_base: torch.Tensor, rows: int, cols: int, height: int, width: int) -> list[int]:
        """Tokens kept by [base view, sub-image 1, ...] of one image (before clipping to valid tokens)."""
        n, crops = height * width, 1 + rows * cols
        total = int(crops * n * self.rate)
        full = min(int(total * self.alpha), n)
        sub = min(total - full, (crops - 1) * n)
        marked = early_base.topk(int(n * (1 - self.alpha))).indices.cpu()
        count = torch.bincount(self.regions(height, width, rows, cols)[marked], minlength=rows * cols).tolist()
        whole = sum(count)
        return [full] + [min(int(c / whole * sub), n) if whole else 0 for c in count]

    def device_counts(self, tokens: VisualTokens, valid: torch.Tensor) -> torch.Tensor:
        """[C] tokens every crop keeps, for anyres images (`crop_grid`): `crop_budgets` of every image at once on
        the device, the same integer and IEEE double arithmetic, clipped to each crop's valid tokens."""
        crops, n = valid.shape
        device = valid.device
        slot = image_slots(tokens, device)
        crop_index = tokens.crop_index.to(device)
        per_image = torch.zeros(crops, dtype=torch.long, device=device).index_add_(0, slot, torch.ones_like(slot))
        parts = per_image[slot]  # 1 + rows * cols of every crop's image
        base = (
            torch.full((crops,), -1, dtype=torch.long, device=device)
            .scatter_reduce(0, slot, torch.where(crop_index == 0, torch.arange(crops, device=device), -1), "amax")[slot]
            .clamp(min=0)
        )  # every crop's image's base view
        early = tokens.signals[self.requires[0]].float()[base]
        marked = early.topk(int(n * (1 - self.alpha))).indices  # [C, m]
        subs = (parts - 1).clamp(min=1)
        height, width = tokens.grid
        if self.partition == "bands":
            region = (marked // (n // subs)[:, None]).minimum(subs[:, None] - 1)
        else:  # the image's grid, copied from the host
            table = torch.tensor([tokens.crop_grid.get(i, (1, 1)) for i in range(max(tokens.crop_grid) + 1)])
            grid = table.to(device, non_blocking=True)[tokens.image_index.to(device).clamp(max=len(table) - 1)]
            rows, cols = grid[:, :1], grid[:, 1:]
            region = ((marked // width) * rows // height) * cols + (marked % width) * cols // width
        regions = max(rows * cols for rows, cols in tokens.crop_grid.values())
        count = torch.zeros(crops, regions, dtype=torch.long, device=device).scatter_add_(
            1, region.clamp(max=regions - 1), torch.ones_like(region)
        )
        whole = count.sum(1, keepdim=True)
        total = torch.floor((parts * n).double() * self.rate).long()
        full = torch.floor(total.double() * self.alpha).long().clamp(max=n)
        sub = torch.minimum(total - full, (parts - 1) * n)
        share = torch.floor(count.double() / whole.clamp(min=1).double() * sub[:, None].double()).long().clamp(max=n)
        share = torch.where(whole > 0, share, 0)
        mine = share.gather(1, (crop_index - 1).clamp(min=0, max=regions - 1)[:, None]).squeeze(1)
        budget = torch.where(crop_index == 0, full, mine).minimum(valid.sum(1))
        return torch.where(parts > 1, budget, min(n, int(n * self.rate)))

    def select(self, tokens: VisualTokens) -> Selection:
        final = tokens.signals[self.requires[1]].float()
        valid = valid_mask(tokens, final.device)
        final = final.masked_fill(~valid, float("-inf"))
        # single-crop images (LLaVA-1.5, video frames): min(N, int(N * rate)) from the shapes alone
        if not tokens.crop_grid:
            return topk_per_crop(final, [min(tokens.num_tokens, int(tokens.num_tokens * self.rate))] * len(final))
        counts = self.device_counts(tokens, valid)
        return topk_per_crop(final, counts.tolist(), counts)  # the one read: counts follow the early attention
