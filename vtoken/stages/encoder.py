"""The encoder stage: one method on the vision features, the same code for every caller.

The transformers adapters, the vLLM plugin and `vtoken.select` build `VisualTokens` their own way (they own the
towers, the layouts and the placeholders) and hand them here: the signals every family serves are filled from one
table (`COMMON_SIGNALS`), the method's needs are read from its declaration (`requires`, `modalities`,
`acts_on`), the method runs, and what it returned is checked once, where the engine takes it: shape, dtype and
device on the host (a `VTokenError` naming the method); a score method's scores are checked where the base
class's top-k takes them (`ScoreMethod.select`: finite on the device, a device-side assert on CUDA, no sync).
Placed selections (a method choosing among an image's tokens as the LLM receives them: DivPrune) and the per-crop
records live here too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from vtoken.errors import InputError, MissingSignalError, VTokenError
from vtoken.geometry.tables import on_device, padded_rows, stack_padded
from vtoken.methods.base import EncoderMethod, Method, unmet
from vtoken.records import LazyRecords, Record
from vtoken.timing import Stopwatch
from vtoken.tokens import Selection, TextQuery, VisualTokens

# The signals every caller serves, whatever the model: name -> what it is. `EncoderStage.fill` fills them (the
# only place), from the features and the caller's `SignalSources`.
COMMON_SIGNALS: dict[str, str] = {
    "question": "the prompt's question per image (`TextQuery`: its LLM input embeddings), for text-guided methods",
    "projected": "[C, N, D] the tokens in the LLM's embedding space (the caller's projector; the features if none)",
    "vision_features": "[C, N, Dv] vision-side features for token-to-token similarity (default: the features)",
}


@dataclass
class SignalSources:
    """What the caller gives the common signals: `project` maps features [C, N, Dv] to the LLM's space [C, N, D]
    (None: the features already are); `question` the prompt's text (or a callable making it, called only for a
    method that reads it)."""

    project: Callable[[torch.Tensor], torch.Tensor] | None = None
    question: TextQuery | Callable[[], TextQuery] | None = None


@dataclass
class PlacedPicks:
    """A placed selection over I items (each an image's or video's run of L_i tokens as the LLM receives it).

    lengths: L_i per item; counts: k_i kept per item (host); kept: per item [k_i] ascending offsets into its run;
    flat: [sum k_i] the kept rows as indices into the items padded to `width` and flattened (item-major);
    padded: [I, width, D] the runs, padded; selection / timer: the method's `Selection` over them and its time.
    """

    lengths: list[int]
    counts: list[int]
    kept: list[torch.Tensor]
    flat: torch.Tensor
    width: int
    padded: torch.Tensor
    selection: Selection
    timer: Stopwatch

    def take(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The kept entries of per-token values [I, width, ...] (items padded to `width`), per item."""
        return list(rows.flatten(0, 1)[self.flat].split(self.counts))


class EncoderStage:
    """The encoder stage of one method: its checks (at patch or engine start), its selection (per call)."""

    def __init__(self, method: EncoderMethod):
        self.method = method

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def placed(self) -> bool:
        """The method chooses among every image's tokens as the LLM receives them (packed, projected, newlines
        included), after the family packed them (`acts_on="placed"`), rather than among each crop's tokens."""
        return self.method.acts_on == "placed"

    # ----------------------------------------------------------------- checks before anything runs
    def check_takes(self, takes: Iterable[str], owner: str, advice: str = "") -> None:
        check_takes(self.method, takes, owner, advice)

    def check_signals(self, provided: set[str], owner: str, requires: Sequence[str] | None = None) -> None:
        check_signals(self.method, provided, owner, requires)

    def check_call_modality(self, modality: str, pixel_key: str) -> None:
        """At a call's start: refuse inputs of a kind the method does not act on (images given to a video method)."""
        if modality not in self.method.modalities:
            raise InputError(
                f"{self.name} acts on {' and '.join(self.method.modalities)} inputs only; this call passes "
                f"{modality}s (`{pixel_key}`): call the model without them, or use another method"
            )

    # ----------------------------------------------------------------- per call
    def fill(self, tokens: VisualTokens, sources: SignalSources) -> None:
        """Fill the common signals the method reads (the one place they are filled), then resolve every signal
        given as a callable (computed now, inside the selection's timer)."""
        method = self.method
        if method.wants("projected") and "projected" not in tokens.signals:
            project = sources.project
            tokens.signals["projected"] = (
                tokens.features if project is None else (lambda features=tokens.features: project(features))
            )
        if method.wants("vision_features") and "vision_features" not in tokens.signals:
            tokens.signals["vision_features"] = tokens.features
        if method.wants("question") and tokens.question is None:
            question = sources.question
            if question is None:
                raise MissingSignalError(f"{self.name} reads the prompt's question; this caller gave none")
            tokens.question = question() if callable(question) else question
        tokens.signals = {k: v() if callable(v) else v for k, v in tokens.signals.items()}

    def select(self, tokens: VisualTokens, sources: SignalSources | None = None) -> tuple[Selection, Stopwatch]:
        """The method's selection of every crop of `tokens`, its signals filled and its result checked, and the
        time it took (scores and selection)."""
        timer = Stopwatch(tokens.features.device).start()
        self.fill(tokens, sources or SignalSources())
        selection = self.method.select(tokens)  # a score method's scores are checked where its top-k takes them
        self.check_selection(tokens, selection)
        timer.stop()
        return selection, timer

    def check_selection(self, tokens: VisualTokens, selection: object) -> None:
        """What the method returned, against what the engine takes: a `Selection` of `tokens.num_crops` rows of
        integer indices (or merged rows of the features' width) on the features' device, as many rows per crop as
        `counts` says. All of it known on the host: no read of the device."""
        crops, n, device = tokens.num_crops, tokens.num_tokens, tokens.features.device
        where = f"{self.name}.select()"
        if not isinstance(selection, Selection):
            raise VTokenError(f"{where} returned {type(selection).__name__}; expected a vtoken.Selection")
        rows = selection.kept if selection.kept is not None else selection.features
        what = "kept" if selection.kept is not None else "features"
        expected = f"[{crops}, k] (one row per crop)" if what == "kept" else f"[{crops}, k, D] (one row per crop)"
        if not isinstance(rows, torch.Tensor) or rows.dim() != (2 if what == "kept" else 3) or rows.shape[0] != crops:
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise VTokenError(f"{where} returned {what} of shape {got}; expected {expected}")
        if rows.device != device:
            raise VTokenError(
                f"{where} returned {what} on {rows.device}; expected them on the features' device, {device}"
            )
        if what == "kept":
            if rows.dtype != torch.int64:
                raise VTokenError(f"{where} returned kept indices of dtype {rows.dtype}; expected torch.int64")
            if rows.shape[1] > n:
                raise VTokenError(f"{where} kept {rows.shape[1]} tokens per crop of {n}; expected at most {n}")
        counts = selection.counts
        if counts is not None and (len(counts) != crops or any(not 0 <= c <= rows.shape[1] for c in counts)):
            raise VTokenError(
                f"{where} returned counts {list(counts)}; expected {crops} counts between 0 and {rows.shape[1]}"
            )

    def select_placed(self, placed: list[torch.Tensor]) -> PlacedPicks | None:
        """The method on every item's run [L_i, D] as the LLM receives it (`placed`); None when no item has a
        token. Counts and widths from the runs' shapes: no read of the device."""
        lengths = [len(p) for p in placed]
        if not placed or not max(lengths):
            return None
        width = max(lengths)
        features = stack_padded(placed, width)
        device = features.device
        valid = torch.arange(width, device=device)[None] < on_device(lengths, device)[:, None]
        tokens = VisualTokens(features, (1, width), {}, torch.arange(len(placed), device=device), valid,
                              valid_counts=lengths)  # fmt: skip
        selection, timer = self.select(tokens)
        counts = selection.counts_per_crop()
        k = max(selection.num_kept, 1)
        picked = padded_rows(counts, k, device)  # real entries of [items, k]
        kept = selection.kept.flatten()[picked]  # each item's kept offsets, item after item
        flat = picked // k * width + kept  # into the items padded to `width`
        return PlacedPicks(lengths, counts, list(kept.split(counts)), flat, width, features, selection, timer)

    def placed_records(self, picks: PlacedPicks, modality: str) -> LazyRecords:
        """One record per item of a placed selection (grid (1, L_i): `kept` indexes its run), built when read."""
        name, lengths, counts, kept, timer = self.name, picks.lengths, picks.counts, picks.kept, picks.timer

        def build() -> list[Record]:
            return [
                Record("encoder", name, image=i, crop=0, tokens_in=lengths[i], tokens_out=counts[i], kept=k,
                       grid=(1, lengths[i]), timer=timer, share=1 / len(lengths), modality=modality)
                for i, k in enumerate(kept)
            ]  # fmt: skip

        return LazyRecords(build)

    def crop_records(
        self,
        tokens: VisualTokens,
        selection: Selection,
        timer: Stopwatch,
        crop_index: list[int],
        modality: str = "image",
        images: list[int] | None = None,
    ) -> LazyRecords:
        """One record per crop; `crop_index[c]` is crop c's index within its image (or frame within its video),
        `images` (where the caller knows them on the host) the image of every crop. Built when first read: the
        forward keeps only the small tensors they need (kept indices, which tokens were valid)."""
        name, grid, num_crops, num_tokens = self.name, tokens.grid, tokens.num_crops, tokens.num_tokens
        valid, given, image_index = tokens.valid, tokens.valid_counts, tokens.image_index
        counts = selection.counts_per_crop()
        picks = copy.copy(selection)  # the selection's indices only: its merged features need not live on
        picks.features = picks.mix = None
        crop_index = list(crop_index)

        def build() -> list[Record]:
            if given is not None:
                tokens_in = list(given)
            elif valid is not None:
                tokens_in = valid.sum(1).tolist()
            else:
                tokens_in = [num_tokens] * num_crops
            owners = images if images is not None else image_index.tolist()
            return [
                Record("encoder", name, image=owners[c], crop=crop_index[c], tokens_in=tokens_in[c],
                       tokens_out=counts[c], kept=picks.unchanged_of(c), grid=grid, timer=timer, share=1 / num_crops,
                       modality=modality)
                for c in range(num_crops)
            ]  # fmt: skip

        return LazyRecords(build)


def check_takes(method: Method, takes: Iterable[str], owner: str, advice: str = "") -> None:
    """Refuse a method for inputs `owner` never takes (VidCom2, a video method, on an image-only family)."""
    takes = set(takes)
    if not takes & set(method.modalities):
        raise VTokenError(
            f"method {method.name!r} acts on {' and '.join(method.modalities)} inputs only, which {owner} does not "
            f"take; it takes {', '.join(sorted(takes))}" + (f". {advice}" if advice else "")
        )


def check_signals(method: Method, provided: set[str], owner: str, requires: Sequence[str] | None = None) -> None:
    """Refuse a method needing signals `owner` cannot provide (`provided`: its own, besides the common ones),
    naming them, what is provided and the method's note and hint."""
    requires = tuple(method.requires if requires is None else requires)
    available = set(provided) | set(COMMON_SIGNALS)
    missing = unmet(requires, available)
    if not missing:
        return
    layers = sorted(int(n.split("@")[1]) for n in provided
                    if n.startswith("cls_attention@") and n.split("@")[1].isdigit())  # fmt: skip
    out_of_range = [n for n in missing if n.startswith("cls_attention@")] if layers else []
    why = (
        f"{', '.join(out_of_range)}: no such layer in its vision tower, whose [CLS] attention is available at layers "
        f"{layers[0]}..{layers[-1]} (cls_attention@L; -1 = the last)"
        if out_of_range
        else f"it provides {sorted(available)}"
    )
    note = f" ({method.signals_note})" if method.signals_note else ""
    hint = method.missing_signal_hint(missing)
    raise MissingSignalError(
        f"method {method.name!r} needs the signal(s) {missing}, which {owner} cannot provide{note}; {why}"
        + (f". {hint}" if hint else "")
    )


def keep_all(tokens: VisualTokens) -> Selection:
    """Every valid token of every crop, ascending (rows padded with N past each crop's count)."""
    if tokens.valid is None:
        index = torch.arange(tokens.num_tokens, device=tokens.features.device)
        return Selection(kept=index.expand(tokens.num_crops, -1))
    valid = tokens.valid.to(tokens.features.device)
    counts = tokens.host_valid_counts()
    index = torch.arange(tokens.num_tokens, device=valid.device)
    kept = index.masked_fill(~valid, tokens.num_tokens).sort(dim=-1).values[:, : max(max(counts), 1)]
    return Selection(kept=kept, counts=counts)
