"""HoloV: spread the budget over contiguous chunks of the image by how much each holds, then keep each chunk's
most attended tokens (Zou et al., "Don't Just Chase 'Highlighted Tokens' in MLLMs: Revisiting Visual Holistic
Context Retention", NeurIPS 2025; official code obananas/HoloV). Written from vtoken's METHODS-3-images.md.

Per image, with its L candidate tokens in sequence order (LLaVA-1.5: the crop's raster; LLaVA-NeXT: the base
view's tokens, then the unpadded stitched grid in raster order, no newlines), attention a (head-mean [CLS]
attention at the feature layer), projected tokens x and a budget of k:

1. Chunks: P contiguous runs of the sequence (not 2-D squares): sizes L // P, the first L mod P one larger;
   empty chunks (L < P) skipped. `chunks="auto"` is the official Qwen rule max(1, int((1024 / 576) L / k)).
2. Chunk score (n > 1 tokens): u = x / (|x| + 1e-6), S = u u^T with a zero diagonal, m_i = sum_j S_ij / (n - 1),
   var_i = sum_j (S_ij - m_i)^2 / (n - 1) over all n columns (the zeroed diagonal included, as the official),
   a' = 1000 a, scale = mean|a'| / (mean|var| + 1e-6), token score = a' + alpha scale var, chunk score = its mean
   token score. A one-token chunk scores its raw attention.
3. Allocation: w = s / (sum s + 1e-6), alloc = floor(w k); the k - sum(alloc) chunks of largest w get one more
   (the first on ties). A chunk keeps its alloc most attended tokens (the first on ties), all of them when
   alloc >= n.
4. Overflow: where chunks were allotted more than they hold, the official code pads the output with all-zero
   "tokens"; here the missing ones are the most attended tokens not yet kept (the first on ties): exactly k real
   tokens. Kept: ascending in the sequence (the official orders them by chunk, then by attention).

`score="received"` is vtoken's proxy for towers without [CLS] (the Qwen towers, LLaVA-OneVision, Gemma 3): the
attention each token receives in the tower's feature layer (Qwen: its last full-attention block), head-mean,
averaged over its frame's queries (Qwen: and its 2 x 2 patches, in raster order: what the official Qwen path means;
its branch on the weights' shape scores every token 1, and it pools in the window order); pooled like the tokens
elsewhere (the signal "received_attention").

No host sync on single-crop images: counts come from the budget and the adapter's host-side token counts, every
image of a run of images of the same geometry is scored in one batch. On images of several crops (LLaVA-NeXT) one
read of how many of the image's k tokens each crop keeps sizes the per-crop output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..budget import Budget
from ..errors import VTokenError
from ..params import Choice, Param, Real
from ..tokens import Selection, VisualTokens
from ..validation import integer
from .base import EncoderMethod

if TYPE_CHECKING:
    from ..modelview import ModelView

SCORES = {"cls": "cls_attention", "received": "received_attention"}


@dataclass(frozen=True)
class ImageRun:
    """Consecutive images of one geometry, scored together: crops [first, first + images * crops) of the call,
    each image with `length` candidates, keeping `keep` in `chunks` chunks."""

    first: int
    images: int
    crops: int
    length: int
    keep: int
    chunks: int

    @property
    def stop(self) -> int:
        return self.first + self.images * self.crops


@dataclass(frozen=True)
class ChunkLayout:
    """The chunk layout of a sequence of `length` tokens in P contiguous runs, padded to the longest run n: the
    sequence position of every slot [P, n] (padding: the last token), `pad` [P, n], `off` [P, n, n] (the
    similarity entries a chunk's statistics leave out: padding and the diagonal), `tokens` [P] and `others` [P, 1]
    (n - 1, at least 1) as floats, `single` [P] one-token chunks, `slots` [P * n] (padding: `length`)."""

    members: torch.Tensor
    pad: torch.Tensor
    off: torch.Tensor
    tokens: torch.Tensor
    others: torch.Tensor
    single: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor  # [max(P, n)] 0, 1, 2, ...

    @classmethod
    def of(cls, length: int, chunks: int, device: torch.device) -> ChunkLayout:
        base, extra = divmod(length, chunks)
        count = min(chunks, length)  # empty chunks are skipped
        widest = base + (extra > 0)
        chunk = torch.arange(count, device=device)
        start = chunk * base + chunk.clamp(max=extra)
        size = base + (chunk < extra).long()
        slot = torch.arange(widest, device=device)
        pad = slot[None] >= size[:, None]
        members = (start[:, None] + slot[None]).clamp(max=length - 1)
        off = pad[:, None, :] | torch.eye(widest, dtype=torch.bool, device=device)
        others = (size - 1).clamp(min=1).float()[:, None]
        slots = members.masked_fill(pad, length).flatten()
        ranks = torch.arange(max(count, widest), device=device)
        return cls(members, pad, off, size.float(), others, size <= 1, slots, ranks)


_LAYOUTS: dict[tuple, ChunkLayout] = {}  # (length, chunks, device) -> the chunk layout, built once
LAYOUTS_KEPT = 64


def chunk_layout(length: int, chunks: int, device: torch.device) -> ChunkLayout:
    """The (cached) layout of `length` tokens in `chunks` chunks on `device`: geometry, the same for every call."""
    key = (length, chunks, str(device))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= LAYOUTS_KEPT:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        layout = _LAYOUTS[key] = ChunkLayout.of(length, chunks, device)
    return layout


def chunk_scores(x: torch.Tensor, a: torch.Tensor, chunks: ChunkLayout, alpha: float) -> torch.Tensor:
    """HoloV's score of every chunk: x [B, P, n, D] tokens, a [B, P, n] attention (0 at padding) -> [B, P] fp32."""
    x = x.float()
    unit = x / (x.norm(dim=-1, keepdim=True) + 1e-6)
    similarity = (unit @ unit.transpose(-1, -2)).masked_fill(chunks.off, 0.0)  # [B, P, n, n], zero diagonal
    mean = similarity.sum(-1) / chunks.others
    # over the chunk's n columns, its zeroed diagonal included (the official quirk); padded rows out
    variance = ((similarity - mean[..., None]).square().masked_fill(chunks.pad[:, None, :], 0.0).sum(-1)
                / chunks.others).masked_fill(chunks.pad, 0.0)  # fmt: skip
    scaled = 1e3 * a
    scale = scaled.abs().sum(-1) / (variance.sum(-1) + 1e-6 * chunks.tokens)  # mean|a'| / (mean|var| + 1e-6)
    score = (scaled + (alpha * scale)[..., None] * variance).sum(-1) / chunks.tokens
    return torch.where(chunks.single, a[..., 0], score)  # a one-token chunk: its raw attention


def ranked_first(values: torch.Tensor, count: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """[..., m] bool: the `count` [..., 1] largest of every row of `values` [..., m], the first index on ties."""
    order = values.argsort(dim=-1, descending=True, stable=True)
    chosen = (ranks[: values.shape[-1]] < count).expand_as(order)  # by position in the order
    return torch.empty_like(chosen).scatter_(-1, order, chosen)


@dataclass(frozen=True)
class ChunkCount(Param):
    """An int >= 1, or "auto" (the official Qwen rule)."""

    control: ClassVar[str] = "count"

    def check(self, method: Any, name: str, value: Any) -> Any:
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, str):
            raise VTokenError(f"{method.name}: {name}={value!r}; expected an int >= 1 or 'auto'")
        return integer(method.name, name, value, 1, hint='chunks per image, or "auto"')

    def text(self) -> str:
        return 'chunks per image: an int >= 1, or "auto"'


@dataclass
class HoloV(EncoderMethod):
    """`budget`: tokens kept per image (official 64 of LLaVA-1.5's 576; paper tables 192 / 128 / 64), a count or a
    fraction of its tokens. `chunks`: P, an int >= 1 (official 16) or "auto" (the official Qwen rule, 16 / 8 / 5
    chunks at 64 / 128 / 192 of 576). `alpha`: the weight of the similarity variance (official 0.09). `score`:
    "cls" ([CLS] attention, official) or "received" (vtoken's proxy on families without [CLS])."""

    budget: Budget = 64
    scope: str = "image"
    chunks: int | str = 16
    alpha: float = 0.09
    score: str = "cls"

    name = "holov"
    scopes = ("image",)
    modalities = ("image",)
    uses = ("sequence_index",)
    params = {
        "chunks": ChunkCount(),
        "alpha": Real("[0, inf)", hint="the weight of the similarity variance"),
        "score": Choice(tuple(SCORES), hint="'cls' official; 'received' vtoken's proxy on towers without [CLS]"),
    }
    layouts = ("native", "official")
    official_packing = ("unpad before selection",)  # one HoloV over the base view + the unpadded grid
    controls = ("budget", "chunks", "alpha", "score")

    @property
    def requires(self) -> tuple[str, ...]:
        return (SCORES[self.score], "projected")

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """The received-attention proxy (`score="received"`, labelled) where there is no [CLS] but the tower
        serves it (the Qwen towers, OneVision, Gemma 3)."""
        if "cls_attention" not in model.signals and "received_attention" in model.signals:
            return {"score": "received"}
        return {}

    def missing_signal_hint(self, missing: list[str]) -> str:
        if "cls_attention" in missing:
            return (
                "HoloV scores tokens by [CLS] attention; on towers without [CLS] (Qwen2.5-VL, Qwen3-VL, OneVision, "
                "Gemma 3) score='received' (a vtoken proxy: the attention each token receives in the tower's "
                "feature layer, the last full-attention block on Qwen) is the explicit opt-in"
            )
        if "received_attention" in missing:
            return (
                "score='received' reads a tower block's attention from its queries and keys, which this tower does "
                "not expose (FastVLM's FastViTHD has no attention maps); elsewhere use score='cls'"
            )
        return ""

    def count_before_encoding(self, n: int, grid: tuple[int, int], crops: int = 1) -> int | None:
        """An image of one crop keeps the budget of its n tokens; an image of several crops shares its budget
        out over them by the data (vLLM sizes LLaVA-NeXT's placeholders crop by crop: None there)."""
        return self.keep_count(n) if crops == 1 else None

    def chunk_count(self, length: int, keep: int) -> int:
        if self.chunks == "auto":
            return max(1, int((1024 / 576) * length / keep)) if keep else 1
        return self.chunks

    def runs(self, tokens: VisualTokens) -> list[ImageRun]:
        """The call's images, grouped into runs of consecutive images of the same geometry (host-side)."""
        images = tokens.host_image_index()
        sizes = tokens.host_valid_counts()
        per_image = []  # (first crop, crops, candidates)
        for _, crops in groupby(range(len(images)), key=lambda c: images[c]):
            crops = list(crops)
            per_image.append((crops[0], len(crops), sum(sizes[c] for c in crops)))
        runs: list[ImageRun] = []
        for first, crops, length in per_image:
            keep = self.keep_count(length) if length else 0
            chunks = self.chunk_count(length, keep)
            last = runs[-1] if runs else None
            if last and (last.crops, last.length, last.keep, last.chunks) == (crops, length, keep, chunks):
                runs[-1] = ImageRun(last.first, last.images + 1, crops, length, keep, chunks)
            else:
                runs.append(ImageRun(first, 1, crops, length, keep, chunks))
        return runs

    def select(self, tokens: VisualTokens) -> Selection:
        attention = tokens.signals[SCORES[self.score]]
        features = tokens.signals["projected"]
        device = features.device
        n = tokens.num_tokens
        runs = self.runs(tokens)
        valid = tokens.valid.to(device, non_blocking=True) if tokens.valid is not None else None  # queued, no sync
        order = tokens.signals.get("sequence_index")
        marks = []
        with torch.no_grad():
            if len(runs) == 1 and runs[0].crops == 1 and runs[0].keep:  # images of one crop, one geometry
                kept = self.select_run(runs[0], attention.to(device), features, valid, None if order is None else
                                       order.to(device))  # fmt: skip
                return Selection(kept=kept.sort(-1).values)
            for run in runs:
                crops = slice(run.first, run.stop)
                shape = (run.images, run.crops * n)
                keep_mask = torch.zeros(shape, dtype=torch.bool, device=device)
                if run.keep:
                    usable = valid[crops].reshape(shape) if valid is not None else None
                    sequence = order[crops].to(device).reshape(shape) if order is not None else None
                    kept = self.select_run(run, attention[crops].to(device).reshape(shape),
                                           features[crops].reshape(*shape, -1), usable, sequence)  # fmt: skip
                    keep_mask = keep_mask.scatter(1, kept, True)
                marks.append(keep_mask.view(run.images * run.crops, n))
        marked = torch.cat(marks) if len(marks) > 1 else marks[0]
        if all(run.crops == 1 for run in runs):
            counts = [run.keep for run in runs for _ in range(run.images)]
        else:  # how many of an image's k tokens each of its crops keeps: read once
            counts = marked.sum(1).tolist()
        width = max(counts, default=0)
        index = torch.arange(n, device=device)
        kept = torch.where(marked, index, n).sort(-1).values[:, :width]
        return Selection(kept=kept, counts=None if len(set(counts)) <= 1 else counts)

    def select_run(
        self,
        run: ImageRun,
        attention: torch.Tensor,
        features: torch.Tensor,
        valid: torch.Tensor | None,
        sequence: torch.Tensor | None,
    ) -> torch.Tensor:
        """The kept tokens of every image of `run`: [images, k] indices into each image's crops * N tokens.

        attention [B, T] and features [B, T, D] of each image's T = crops * N tokens (its crops in order, raster
        within); valid [B, T] (None: all); sequence [B, T] each token's key in the image's candidate order (None:
        the order given)."""
        images, total = attention.shape
        length, keep, device = run.length, run.keep, attention.device
        if sequence is None and valid is None:  # the sequence is the tokens as given
            candidates, a, x = None, attention.float(), features
        else:
            position = torch.arange(total, device=device)
            key = (sequence if sequence is not None else position.expand(images, -1)).long()
            if valid is not None:  # invalid tokens last (the sort is stable)
                key = key.masked_fill(~valid, torch.iinfo(torch.long).max)
            candidates = key.argsort(dim=-1, stable=True)[:, :length]  # [B, L] the sequence
            a = attention.float().gather(1, candidates)
            x = features.gather(1, candidates[..., None].expand(-1, -1, features.shape[-1]))
        if keep >= length:
            return candidates if candidates is not None else torch.arange(length, device=device).expand(images, -1)
        layout = chunk_layout(length, run.chunks, device)
        members = a[:, layout.members].masked_fill(layout.pad, 0.0)  # [B, P, n]
        scores = chunk_scores(x[:, layout.members], members, layout, self.alpha)  # [B, P]

        weights = scores / (scores.sum(-1, keepdim=True) + 1e-6)
        alloc = torch.floor(weights * keep)
        alloc = alloc + ranked_first(weights, keep - alloc.sum(-1, keepdim=True), layout.ranks)
        inside = ranked_first(members.masked_fill(layout.pad, -math.inf), alloc[..., None], layout.ranks)
        chosen = torch.zeros(images, length + 1, dtype=torch.bool, device=device)
        chosen = chosen.scatter(1, layout.slots.expand(images, -1), inside.flatten(1))[:, :length]
        # overflow: the most attended tokens not yet kept fill up to k
        picked = a.masked_fill(chosen, math.inf).argsort(dim=-1, descending=True, stable=True)[:, :keep]
        return picked if candidates is None else candidates.gather(1, picked)
