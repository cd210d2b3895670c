"""Method base classes.

A method is a small dataclass. Most are one `score()` function: the base class owns budgets, top-k and ordering.

Selections run on the GPU without waiting for it: counts come from shapes, budgets and the host-side fields of
`VisualTokens` (`valid_counts`), their device twins are computed on the device from the same data
(`EncoderMethod.keep_counts`), and no helper here loops over crops or reads a tensor back, except where a method's
definition makes a count depend on the data (one read, documented by the method).
What a method *is* (its stages, signals, parameters, layouts, ...) it declares in a block of class attributes at
the top of its class; `Method` lists them, and every vtoken tool reads them from there.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..budget import Budget, tokens_to_keep, tokens_to_keep_tensor
from ..errors import VTokenError
from ..geometry.tables import on_device
from ..params import Kept, Layer, Param, Scope
from ..tokens import LayerTokens, Merged, Selection, VisualTokens

if TYPE_CHECKING:
    from ..modelview import ModelView


class Method:
    """A visual-token reduction method (base of every stage).

    Its declaration, class attributes at the top of the class (a subclass sets those that differ):

    name: registered name (lowercase letters, digits and "_"). stages: where it acts: "encoder" (on the vision
    features, before the LLM), "prefill" (drops visual tokens between LLM layers), "decode" (cuts or masks
    per-layer KV caches) and/or "sparse" (the LLM's prefill attention); one method may act at several.
    requires: score signals the adapter must provide (see `VisualTokens.signals`; an entry "a|b" is met by either:
    a method with one form per family, FastVID). uses: signals used where the model provides them, and done
    without elsewhere. modalities: the inputs it acts on. acts_on: what an encoder
    stage's `select` gets. params: its parameters' declarations (`vtoken.params`), checked when it is built.
    budget_param: the parameter the tools' common budget sets. layouts, official_packing: the anyres packings it
    implements. merges: whether it outputs tokens made from several. controls, demo_params: how the demo shows it.
    How many tokens it keeps, and whether that is known before the encoder runs, it says with `planned_count` and
    `count_before_encoding` (encoder stage) or `drop_layers` and `keep_mask` (inside the LLM).
    """

    name: ClassVar[str] = ""
    stages: ClassVar[tuple[str, ...]] = ("encoder",)
    requires: ClassVar[tuple[str, ...]] = ()
    # signals used where the model provides them, and done without elsewhere (VisionZip: "cls_token")
    uses: ClassVar[tuple[str, ...]] = ()
    # inputs it acts on: a video-only method (VidCom2) refuses images when the call starts
    modalities: ClassVar[tuple[str, ...]] = ("image", "video")
    # "crops": `select` gets every crop's tokens before they are packed; "placed": every image's (video's) tokens
    # as the LLM would receive them, packed and projected, newlines included (DivPrune)
    acts_on: ClassVar[str] = "crops"
    # parameter -> its declaration (type, range or choices: `vtoken.params`); a subclass's entries add to (or
    # replace) its bases'. Checked in that order when the method is built (`__post_init__`)
    params: ClassVar[dict[str, Param]] = {}
    # the parameter `vtoken run --budget`, the demo's common budget and `vtoken eval --budgets` set (None: none)
    budget_param: ClassVar[str | None] = None
    # parameters that stand for the budget (VisionZip's dominant/contextual): given, the tools set no budget
    budget_alternatives: ClassVar[tuple[str, ...]] = ()
    # packings it implements on anyres models (LLaVA-NeXT): "native" (the model's own) and "official" (its own
    # code's: every crop keeps its budget, no unpadding, no newlines). official_packing: where that differs:
    # "unpad after selection" (HiRED selects over the padded crops, then unpads), "unpad before selection" (HoloV
    # selects among the base view and the unpadded grid, packed without newlines), "newline after base-only image"
    layouts: ClassVar[tuple[str, ...]] = ("native",)
    official_packing: ClassVar[tuple[str, ...]] = ()
    # whether it outputs tokens made from several (merging: no kept index for them)
    merges: ClassVar[bool] = False
    # the parameters the demo shows (None: every declared one it can show), and the demo's starting values where
    # the defaults would show nothing on a short prompt
    controls: ClassVar[tuple[str, ...] | None] = None
    demo_params: ClassVar[dict[str, Any]] = {}
    # why a family without the required signals is refused, added to the refusal (what the signals are)
    signals_note: ClassVar[str] = ""

    def wants(self, signal: str) -> bool:
        """Whether `signal` is among `requires` (alone or as one alternative of an "a|b" entry)."""
        return any(signal in entry.split("|") for entry in self.requires)

    def __post_init__(self) -> None:
        """Check every declared parameter (a subclass with its own `__post_init__` calls this first, then checks
        what relates its parameters)."""
        for param, spec in self.declared_params().items():
            setattr(self, param, spec.check(self, param, getattr(self, param)))

    @classmethod
    def declared_params(cls) -> dict[str, Param]:
        """Every parameter's declaration: the bases' `params`, then this class's (which may replace one)."""
        merged: dict[str, Param] = {}
        for klass in reversed(cls.__mro__):
            merged.update(klass.__dict__.get("params", {}))
        return merged

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every parameter's default value."""
        out = {}
        for f in fields(cls):
            if f.init:
                out[f.name] = (
                    f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
                )
        return out

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """Parameters beyond the defaults that make the method fit `model` (`applicable_methods` and the demo
        use them): every `Layer` parameter moves to the deepest softmax-attention layer, at or before its
        default, that a drop can follow. A method with other LLM-layer parameters says how they fit."""
        scored = droppable_layers(model)
        defaults = cls.defaults()
        out = {}
        for param, spec in cls.declared_params().items():
            if scored and isinstance(spec, Layer) and isinstance(defaults.get(param), int):
                fits = [k for k in scored if k <= defaults[param] - spec.reads] or scored[:1]
                out[param] = max(fits) + spec.reads
        return out

    def missing_signal_hint(self, missing: list[str]) -> str:
        """A sentence `patch` adds when a model lacks the signals `missing` (e.g. the variant that needs none)."""
        return ""

    def tower_block(self, alias: str, family: str, depth: int) -> int | None:
        """For a tower signal it requires by an alias rather than a block number ("received_attention@object"):
        the vision-tower block (0-based) the alias means on `family`'s tower of `depth` blocks, which the adapter
        then probes; None: not one of its aliases. (A method knows its official layers per family; the adapter
        knows the tower.)"""
        return None


def unmet(requires: tuple[str, ...], provided: set[str]) -> list[str]:
    """The entries of `requires` that `provided` does not meet (an "a|b" entry is met by either)."""
    return sorted(entry for entry in requires if not set(entry.split("|")) & provided)


def droppable_layers(model: ModelView) -> list[int]:
    """LLM layers a drop can follow and be scored at: the softmax-attention layers before the last (a drop after
    the last saves nothing), else the one before the last; none in a one-layer LLM."""
    last = model.llm_layers - 2
    if last < 0:
        return []
    return [k for k in range(last + 1) if k in model.attention_layers] or [last]


def nearest_layers(fits: list[int], official: tuple[int, ...], depth: int, official_depth: int = 32) -> list[int]:
    """The official layers (of an `official_depth`-layer LLM) scaled to an LLM of `depth` layers (an LLM as deep or
    deeper keeps them), each the nearest of `fits`; ascending, without repeats."""
    scale = min(1.0, depth / official_depth)
    return sorted({min(fits, key=lambda k: abs(k - layer * scale)) for layer in official})


@dataclass
class EncoderMethod(Method):
    """A method acting on the vision features, before the LLM.

    budget: fraction kept or token count. scope: what the budget counts over: "crop" (every crop or video frame
    keeps its budget), "image" (an image or video keeps its budget over all its crops or frames together, shared
    by the data) or "split" (an image's budget T shared equally by its c crops: each keeps floor(T / c), at most
    its valid tokens; one crop: as "crop"). `crop_counts` / `crop_counts_tensor` give the "crop" and "split"
    counts of a call.
    """

    budget: Budget = 0.25
    scope: str = "crop"

    params = {"budget": Kept(), "scope": Scope()}
    budget_param = "budget"
    scopes: ClassVar[tuple[str, ...]] = ("crop", "image")
    # the positions its kept tokens get on a family with 1-D positions that can give either (LLaVA-OneVision's
    # videos): "renumber" (contiguous, the shorter prompt the model sees) or "original" (each keeps its place,
    # with gaps, as FastVID's official code passes `position_ids = keep_indexs`). M-RoPE families keep the
    # original (t, h, w) positions whatever this says
    encoder_positions: ClassVar[str] = "renumber"

    def single_crop_requires(self) -> tuple[str, ...]:
        """The signals it needs when every image is one crop (`vtoken.select`): `requires` unless some serve only
        to share an image's budget out over its crops (HiRED's early layer)."""
        return tuple(self.requires)

    def merged_cells(self, height: int, width: int, k: int) -> list[list[int]] | None:
        """A merging method (`merges`): the grid cells (raster indices) each of the k output tokens of an H x W
        crop is made from, for pictures (the demo's); None: not said."""
        return None

    def keep_count(self, n: int) -> int:
        """Tokens kept per crop of n tokens."""
        return tokens_to_keep(self.budget, n)

    def keep_counts(self, n: torch.Tensor) -> torch.Tensor:
        """`keep_count` of every crop's n ([C] integer tensor), 0 where n is 0, computed on n's device without a
        host sync. A method overriding `keep_count` overrides this too (else its counts are read back here)."""
        if type(self).keep_count is not EncoderMethod.keep_count:
            return torch.tensor([self.keep_count(v) if v else 0 for v in n.tolist()], device=n.device)
        return tokens_to_keep_tensor(self.budget, n)

    def planned_count(self, n: int) -> int | None:
        """Tokens a crop of n keeps, when known before its features exist (None: decided from the data, or by the
        image's other crops: scope "split").

        Knowing "how many" before the encoder runs lets the adapter shrink the prompt while the GPU is still idle.
        """
        return self.keep_count(n) if self.scope == "crop" else None

    def count_before_encoding(self, n: int, grid: tuple[int, int], crops: int = 1) -> int | None:
        """Tokens a crop keeps, from what a serving engine knows before the encoder runs (None: only the data
        decides): n = the crop's valid tokens, grid = its (H, W) token grid, crops = how many crops its image has.

        A serving engine (vLLM) sizes the prompt's placeholders from this. Default: `planned_count(n)`; scope
        "split": floor(T / crops) of the image's budget T over crops x n tokens (every crop of the image has n
        valid tokens where an engine sizes before encoding: LLaVA-NeXT's official layout, no unpadding).
        """
        if self.scope == "split":
            return split_share(self.budget, [n] * crops)[0] if n else 0
        return self.planned_count(n)

    def crop_counts(self, tokens: VisualTokens) -> list[int]:
        """Tokens every crop keeps, on the host, for scopes "crop" (its budget of its valid tokens) and "split"
        (floor(T / c) of its image's budget T over the image's valid tokens, at most its own valid tokens)."""
        valid = tokens.host_valid_counts()
        if self.scope != "split":
            return [self.keep_count(v) if v else 0 for v in valid]
        images = tokens.host_image_index()
        per_image: dict[int, list[int]] = {}
        for image, v in zip(images, valid, strict=True):
            per_image.setdefault(image, []).append(v)
        shares = {image: split_share(self.budget, counts) for image, counts in per_image.items()}
        seen: dict[int, int] = {}
        out = []
        for image in images:
            out.append(shares[image][seen.get(image, 0)])
            seen[image] = seen.get(image, 0) + 1
        return out

    def crop_counts_tensor(self, valid: torch.Tensor, tokens: VisualTokens) -> torch.Tensor:
        """`crop_counts` computed on the device from `valid` [C, N] (the same IEEE double arithmetic), no host
        sync: [C] int64."""
        per_crop = valid.sum(1)
        if self.scope != "split":
            return self.keep_counts(per_crop)
        slot = image_slots(tokens, valid.device)
        zeros = torch.zeros_like(per_crop)
        total = zeros.index_add(0, slot, per_crop)[slot]  # every crop's image's valid tokens
        crops = zeros.index_add(0, slot, torch.ones_like(per_crop))[slot]
        return torch.div(tokens_to_keep_tensor(self.budget, total), crops, rounding_mode="floor").minimum(per_crop)

    def select(self, tokens: VisualTokens) -> Selection:
        """Decide which tokens of every crop reach the LLM."""
        raise NotImplementedError


def split_share(budget: Budget, valid: list[int]) -> list[int]:
    """Scope "split": the tokens each crop of one image keeps, given every crop's valid tokens: the image's budget
    T over them all, floor(T / c) each (the official `int(RETENTION / crops)`), at most the crop's valid tokens."""
    total = sum(valid)
    share = tokens_to_keep(budget, total) // len(valid) if total else 0
    return [min(share, v) for v in valid]


def topk_per_crop(scores: torch.Tensor, counts: list[int], limit: torch.Tensor | None = None) -> Selection:
    """Crop c keeps its top `counts[c]` tokens by `scores` [C, N] (invalid tokens at -inf), ascending; rows are
    padded with N past each crop's count.

    limit: [C] the same counts on the scores' device, computed there from the data the host counts came from (e.g.
    `EncoderMethod.keep_counts`), so that nothing is copied to the device; needed only when crops keep different
    numbers (without it, `counts` is copied over: a host-to-device copy).
    """
    width = max(max(counts, default=0), 1)
    top = scores.topk(width, dim=-1).indices
    if limit is None and len(set(counts)) <= 1:  # every crop keeps the same number
        if counts and counts[0] == width:
            return Selection(kept=top.sort(dim=-1).values, counts=counts)
        limit = counts[0] if counts else 0
    elif limit is None:
        limit = torch.tensor(counts, device=top.device)
    if isinstance(limit, torch.Tensor):
        limit = limit.to(top.device)[:, None]
    rank = torch.arange(width, device=top.device)
    kept = torch.where(rank < limit, top, scores.shape[-1]).sort(dim=-1).values
    return Selection(kept=kept, counts=counts)


def topk_mask(scores: torch.Tensor, counts: list[int], limit: torch.Tensor | None = None) -> torch.Tensor:
    """[C, N] bool: row c marks its top `counts[c]` entries of `scores` [C, N] (invalid entries at -inf); `limit` as
    in `topk_per_crop`."""
    kept = topk_per_crop(scores, counts, limit).kept  # padded with N past each row's count
    mask = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.bool, device=scores.device)
    return mask.scatter(1, kept, True)[:, :-1]


def image_slots(tokens: VisualTokens, device: torch.device) -> torch.Tensor:
    """[C] for every crop, the index of its image's first crop: a group id below C, computed on the device (an
    image's crops share it), so crops are grouped by image without reading `image_index` back."""
    if tokens.image_index is None:
        return torch.arange(tokens.num_crops, device=device)
    images = tokens.image_index.to(device)
    return (images[:, None] == images[None, :]).int().argmax(1)  # argmax: the first maximum


def valid_mask(tokens: VisualTokens, device: torch.device) -> torch.Tensor:
    """[C, N] bool `tokens.valid` on `device`, all True (made there) when it is None."""
    if tokens.valid is None:
        return torch.ones(tokens.num_crops, tokens.num_tokens, dtype=torch.bool, device=device)
    return tokens.valid.to(device)


def padding_excluded(scores: torch.Tensor, tokens: LayerTokens) -> torch.Tensor:
    """scores [B, V] of a drop's visual tokens with -inf at the padding entries (`tokens.valid` False); none made
    where every row has all V (host counts): the mask would change nothing."""
    if all(n == scores.shape[1] for n in tokens.counts):
        return scores
    return scores.masked_fill(~tokens.valid, float("-inf"))


def keep_top(scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[B, V] bool: row b keeps its top `counts[b]` entries of `scores` [B, V] (invalid entries at -inf); the same
    set as `topk_mask`, with the counts kept on the host: a fixed burst, no host sync."""
    batch, length = scores.shape
    width = max(counts, default=0)
    keep = torch.zeros(batch, length + 1, dtype=torch.bool, device=scores.device)
    if width == 0:
        return keep[:, :length]
    top = scores.topk(width, dim=-1).indices
    if any(n != width for n in counts):
        rank = torch.arange(width, device=scores.device)
        top = top.masked_fill(rank >= on_device(counts, scores.device)[:, None], length)
    return keep.scatter_(1, top, True)[:, :length]


@dataclass
class ScoreMethod(EncoderMethod):
    """Keep the top-k tokens of each crop by `score`, in ascending (original) order."""

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        """Importance of every token: [C, N], higher is kept first."""
        raise NotImplementedError

    def select(self, tokens: VisualTokens) -> Selection:
        return self.keep_top_scores(tokens, check_scores(self, tokens, self.score(tokens)))

    def keep_top_scores(self, tokens: VisualTokens, scores: torch.Tensor) -> Selection:
        """Every crop's (or image's, with scope="image") top tokens by `scores` [C, N], ascending."""
        if self.scope == "image":
            return self._select_per_image(tokens, scores)
        if tokens.valid is None:
            k = self.keep_count(tokens.num_tokens)
            return Selection(kept=scores.topk(k, dim=-1).indices.sort(dim=-1).values)
        # crops with invalid tokens: budget over the valid ones (host counts from the layout, their twins on device)
        valid = tokens.valid.to(scores.device)
        counts = [self.keep_count(v) if v else 0 for v in tokens.host_valid_counts()]
        limit = self.keep_counts(valid.sum(1))
        return topk_per_crop(scores.float().masked_fill(~valid, float("-inf")), counts, limit)

    def _select_per_image(self, tokens: VisualTokens, scores: torch.Tensor) -> Selection:
        """One top-k over all crops of each image; crops keep different numbers (padded rows + counts).

        How many of its image's top-k fall in each crop is data: the per-crop counts are read back once (one host
        sync). Ties rank the lower crop, then the lower token, first.
        """
        crops, n = scores.shape
        device = scores.device
        valid = valid_mask(tokens, device)
        scores = scores.float().masked_fill(~valid, float("-inf")).flatten()
        slot = image_slots(tokens, device)
        budget = self.keep_counts(torch.zeros(crops, dtype=torch.long, device=device).index_add_(0, slot, valid.sum(1)))
        # every token's rank within its image: a stable sort by score, then a stable sort by image
        token_slot = slot[:, None].expand(crops, n).flatten()
        order = scores.argsort(descending=True, stable=True)
        order = order[token_slot[order].argsort(stable=True)]
        image_of = token_slot[order]
        tokens_per_image = torch.zeros(crops, dtype=torch.long, device=device).index_add_(
            0, slot, torch.full_like(slot, n)
        )
        start = tokens_per_image.cumsum(0) - tokens_per_image  # first sorted position of every image
        rank = torch.arange(crops * n, device=device) - start[image_of]
        keep = torch.zeros(crops * n, dtype=torch.bool, device=device).scatter(0, order, rank < budget[image_of])
        keep = keep.view(crops, n) & valid
        counts = keep.sum(1).tolist()  # data: which crops the image's top-k fall in
        width = max(counts, default=0)
        kept = torch.where(keep, torch.arange(n, device=device), n).sort(dim=-1).values[:, :width]
        return Selection(kept=kept, counts=counts)


def check_scores(method: EncoderMethod, tokens: VisualTokens, scores: object) -> torch.Tensor:
    """A score method's scores [C, N] as the base class takes them for its top-k: the shape, dtype and device on
    the host (a `VTokenError` naming the method), and no NaN or +inf on the device (invalid tokens may be -inf): a
    device-side assert on CUDA (no sync), raised at once on the CPU (as a `VTokenError`)."""
    crops, n, device = tokens.num_crops, tokens.num_tokens, tokens.features.device
    where = f"{method.name}.score()"
    if not isinstance(scores, torch.Tensor):
        raise VTokenError(f"{where} returned {type(scores).__name__}; expected a tensor [C, N] = [{crops}, {n}]")
    if tuple(scores.shape) != (crops, n):
        raise VTokenError(f"{where} returned scores of shape {tuple(scores.shape)}; expected [C, N] = [{crops}, {n}]")
    if scores.device != device:
        raise VTokenError(f"{where} returned scores on {scores.device}; expected the features' device, {device}")
    if not scores.is_floating_point():
        raise VTokenError(f"{where} returned scores of dtype {scores.dtype}; expected a floating-point tensor")
    message = f"{where} returned NaN or +inf scores (expected finite scores; -inf marks tokens never to keep)"
    try:
        torch._assert_async((scores < float("inf")).all(), message)
    except RuntimeError as err:  # raised at once off CUDA; on CUDA a device-side assert ends the call
        raise VTokenError(message) from err
    return scores


class PrefillMethod(Method):
    """A method that drops visual tokens inside the LLM, after decoder layers (the prefill stage).

    After each layer in `drop_layers(num_layers)` the adapter gathers what the method `reads` at that point and
    calls `keep_mask` (then `merge`); later layers run on [prefix, kept visual, merged, text]. `positions`:
    "renumber" (contiguous positions after each drop) or "original" (kept tokens keep theirs).
    reads: "attention" = the drop layer's post-softmax attention (head mean) from the query rows to the visual
    tokens, for those rows only while the layer itself keeps SDPA/flash; "next_attention" = the same rows of the
    *next* layer's attention, recomputed from the drop layer's output (its input norm, q/k projections and
    rotary at the current positions: PyramidDrop scores a layer before it runs); "keys" = the drop layer's
    post-RoPE keys; "normed" = its output through the LLM's final norm; "hidden" = its output (see `LayerTokens`).
    "plain_attention" = the drop layer's attention without rotary and without a causal mask, max over heads
    (PruneVid; see `LayerTokens.attention`).
    query_rows: "last" = the last prompt token; "text" = every text token after the row's first visual token;
    "chosen" = the text tokens `choose_rows` picks once, from the LLM's input embeddings; "after_visual" = every
    real token after the row's last visual token.
    calls: ("mid_layer",) = the method acts at call points inside the LLM instead of after whole layers: call 0 on
    the LLM's input, call c after layer c - 1's attention (its residual added), before its MLP (FrameFusion). Per
    prefill the engine calls `start`, orders the video tokens by `candidate_order`, then `step` at every call point
    with `MidLayerTokens`, and applies the `MidLayerStep` it returns; the run `start` made may say which rows want
    the attention of the layer before a call (`wants_attention(call)`), whether it is `done`, and its `log` of
    calls (dicts with "call", "before", "after", the rest as records' extras) and `cost(row)`.
    """

    stages: ClassVar[tuple[str, ...]] = ("prefill",)
    query_rows: ClassVar[str] = "last"
    reads: ClassVar[tuple[str, ...]] = ("attention",)
    calls: ClassVar[tuple[str, ...]] = ()
    positions: str = "renumber"

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        """Indices of the decoder layers after which `keep` is called (0-based, ascending)."""
        raise NotImplementedError

    def scored_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose queries/keys the method reads: the drop layers, or the layers right after them for
        "next_attention"; none if it reads neither attention nor keys."""
        drops = self.drop_layers(num_layers)
        if "next_attention" in self.reads:
            return tuple(k + 1 for k in drops)
        return drops if {"attention", "keys", "plain_attention"} & set(self.reads) else ()

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        """[B, V] bool: which visual tokens of every row go on (invalid entries are ignored). A hot path: a fixed
        burst of kernels, no host sync beyond what the method's definition needs (see `kept_counts`)."""
        raise NotImplementedError

    def kept_counts(self, tokens: LayerTokens) -> list[int] | None:
        """How many visual tokens each row keeps at this drop (merged tokens not counted), from the host counts in
        `tokens` and the method's budget; `keep_mask` keeps exactly these. None: only the data says (a threshold):
        the adapter then reads the counts back, the one host sync such a drop makes."""
        return None

    def merge(self, tokens: LayerTokens, keep: torch.Tensor) -> Merged | None:
        """Tokens to add right after each row's kept visual tokens, made from what `keep` [B, V] drops (None:
        nothing added). They count as visual tokens at later drops; `Merged.known` holds their count per row."""
        return None

    def update(self, tokens: LayerTokens, keep: torch.Tensor) -> torch.Tensor | None:
        """New hidden states [B, V, D] for the visual tokens that go on (where `keep` [B, V]), taking the place of
        theirs before the next layer: a merge into the kept tokens (HoliTom's inner merge). None: unchanged."""
        return None

    def choose_rows(
        self, visual: torch.Tensor, visual_valid: torch.Tensor, text: torch.Tensor, text_valid: torch.Tensor
    ) -> torch.Tensor:
        """query_rows="chosen": [B, T] bool, the text tokens whose attention rows score the visual tokens, from
        the LLM's input embeddings of each row's visual tokens [B, V, D] and of its text after the first visual
        token [B, T, D] (valid masks [B, V], [B, T])."""
        raise NotImplementedError

    def select_layer(self, num_layers: int) -> int | None:
        """Decode stage: the first layer whose attention each one-token decoding step restricts to the visual
        tokens `decode_keep` picks from the new token's attention row at the layer before (None: no such stage;
        raises when it does not fit `num_layers`)."""
        return None

    def decode_keep(
        self,
        attention: torch.Tensor,
        valid: torch.Tensor,
        previous: torch.Tensor | None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode stage (with `select_layer`): from the new token's attention [B, V] over each row's visual tokens
        (`valid` [B, V]) and the previous step's (None on the first step), which tokens the step keeps [B, V] and
        which rows restrict this step at all [B]; counts [B]: `decode_count` of each row's tokens, on the device
        (the adapter's, so the step needs no host sync)."""
        raise NotImplementedError

    def decode_count(self, n: int) -> int:
        """Decode stage (with `select_layer`): of a row's n visual tokens, how many a restricted step keeps."""
        raise NotImplementedError

    def cut_layers(self, drop_layers: tuple[int, ...]) -> range:
        """Decode stage: layers whose KV cache is cut, after prefill, to the visual tokens that survived every
        drop (none by default)."""
        return range(0)

    # ----------------------------------------------------------------- mid-layer call points (calls = ("mid_layer",))
    def start(self, batch: int, num_layers: int) -> Any:
        """calls=("mid_layer",): the state of one prefill of `batch` rows through `num_layers` layers."""
        raise NotImplementedError

    def candidate_order(self, slots: torch.Tensor, videos: torch.Tensor, counts: list[int]):
        """calls=("mid_layer",): (order [B, P], chain [B, P]) of the candidates, once per prefill, from slots and
        videos [B, L] (a token's index inside its frame and its video; -1 outside every frame) and the candidates
        per row (host): `MidLayerTokens.order` / `chain`."""
        raise NotImplementedError

    def query_count(self, family: str) -> int:
        """calls=("mid_layer",): how many of each row's last tokens give the attention rows (on `family`)."""
        return 1

    def step(self, run: Any, tokens: Any) -> Any:
        """calls=("mid_layer",): one call point on `MidLayerTokens`; returns a `MidLayerStep`."""
        raise NotImplementedError


@dataclass(frozen=True)
class TowerShape:
    """What a tower method knows of the vision tower it acts in; the adapter describes it at `patch`.

    family: the adapter's family ("llava-1.5", "qwen3-vl", ...). cls: a [CLS] token comes first in the tower's
    sequence (CLIP; not SigLIP or Qwen). feature_block: F, the block whose output the LLM reads (LLaVA's
    `vision_feature_layer = -2` of 24 blocks: 22); -1 when the LLM reads the embeddings. merge: ViT patches per LLM
    token along each side (Qwen's 2x2 merger: 2; LLaVA: 1). patch: pixels per patch side. temporal: frames per
    patch (Qwen: 2; LLaVA: 1). channels: colour channels. mean, std: the processor's per-channel normalisation
    (pixels = (value - mean) / std), for methods that read pixel values.
    """

    family: str
    cls: bool = False
    feature_block: int = -1
    merge: int = 1
    patch: int = 14
    temporal: int = 1
    channels: int = 3
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @property
    def merging_layers(self) -> int:
        """Blocks 0..F: the layers whose output reaches the LLM's feature layer."""
        return self.feature_block + 1


@dataclass
class TowerMethod(Method):
    """A method acting before or inside the vision tower (stage "tower"), so that the tower itself runs on fewer
    tokens (post-tower methods leave the tower's cost, which dominates batch-1 time to first token on Qwen-VL).

    Its declaration adds: acts: "input" (drops patch rows before block 0: `select_input`) or "layers" (changes the
    sequence inside blocks, per block from the hidden states and that block's keys). families: the families it
    applies to, each with how ("official" or "extension: ..."); refusals: family -> why it is refused (the message
    of the `VTokenError` at `patch`). keeps_grid: whether its output keeps the crop's token grid (holes marked
    invalid), so that a later encoder method may read grid signals. positions: the positions of the tokens
    leaving the tower: "original" (kept tokens keep theirs where the family's positions are multi-axis, Qwen's
    M-RoPE) or "renumber".
    How many tokens leave the tower it says before any model compute, with `count_before_encoding`.
    """

    stages: ClassVar[tuple[str, ...]] = ("tower",)
    modalities: ClassVar[tuple[str, ...]] = ("image",)
    acts: ClassVar[str] = "input"
    families: ClassVar[dict[str, str]] = {}
    refusals: ClassVar[dict[str, str]] = {}
    keeps_grid: ClassVar[bool] = False
    positions: ClassVar[str] = "renumber"

    def check_family(self, family: str) -> None:
        """Raise `VTokenError` naming why the method cannot act in `family`'s tower (a refusal of the spec, or a
        family it was never made for); nothing when it applies. Called at `patch`, before the model is touched."""
        from ..errors import VTokenError

        if family in self.families:
            return
        reason = self.refusals.get(family, f"it was not made for {family}'s vision tower")
        raise VTokenError(
            f"{self.name} (tower stage) is refused on {family}: {reason}. It applies to: {', '.join(self.families)}"
        )

    def count_before_encoding(
        self, grids: list[tuple[int, ...]], pixels: torch.Tensor | None = None, tower: TowerShape | None = None
    ) -> list[int]:
        """Tokens leaving the tower (LLM-level tokens) per crop, before any model compute: from host integers
        (`grids`: every crop's patch grid, (H, W) or Qwen's (t, h, w)) or from the preprocessed `pixels`; `tower`
        describes the tower. The prompt is shrunk from it before the tower runs; serving engines size their
        placeholders from it."""
        raise NotImplementedError
