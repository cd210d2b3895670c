"""Records: what a patched forward did, one entry per crop (or frame) per stage."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .timing import Stopwatch


@dataclass
class Record:
    """One crop's visual tokens at one stage.

    stage: e.g. "encoder"; method: the method's registered name.
    image: index of the image (or video) in the call, row-major over the batch; crop: index of the crop (or
        frame) within it; modality: "image" or "video".
    tokens_in / tokens_out: visual tokens before and after this stage.
    kept: sorted LongTensor [tokens_out] of kept indices into the crop's token sequence as the vision tower
        emits it (without [CLS]), on the model's device; None for merging methods.
    grid: (rows, cols) of the crop's token grid that `kept` indexes in raster order.
    selected: tokens the method picked when the layout then dropped some (HiRED's official LLaVA-NeXT layout
        unpads after selecting); None when every pick reached the LLM (selected == tokens_out).
    extra: stage-specific numbers, e.g. "layer_average" (visual tokens averaged over all LLM layers, on prefill
        records) and "cache_lengths" (tokens each LLM layer's KV cache holds, on "decode.kv" records).
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
        lines.append(f"{stage}: {tin} -> {tout} visual tokens ({tout / max(tin, 1):.1%} kept)")
    return "\n".join(lines)


def llm_tokens(records) -> tuple[int, int]:
    """Visual tokens before the first stage and after the last that shortens the LLM's input."""
    stages = [s for s in dict.fromkeys(r.stage for r in records)
              if s not in ("encoder.keyset", "decode.kv") and not s.startswith("sparse")]  # fmt: skip
    if not stages:
        return 0, 0
    tokens_in = sum(r.tokens_in for r in records if r.stage == stages[0])
    return tokens_in, sum(r.tokens_out for r in records if r.stage == stages[-1])
