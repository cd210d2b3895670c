"""HiPrune: hierarchical attention in the vision tower picks anchors, their neighbours and registers (
"HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision-Language Models", arXiv
2508.00553; official code Danielement321/HiPrune). Written from vtoken's METHODS-4-images.md.

Per crop (a Qwen image), N tokens on a raster grid of width W, a budget of T (T >= N keeps all); shallow scores
s = the attention each token receives in the tower's `object_layer` block, deep scores d = the same in its
`deep_layer` block (post-softmax, mean over heads, then over every query row, [CLS] row included, [CLS] column
dropped: the signal "received_attention@L"):

1. a = round(alpha * T / 5) with Python's round (half to even): T = 192 / 128 / 64 at alpha = 0.1 give 4 / 3 / 1.
2. Anchors A: the a tokens of highest s (the first index on ties).
3. Buffers B: i - 1, i + 1, i - W, i + W of every anchor i. `border="official"` clamps them to [0, N - 1] (a +-1
   step at a row end wraps to the next or previous row, a step off the top or bottom lands on token 0 or N - 1),
   `border="grid"` keeps in-grid 4-neighbours only. Duplicates collapse; an anchor stays an anchor.
4. Registers: the T - |A u B| tokens of highest d outside A u B.

Done branch-free: every token ranked by (class: anchor 2 > buffer 1 > other 0, then d descending, then the lower
index); the first T kept, returned ascending. Two defects of the official code are fixed by that ranking: on Qwen
it excludes A u B from the registers by subtracting 1 from their d, which a token whose summed attention exceeds 1
survives, so it is picked twice and fewer than T are kept (here exactly T); when |A u B| > T (large alpha) the
official top-k of a negative count raises (here anchors first, then buffers by d: exactly T). Invalid tokens
(LLaVA-NeXT's unpadded border in the native layout) are never anchors, buffers or registers, and T is capped at a
crop's valid tokens.

Layers are 0-based (the official numbers are 1-based: its `HIPRUNE_OBJECT_LAYER=9` is block 8 here). `object_layer`
None: block 8 on LLaVA-1.5 / LLaVA-NeXT (CLIP-L), 15 on Qwen2.5-VL, depth // 2 - 1 on other towers (and where a
tower is too shallow for the official block); `deep_layer` None: the feature layer's block (LLaVA: 22 of 24, as
the official `vision_feature_layer=-2`; Qwen: the last block). `score="cls"`: AngelSlim's variant, the [CLS] row's
attention at both layers instead ([CLS] towers only).

`scope="split"` is the official LLaVA-NeXT budget: an image's T shared equally by its crops (640 on 5 crops: 128
each). Nothing is sequential: two stable sorts over [C, N], a few scatters; counts from the budget and the host
valid counts, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..budget import Budget
from ..params import Choice, Int, OrNone, Real
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, valid_mask

if TYPE_CHECKING:
    from ..modelview import ModelView

# the official object layer per family (0-based); elsewhere the tower's depth // 2 - 1
OBJECT_LAYERS = {"llava-1.5": 8, "llava-next": 8, "llava-next-video": 8, "qwen2.5-vl": 15}
BORDERS = ("official", "grid")
SCORES = {"received": "received_attention", "cls": "cls_attention"}
TOWER_LAYER = "a vision-tower block, 0-based; negative counts from the end"


def anchor_count(alpha: float, budget: int) -> int:
    """a = round(alpha * T / 5), Python's round (half to even), as the official."""
    return round(alpha * budget / 5)


def hiprune_rank(
    shallow: torch.Tensor,
    deep: torch.Tensor,
    valid: torch.Tensor,
    anchors: torch.Tensor,
    width: int,
    border: str,
    most_anchors: int,
) -> torch.Tensor:
    """[C, N] every token's place in HiPrune's order (anchors, then buffers, then the rest; d descending, then the
    lower index within each class; invalid tokens last): position p of a row holds the p-th token.

    shallow, deep [C, N] scores; valid [C, N] bool; anchors [C] each crop's a (on the device); width: the grid's
    W; most_anchors: the largest a (host)."""
    crops, n = shallow.shape
    device = shallow.device
    low = torch.finfo(torch.float32).min
    classes = torch.zeros(crops, n + 1, dtype=torch.long, device=device)  # column n: where skipped entries go
    if most_anchors:
        order = shallow.float().masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        top = order[:, :most_anchors]  # [C, a] by s, the first index on ties
        real = torch.arange(most_anchors, device=device) < anchors[:, None]
        near = torch.stack([top - 1, top + 1, top - width, top + width], dim=-1)  # [C, a, 4]
        if border == "official":  # clamped to the crop: row ends wrap, top and bottom land on 0 and N - 1
            near = near.clamp(0, n - 1)
            inside = torch.ones_like(near, dtype=torch.bool)
        else:  # in-grid 4-neighbours only
            column = (top % width)[..., None]
            inside = (near >= 0) & (near < n)
            inside[..., 0] &= column[..., 0] > 0
            inside[..., 1] &= column[..., 0] < width - 1
            near = near.clamp(0, n - 1)
        inside &= valid.gather(1, near.flatten(1)).view_as(near) & real[..., None]  # invalid neighbours skipped
        classes.scatter_(1, torch.where(inside, near, n).flatten(1), 1)
        classes.scatter_(1, torch.where(real, top, n), 2)  # an anchor stays an anchor
    classes = classes[:, :n].masked_fill(~valid, -1)
    by_deep = deep.float().masked_fill(~valid, low).argsort(dim=-1, descending=True, stable=True)
    by_class = classes.gather(1, by_deep).argsort(dim=-1, descending=True, stable=True)
    return by_deep.gather(1, by_class)


@dataclass
class HiPrune(EncoderMethod):
    """`budget`: tokens kept per crop (scope "crop") or per image shared equally by its crops ("split"), a fraction
    or a count; official 0.334 / 0.223 / 0.112 on Qwen2.5-VL, 192 / 128 / 64 on LLaVA-1.5, 640 / 320 / 160 per
    image on LLaVA-NeXT (scope="split", layout="official"). `alpha` in [0, 1]: anchors = round(alpha T / 5).
    `object_layer` / `deep_layer`: 0-based tower blocks (None: the family's official ones). `border`: "official"
    (clamped neighbours, row ends wrap) or "grid" (in-grid 4-neighbours). `score`: "received" (official) or "cls"
    (AngelSlim's [CLS]-row variant)."""

    budget: Budget = 0.223
    alpha: float = 0.1
    object_layer: int | None = None
    deep_layer: int | None = None
    border: str = "official"
    score: str = "received"
    scope: str = "crop"

    name = "hiprune"
    scopes = ("crop", "split")
    modalities = ("image",)
    params = {
        "alpha": Real("[0, 1]", hint="the anchors' share: round(alpha * budget / 5) anchors"),
        "object_layer": OrNone(Int(hint=TOWER_LAYER + "; None: the family's official block")),
        "deep_layer": OrNone(Int(hint=TOWER_LAYER + "; None: the feature layer's block")),
        "border": Choice(BORDERS, hint="'official' clamps neighbours (row ends wrap), 'grid' keeps in-grid ones"),
        "score": Choice(tuple(SCORES), hint="'received' official; 'cls' AngelSlim's [CLS]-row variant"),
    }
    layouts = ("native", "official")
    controls = ("budget", "alpha", "border", "scope")
    signals_note = "HiPrune reads the attention the tokens receive in two vision-tower blocks"

    @property
    def requires(self) -> tuple[str, ...]:
        kind = SCORES[self.score]
        shallow = f"{kind}@{'object' if self.object_layer is None else self.object_layer}"
        deep = kind if self.deep_layer is None else f"{kind}@{self.deep_layer}"
        return (shallow, deep)

    def tower_block(self, alias: str, family: str, depth: int) -> int | None:
        """ "object": the official object layer of `family` (LLaVA 8, Qwen2.5-VL 15), else depth // 2 - 1 (also
        where the tower is too shallow for the official block)."""
        if alias != "object":
            return None
        official = OBJECT_LAYERS.get(family)
        return official if official is not None and official < depth else max(depth // 2 - 1, 0)

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """The object layer resolved on `model` (its tower's depth read from the blocks it serves)."""
        prefix = f"{SCORES['received']}@"
        blocks = [int(s.removeprefix(prefix)) for s in model.signals if s.startswith(prefix)
                  and s.removeprefix(prefix).isdigit()]  # fmt: skip
        if not blocks:
            return {}
        return {"object_layer": cls().tower_block("object", model.family, max(blocks) + 1)}

    def missing_signal_hint(self, missing: list[str]) -> str:
        if any(m.startswith("cls_attention") for m in missing):
            return "score='cls' reads a [CLS] row; score='received' (official) needs no [CLS]"
        return (
            "received_attention@L is computed from a tower block's queries and keys; towers without them (FastVLM's "
            "FastViTHD exposes no attention maps) cannot serve it"
        )

    def select(self, tokens: VisualTokens) -> Selection:
        shallow_name, deep_name = self.requires
        shallow, deep = tokens.signals[shallow_name], tokens.signals[deep_name]
        device = shallow.device
        valid = valid_mask(tokens, device)
        counts = self.crop_counts(tokens)
        limit = self.crop_counts_tensor(valid, tokens)
        # a = round(alpha T / 5) on the device, the host's double arithmetic (torch.round: half to even)
        anchors = torch.round(self.alpha * limit.double() / 5).long()
        most = max((anchor_count(self.alpha, k) for k in counts), default=0)
        order = hiprune_rank(shallow, deep, valid, anchors, tokens.grid[1], self.border, most)
        width = max(max(counts, default=0), 1)
        n = tokens.num_tokens
        first = order[:, :width]
        kept = torch.where(torch.arange(width, device=device) < limit[:, None], first, n).sort(dim=-1).values
        return Selection(kept=kept, counts=None if all(k == width for k in counts) else counts)
