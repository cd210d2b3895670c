"""Records: what a patched forward did, one entry per crop (or frame) per stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .timing import Stopwatch


@dataclass
class Record:
    """One crop's visual tokens at one stage.

    stage: e.g. "encoder"; method: the method's registered name.
    image: index of the image (or video) in the call, row-major over the batch; crop: index of the crop (or
        frame) within it; modality: "image" or "video".
    tokens_in / tokens_out: tokens before and after this stage: at the encoder, the crop's tokens the method chose
        among (patches; [CLS] and newline separators excluded); at an LLM stage, the row's visual tokens inside
        the LLM. The headline count, the visual tokens of the LLM's input, is `vtoken.counts`'.
    kept: sorted LongTensor [tokens_out] of kept indices into the crop's token sequence as the vision tower
        emits it (without [CLS]), on the model's device; None for merging methods. A merging method that passes
        some tokens through unchanged reports those (VisionZip: its dominant patches, fewer than tokens_out); one
        that merges into kept tokens reports every output token at the place it keeps (FastVID, HoliTom). A
        method acting on an image's placed tokens (DivPrune) records one entry per image, `kept` indexing its
        packed sequence as the LLM would receive it (newlines and pass-through [CLS] tokens included), grid (1, L).
    grid: (rows, cols) of the crop's token grid that `kept` indexes in raster order.
    selected: tokens the method picked when the layout then dropped some (HiRED's official LLaVA-NeXT layout
        unpads after selecting); None when every pick reached the LLM (selected == tokens_out).
    extra: stage-specific numbers, e.g. "layer_average" (visual tokens averaged over all LLM layers, on prefill
        records), "cache_lengths" (tokens each LLM layer's KV cache holds, on "decode.kv" records), "steps" and
        "selections" (one-token decoding steps, and those that re-selected, on DyCoke's "decode.layerL" records,
        whose tokens_out is what a selecting step attends to and kept the last selection).
    The sparse stage ("sparse.layerK") records "density" (share of causal key blocks computed), "estimation_ms"
        and "attention_ms" (whole batch), tokens_in = tokens_out = the row's tokens; a "sparse" record with
        extra["dense"] says why a prefill (or a layer) ran the model's own attention instead.
    LLM stages ("prefill.layerK", "decode.kv") record one entry per batch row: `image` is the row, `crop` is 0,
        and `kept` indexes the row's own visual tokens as the LLM received them (whatever the padding).
    seconds: time spent computing scores and selecting, this crop's share of its batch (read lazily: on CUDA the
        first read waits for the timed work, never the forward itself).
    """

    stage: str
    method: str
    image: int
    crop: int
    tokens_in: int
    tokens_out: int
    kept: torch.Tensor | None
    grid: tuple[int, int]
    timer: Stopwatch = field(repr=False)
    share: float = 1.0
    modality: str = "image"
    selected: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.timer.seconds * self.share


class LazyRecords(Sequence):
    """Records built when first read, not during the forward: the per-crop counts and kept indices they hold are
    host work (and, for a few layouts, reads of device data) that the forward itself never needs. `build()`
    returns the list of `Record`s; `chain` joins several sequences of records, still unbuilt."""

    def __init__(self, build: Callable[[], list[Record]]):
        self._build: Callable[[], list[Record]] | None = build
        self._records: list[Record] | None = None

    @classmethod
    def chain(cls, parts: Sequence[Sequence[Record]]) -> LazyRecords:
        parts = list(parts)
        return cls(lambda: [record for part in parts for record in part])

    def _resolved(self) -> list[Record]:
        if self._records is None:
            self._records, self._build = list(self._build()), None
        return self._records

    def __getitem__(self, index):
        return self._resolved()[index]

    def __len__(self) -> int:
        return len(self._resolved())

    def __iter__(self) -> Iterator[Record]:
        return iter(self._resolved())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._resolved())


def llm_point(stage: str) -> float | None:
    """Where in the LLM a prefill stage's record stands, as a number that orders them (None: not a prefill stage):
    "prefill.layerK" (a drop after layer K) at K + 1; a mid-layer call point (FrameFusion) "prefill.merge.cC" (call
    C: the LLM's input for C = 0, else after layer C - 1's attention) at C - 0.5; "prefill.prune.layerL" (a prune
    by layer L's attention, after it) at L + 0.5."""
    for prefix, at in (("prefill.layer", 1.0), ("prefill.merge.c", -0.5), ("prefill.prune.layer", 0.5)):
        if stage.startswith(prefix):
            number = stage.removeprefix(prefix)
            return int(number) + at if number.isdigit() else None
    return None


def llm_point_label(stage: str) -> str:
    """How the tools name where a prefill stage's record stands: "after LLM layer 2", "at the LLM's input", "after
    LLM layer 3's attention"."""
    point = llm_point(stage)
    if point is None:
        return stage
    if stage.startswith("prefill.layer"):
        return f"after LLM layer {int(point) - 1}"
    if point < 0:
        return "at the LLM's input"
    return f"after LLM layer {int(point + 0.5) - 1}'s attention"


def summarize(records: list[Record]) -> str:
    """A short human-readable table of records."""
    if not records:
        return "no visual tokens processed in the last call"
    lines = [f"{'stage':<16} {'method':<10} {'image':>5} {'crop':>4} {'in':>6} {'out':>6} {'ms':>8}"]
    for r in records:
        lines.append(
            f"{r.stage:<16} {r.method:<10} {r.image:>5} {r.crop:>4} {r.tokens_in:>6} {r.tokens_out:>6} "
            f"{r.seconds * 1e3:>8.2f}"
        )
    for stage in dict.fromkeys(r.stage for r in records):  # one total per stage, in the order they ran
        if stage.startswith("sparse"):  # sparse prefill keeps every token: say how much attention it computed
            rows = [r for r in records if r.stage == stage]
            if "density" in rows[0].extra:
                density = sum(r.extra["density"] for r in rows) / len(rows)
                ms = rows[0].extra["estimation_ms"], rows[0].extra["attention_ms"]
                lines.append(f"{stage}: {density:.1%} of causal attention blocks computed, estimation {ms[0]:.2f} ms, "
                             f"attention {ms[1]:.2f} ms")  # fmt: skip
            else:
                lines.extend(f"{stage}: {r.extra['dense']}" for r in rows)
            continue
        tin = sum(r.tokens_in for r in records if r.stage == stage)
        tout = sum(r.tokens_out for r in records if r.stage == stage)
        share = f"{tout / max(tin, 1):.1%} kept"
        if stage == "decode.kv":  # cache entries, not tokens of the LLM's input
            lines.append(f"{stage}: the KV cache keeps {tout} of {tin} visual entries per layer ({share})")
        elif stage.startswith("decode.layer"):  # a decode-time selection (DyCoke): per step, nothing removed
            rows = [r for r in records if r.stage == stage]
            steps, selected = sum(r.extra["steps"] for r in rows), sum(r.extra["selections"] for r in rows)
            lines.append(f"{stage}: a selecting step's later layers attend to {tout} of {tin} visual tokens "
                         f"({share}); {selected} of {steps} decoding steps (over all rows) selected")  # fmt: skip
        elif stage == "encoder.keyset":  # MustDrop marks key tokens here; nothing is removed
            lines.append(f"{stage}: {tout} of {tin} tokens marked as keys (none removed)")
        elif tin == tout:
            lines.append(f"{stage}: all {tin} kept")
        elif llm_point(stage) is not None:
            lines.append(f"{stage}: {tin} -> {tout} visual tokens {llm_point_label(stage)} ({share})")
        else:  # encoder stages count what the method chose among (a crop's patches: no newline, no [CLS])
            lines.append(f"{stage}: {tin} -> {tout} selected ({share})")
    return "\n".join(lines)
