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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import Budget, check_budget
from ..params import Choice, Int, Kept, OrNone, Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop

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

    def select(self, tokens: VisualTokens) -> Selection:
        early_name, final_name = self.requires
        final = tokens.signals[final_name].float()
        n = tokens.num_tokens
        valid = tokens.valid if tokens.valid is not None else torch.ones_like(final, dtype=torch.bool)
        final = final.masked_fill(~valid, float("-inf"))
        # single-crop images (LLaVA-1.5, video frames, images absent from `crop_grid`)
        counts = [min(n, int(n * self.rate))] * tokens.num_crops
        if tokens.crop_grid:
            early = tokens.signals[early_name]
            images = tokens.image_index.tolist()
            for image, (rows, cols) in tokens.crop_grid.items():
                crops = sorted((c for c in range(tokens.num_crops) if images[c] == image),
                               key=lambda c: int(tokens.crop_index[c]))  # fmt: skip
                budgets = self.crop_budgets(early[crops[0]], rows, cols, *tokens.grid)
                for crop, budget in zip(crops, budgets, strict=True):
                    counts[crop] = min(budget, int(valid[crop].sum()))
        return topk_per_crop(final, counts)
