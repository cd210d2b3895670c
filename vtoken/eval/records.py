"""Per-sample visual-token records for lmms-eval's samples log, and their run-level means.

A patched model's handle holds one `vtoken.Record` per crop (or frame) per stage for the last call; with a batch,
encoder-stage records index images (or videos) row-major over the batch and LLM-stage records index batch rows.
`sample_counts` maps them back to the samples of the batch and aggregates per stage (crops of one stage are
summed; stages are never summed together: MustDrop's "encoder.merge" and "encoder.keyset" stay separate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lmms_eval.api.instance import TokenCounts

from ..records import Record

LLM_STAGE_PREFIXES = ("prefill", "decode")


@dataclass
class VisualTokenCounts(TokenCounts):
    """lmms-eval's `TokenCounts` (prompt and generated text tokens) plus what vtoken did to one sample's visuals.

    visual_tokens: placeholder tokens of the sample's images/videos in the prompt (the unpatched LLM's input).
    visual_kept: visual tokens of the LLM's input, measured (`vtoken.counts`: the same definition as visual_tokens;
        = visual_tokens unpatched, and with stages that keep every token).
    stages: stage -> {"tokens_in", "tokens_out"} summed over the sample's crops/frames (one entry per stage).
    selection_ms: time the methods spent scoring and selecting for this sample (its share of the batch).
    ttft_ms: time to first token of the batch the sample ran in (encoding, selection, prefill, first step).
    layer_average: with a prefill method, visual tokens averaged over all LLM layers (MustDrop's token counts).
    """

    visual_tokens: int = 0
    visual_kept: int = 0
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    selection_ms: float = 0.0
    ttft_ms: float | None = None
    layer_average: float | None = None

    def to_dict(self) -> dict:
        out: dict = super().to_dict()
        out.update(
            visual_tokens=self.visual_tokens,
            visual_kept=self.visual_kept,
            stages={name: dict(v) for name, v in self.stages.items()},
            selection_ms=round(self.selection_ms, 4),
        )
        if self.ttft_ms is not None:
            out["ttft_ms"] = round(self.ttft_ms, 3)
        if self.layer_average is not None:
            out["layer_average"] = round(self.layer_average, 3)
        return out


def owner_rows(records: Sequence[Record], images_per_row: list[int], videos_per_row: list[int]) -> list[int]:
    """The batch row of every record: LLM stages name the row; encoder stages name the image (or video) index,
    row-major over the batch within its modality, which the per-row counts turn back into a row."""
    owners = {
        "image": [row for row, n in enumerate(images_per_row) for _ in range(n)],
        "video": [row for row, n in enumerate(videos_per_row) for _ in range(n)],
    }
    rows = []
    for r in records:
        if r.stage.startswith(LLM_STAGE_PREFIXES):
            rows.append(r.image)
        else:
            rows.append(owners[r.modality][r.image])
    return rows


def sample_counts(
    records: Sequence[Record],
    images_per_row: list[int],
    videos_per_row: list[int],
    visual_tokens: list[int],
    ttft_ms: float | None,
    input_tokens: list[int],
    output_tokens: list[int],
    visual_kept: list[int] | None = None,
) -> list[VisualTokenCounts]:
    """One `VisualTokenCounts` per batch row from the records of one batched `generate`.

    visual_tokens[row]: the row's visual placeholder tokens in the prompt; visual_kept[row]: the visual tokens its
    LLM received (`vtoken.counts.visual_in_llm`; default: all of them); input/output_tokens[row]: its prompt
    and generated token counts (padding excluded).
    """
    kept = visual_tokens if visual_kept is None else visual_kept
    out = [
        VisualTokenCounts(input_tokens=n_in, output_tokens=n_out, visual_tokens=v, visual_kept=k, ttft_ms=ttft_ms)
        for n_in, n_out, v, k in zip(input_tokens, output_tokens, visual_tokens, kept, strict=True)
    ]
    for record, row in zip(records, owner_rows(records, images_per_row, videos_per_row), strict=True):
        counts = out[row]
        stage = counts.stages.setdefault(record.stage, {"tokens_in": 0, "tokens_out": 0})
        stage["tokens_in"] += record.tokens_in
        stage["tokens_out"] += record.tokens_out
        counts.selection_ms += record.seconds * 1e3
        if "layer_average" in record.extra:  # the same value on each of the row's prefill records
            counts.layer_average = float(record.extra["layer_average"])
    return out


def run_means(counts: Sequence[dict]) -> dict[str, float]:
    """Run-level means over samples (their `to_dict()`s): visual tokens, kept tokens, tokens out per stage,
    selection ms and TTFT, keyed `vtoken_*` (lmms-eval's results JSON shows them as `avg_vtoken_*`)."""
    counts = [c for c in counts if c]
    if not counts:
        return {}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    means = {
        "vtoken_samples": float(len(counts)),
        "vtoken_visual_tokens": mean([c["visual_tokens"] for c in counts]),
        "vtoken_visual_kept": mean([c["visual_kept"] for c in counts]),
        "vtoken_selection_ms": mean([c["selection_ms"] for c in counts]),
    }
    ttft = [c["ttft_ms"] for c in counts if "ttft_ms" in c]
    if ttft:
        means["vtoken_ttft_ms"] = mean(ttft)
    averages = [c["layer_average"] for c in counts if "layer_average" in c]
    if averages:
        means["vtoken_visual_layer_average"] = mean(averages)
    stages = dict.fromkeys(s for c in counts for s in c["stages"])
    for stage in stages:
        having = [c["stages"][stage] for c in counts if stage in c["stages"]]
        means[f"vtoken_{stage}_tokens_in"] = mean([s["tokens_in"] for s in having])
        means[f"vtoken_{stage}_tokens_out"] = mean([s["tokens_out"] for s in having])
    return means
