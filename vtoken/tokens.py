"""The data that flows adapter -> method -> adapter.

An adapter extracts `VisualTokens` from a model; a method returns a `Selection`; the adapter applies it.
Methods never touch models, adapters never decide which tokens matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# `Selection.origin` values of output rows that pass no grid token through unchanged
CLS = -1  # the crop's [CLS] token (`VisualTokens.signals["cls_token"]`)
MERGED = -2  # a token merged from several


@dataclass
class TextQuery:
    """The text side of a call, for text-guided methods.

    questions: per image (indexed like `VisualTokens.image_index`), the question its prompt asks.
    family: the model family (methods whose official text handling differs per family read it).
    embed: text -> [T, D] input embeddings of the LLM (tokenized without BOS or other special tokens).
    """

    questions: list[str]
    family: str
    embed: Callable[[str], torch.Tensor]


@dataclass
class VisualTokens:
    """A batch of C crops (images, anyres crops or video frames), each an H x W grid of N = H*W tokens.

    features: [C, N, D] vision features in raster order (pre-projector for LLaVA families).
    grid: (H, W) token grid of every crop.
    signals: named score signals, each [C, N] unless stated, e.g. "cls_attention" = head-mean post-softmax
        attention of the [CLS] query to each patch key in the feature layer; "projected" = [C, N, D] the tokens
        in the LLM's embedding space; "vision_features" = [C, N, Dv] vision-side features for token-to-token
        similarity (pre-projector where the model has them); "keys" = [C, N, d] the feature layer's attention
        keys of the tokens (mean over heads); "cls_token" = [C, Dv] the crop's [CLS] feature in the space of
        `features`, given only where the model can pass it to the LLM with the crop's tokens.
    image_index: [C] index of the image each crop belongs to.
    valid: [C, N] bool, False for tokens that never reach the LLM whatever a method picks (e.g. LLaVA-NeXT
        sub-image tokens in the padded border that unpadding removes); None = all valid. Budgets count valid
        tokens only.
    crop_index: [C] index of each crop within its image (anyres: 0 = base view, then sub-images in raster order).
    crop_grid: anyres only: image index -> (rows, cols) of its sub-image grid.
    question: the prompt's text, for methods that require "question".
    valid_counts: host-side, per crop, how many of its tokens are valid (the True entries of `valid`), given by an
        adapter that knows them without reading `valid` back from the device (from the layout: LLaVA-NeXT's
        unpadding, the lengths of placed runs). Methods size their outputs from it; without it a method reads
        `valid`'s counts back once (one host sync). None with `valid` None: every crop has N valid tokens.
    image_of_crop: host-side `image_index` (image of every crop), set by adapters that know it without reading the
        device (None: `host_image_index` reads it back).

    Tensors live on the features' device (`image_index` and `crop_index` too, for a selection without host-device
    copies); the host-side fields (`grid`, `crop_grid`, `valid_counts`) are what methods size their outputs from.
    """

    features: torch.Tensor
    grid: tuple[int, int]
    signals: dict[str, torch.Tensor] = field(default_factory=dict)
    image_index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    crop_index: torch.Tensor | None = None
    crop_grid: dict[int, tuple[int, int]] | None = None
    question: TextQuery | None = None
    valid_counts: list[int] | None = None
    image_of_crop: list[int] | None = None

    @property
    def num_crops(self) -> int:
        return self.features.shape[0]

    def host_image_index(self) -> list[int]:
        """The image of every crop, on the host (one read of `image_index` where no adapter gave it)."""
        if self.image_of_crop is not None:
            return list(self.image_of_crop)
        if self.image_index is None:
            return list(range(self.num_crops))
        return self.image_index.tolist()

    @property
    def num_tokens(self) -> int:
        return self.features.shape[1]

    def host_valid_counts(self) -> list[int]:
        """Valid tokens of every crop, on the host: `valid_counts` when the adapter gave it, N per crop without
        `valid`, else read back from `valid` (one host-device sync, the only one this costs)."""
        if self.valid_counts is not None:
            return self.valid_counts
        if self.valid is None:
            return [self.num_tokens] * self.num_crops
        return self.valid.sum(1).tolist()


@dataclass
class Selection:
    """What a method decided for each crop.

    kept: [C, k] indices into each crop's N tokens, ascending; None for merging methods.
    features: [C, k, D] replacement features for merging methods (None when tokens are only selected).
    counts: per crop, how many leading entries of its `kept` row are real when crops keep different numbers
        (the rest is padding); None when every crop keeps k.
    anchors: for merging methods, [C, k] ascending index of the original token each merged token stands at
        (models that keep original positions, e.g. M-RoPE, give it that token's position).
    grid: for methods that hand back a smaller grid (Fourier-VLM), its (rows, cols): the tokens are that grid in
        raster order, and models with 2-D/3-D positions place them on it.
    protected: [C, k] bool aligned with `kept`: tokens no later stage may drop (MustDrop's key set), or None.
    origin: for merging methods that also pass some tokens through unchanged (VisionZip), [C, k] aligned with
        `features`: the index of the grid token each output row is, unchanged, or `CLS` / `MERGED` for a row with
        no place on the grid. Records report the unchanged ones as kept; layouts place them on the grid.
    at_anchors: for merging methods whose every output row stands at a grid token of its crop, the one `anchors`
        names (FastVID, HoliTom: a token others were merged into keeps its place), possibly out of ascending order
        (HoliTom puts a window's static tokens first), rows past a crop's count padded with positions past the
        grid: records report the anchors, sorted, as kept, and models with original positions (M-RoPE) put the
        rows in their anchors' order.
    mix: for merging methods whose rows combine the crops' tokens linearly, the same combination applied to other
        per-token features aligned with the tokens ([C, N, D'] -> [C, k, D'], padded like `features`): Qwen3-VL's
        DeepStack levels follow the merge through it. None: the merge cannot be repeated on other features.
    groups: [C, k] aligned with the output rows, each row's group, a unit a later stage of the same method keeps a
        share of (PruneVid: 2c for the static tokens of the window that starts at crop c, 2c + 1 for crop c's
        dynamic tokens; -1 for padding rows), or None. group_sizes: host, the rows of every group (2C entries for
        PruneVid), or None.
    """

    kept: torch.Tensor | None = None
    features: torch.Tensor | None = None
    counts: list[int] | None = None
    anchors: torch.Tensor | None = None
    grid: tuple[int, int] | None = None
    protected: torch.Tensor | None = None
    origin: torch.Tensor | None = None
    at_anchors: bool = False
    mix: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    groups: torch.Tensor | None = None
    group_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if (self.kept is None) == (self.features is None):
            raise ValueError("Selection needs exactly one of `kept` (selection) or `features` (merging)")
        if self.origin is not None and self.features is None:
            raise ValueError("Selection.origin describes merged `features` rows; a plain selection has `kept`")

    @property
    def num_kept(self) -> int:
        return (self.kept if self.kept is not None else self.features).shape[1]

    def offsets_of(self, crop: int) -> torch.Tensor:
        """Original token indices whose places (and positions) the crop's output tokens take, ascending."""
        if self.kept is not None:
            return self.kept_of(crop)
        if self.anchors is not None:
            return self.anchors[crop] if self.counts is None else self.anchors[crop, : self.counts[crop]]
        return torch.arange(self.features.shape[1], device=self.features.device)

    def kept_of(self, crop: int) -> torch.Tensor | None:
        """Ascending kept indices of one crop (None for merging methods)."""
        if self.kept is None:
            return None
        return self.kept[crop] if self.counts is None else self.kept[crop, : self.counts[crop]]

    def origin_of(self, crop: int) -> torch.Tensor | None:
        """The crop's `origin` row without padding (None when the method gave none)."""
        if self.origin is None:
            return None
        return self.origin[crop] if self.counts is None else self.origin[crop, : self.counts[crop]]

    def unchanged_of(self, crop: int) -> torch.Tensor | None:
        """Indices of the crop's tokens that reach the LLM unchanged, in output order (ascending for every built-in
        method): the kept tokens, or those a merging method passes through; None for a pure merge. With
        `at_anchors`, every row's anchor, ascending."""
        if self.kept is not None:
            return self.kept_of(crop)
        if self.at_anchors:  # rows are padded with positions past the grid: one sort serves every crop
            if getattr(self, "_ascending", None) is None:
                self._ascending = self.anchors.sort(dim=-1).values
            return self._ascending[crop] if self.counts is None else self._ascending[crop, : self.counts[crop]]
        origin = self.origin_of(crop)
        return None if origin is None else origin[origin >= 0]

    def gather_flat(self, features: torch.Tensor) -> torch.Tensor:
        """Output features of all crops, crop after crop: [sum of kept, D] (crops may keep different numbers)."""
        if self.counts is None:
            return self.gather(features).flatten(0, 1)
        if self.kept is None:  # merged features, rows padded past each crop's count
            return torch.cat([self.features[c, :n] for c, n in enumerate(self.counts)])
        return torch.cat([features[c, self.kept_of(c)] for c in range(features.shape[0])])

    def counts_per_crop(self) -> list[int]:
        """Output tokens of every crop."""
        if self.counts is not None:
            return self.counts
        return [self.num_kept] * (self.kept if self.kept is not None else self.features).shape[0]

    def gather(self, features: torch.Tensor) -> torch.Tensor:
        """Kept features [C, k, D] from the crops' features [C, N, D] (every crop keeping k)."""
        if self.features is not None:
            return self.features
        return features.gather(1, self.kept.unsqueeze(-1).expand(-1, -1, features.shape[-1]))


@dataclass
class TextTokens:
    """The text tokens after a row's first visual token, at a drop point inside the LLM (padded per row to T).

    valid: [B, T] bool, real tokens. index: [B, T] each token's index in its row's unpadded LLM input.
    keys: [B, T, H*d] the drop layer's post-RoPE keys, heads concatenated (GQA key heads repeated), or None.
    normed: [B, T, D] the drop layer's output through the LLM's final norm, or None.
    """

    valid: torch.Tensor
    index: torch.Tensor
    keys: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    known: list[int] | None = None  # text tokens of every row, counted on the host


@dataclass
class LayerTokens:
    """The visual tokens of a batch inside the LLM, at a drop point after decoder layer `layer`.

    attention: [B, R, V] post-softmax attention of R query rows (the method's `query_rows`, padded) to each row's
        V visual tokens (padded), mean over heads, normalised over all keys the rows see; None unless the method
        reads "attention" or "next_attention". For "plain_attention" instead: the layer's attention without rotary
        and without a causal mask (softmax over every real key of q . k * scaling, q and k before rotary), the
        largest over heads (`vtoken.kernels.plain_attention.plain_attention_max`).
    row_valid: [B, R] bool, real query rows. valid: [B, V] bool, real visual tokens.
    protected: [B, V] bool, tokens an earlier stage marked as never dropped (MustDrop's key set), or None.
    received: visual tokens each row brought into the LLM (before any drop), or None.
    index: [B, V] each visual token's index in its row's unpadded LLM input, or None.
    keys / normed / hidden: [B, V, H*d] post-RoPE keys (as `TextTokens.keys`), [B, V, D] the layer's output
        through the final norm, [B, V, D] the layer's output itself; None unless the method reads them.
    text: the text tokens after the first visual token (`TextTokens`), for methods that read "keys" or "normed".
    known: visual tokens of every row, counted on the host (`counts`), so a method sizes what it keeps without
        reading the device.
    groups: [B, V] each visual token's group, numbered 0.. per row from an encoder stage's `Selection.groups`
        (-1: none, e.g. OneVision's newline), for a method that keeps a share of every group (PruneVid); None
        otherwise. group_sizes: host, per row the size of each of its groups as the LLM received them.
    """

    layer: int
    attention: torch.Tensor | None
    row_valid: torch.Tensor | None
    valid: torch.Tensor
    protected: torch.Tensor | None = None
    received: list[int] | None = None
    index: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    text: TextTokens | None = None
    known: list[int] | None = None
    groups: torch.Tensor | None = None
    group_sizes: list[list[int]] | None = None

    @property
    def counts(self) -> list[int]:
        """Visual tokens of every row (`known`: the adapter's host counts; else read from `valid`, a host sync)."""
        return self.known if self.known is not None else self.valid.sum(1).tolist()


@dataclass
class MidLayerTokens:
    """What a prefill method with mid-layer call points (`PrefillMethod.calls = ("mid_layer",)`) gets at call point
    `call` (0: the LLM's input, before layer 0; c >= 1: after layer c - 1's attention with its residual added,
    before its MLP), for the B rows of a prefill. Its candidates are the video tokens (a token inside a frame).

    hidden: [B, C, D] the residual stream of the current sequence; order: [B, P] the candidates in the method's
    order (`PrefillMethod.candidate_order`; indices into C, -1 past a row's count), kept in that order by a stable
    compaction after every call; chain: [B, P] the key the method gave each candidate with its order (-1 past the
    count); columns: [B, P] each candidate's column in the prompt the LLM received; counts: host, candidates per
    row; attention: [B, R, P] for the rows the method's run asks it for at this call (`wants_attention(call)`),
    layer call - 1's causal softmax attention (post-rotary, as the model computes it, mean over heads) of each row's
    last R real tokens (`query_count`) over its candidates in order (row_valid [B, R]); else None."""

    call: int
    hidden: torch.Tensor
    order: torch.Tensor
    chain: torch.Tensor
    columns: torch.Tensor
    counts: list[int]
    attention: torch.Tensor | None = None
    row_valid: torch.Tensor | None = None


@dataclass
class MidLayerStep:
    """What one call point decided: keep [B, P] (in the candidates' order) which candidates go on; states [B, P, D]
    fp32 the new hidden states of the kept ones (None: unchanged); kept: host, candidates left per row. The engine
    writes the states (cast back), drops the others (the MLP and every later layer run on the shorter sequence, the
    caches of later layers hold it) and keeps every token's original position."""

    keep: torch.Tensor
    states: torch.Tensor | None
    kept: list[int]


@dataclass
class Merged:
    """Tokens a prefill method adds after a row's kept visual tokens (SparseVLM's recycled clusters).

    features: [B, M, D] their hidden states (rows padded to M); valid: [B, M] bool, real ones; anchors: [B, M]
    the visual slot (an index into `LayerTokens.valid`'s V, a token dropped at this point) each one stands for in
    records and labels.
    """

    features: torch.Tensor
    valid: torch.Tensor
    anchors: torch.Tensor
    known: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        """Merged tokens of every row (`known`: counted on the host; else read from `valid`, a host sync)."""
        return self.known if self.known is not None else self.valid.sum(1).tolist()
