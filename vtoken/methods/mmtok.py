"""MMTok: multimodal coverage maximisation (Dong et al., 2025; official code Ironieser/MMTok).

Every crop keeps the k tokens that greedily maximise how well they *cover* both the question's text tokens and
the crop's own vision tokens. For a crop with projected tokens v [N, D] (the LLM's space), vision features u
[N, Dv] and question embeddings z [T, D], all L2-normalised (x / max(|x|, 1e-8)) and in float32:

    P = softmax_j(z v^T / tau_tv) / T            text -> vision coverage   [T, N]
    Q = softmax_j(u u^T / tau_vv) / N            vision -> vision coverage [N, N]
    C = [P ; alpha * Q]                                                     [T + N, N]

Greedy max coverage, k steps: gain_j = sum over rows of max(C[row, j] - best[row], 0) (chosen and excluded
columns -inf), pick the first argmax, best <- max(best, C[:, j]). Kept indices ascending; a crop of N <= k
valid tokens keeps them all. The loop is k steps of batched tensor ops over all crops at once, with no host sync.

The question is read from the prompt (see `vtoken.question`). LLaVA families use its keywords (lmms-eval answer
suffixes and stop words removed), Qwen families `"Question: " + question`; tau_tv defaults to 0.02 (LLaVA) and
0.01 (Qwen). Invalid tokens (LLaVA-NeXT's unpadded border in the native layout; LLaVA-1.5 patches lying wholly
in the pad-to-square border) are neither candidates nor rows to cover, and N counts only valid tokens. The
paper's optional "VLM agent" text refinement is not in the official code and not here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..budget import Budget
from ..params import Choice, OrNone, Real, Texts
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, topk_per_crop

LMMS_EVAL_SUFFIXES = (
    "Answer the question using a single word or phrase.",
    "Answer with the option's letter from the given choices directly.",
)
STOP_WORDS = frozenset(
    "a an the is are was were be been being have has had do does did it they he she we you i what where when why "
    "how who which and or but so if then question answer to for with by from at into onto upon".split()
)
TEXT_MODES = ("auto", "keywords", "question")


def keywords(question: str) -> str:
    """The question's keywords, space-joined (the whole question when none survive)."""
    text = question
    for suffix in LMMS_EVAL_SUFFIXES:
        text = text.replace(suffix, " ")
    words = [w for w in re.findall(r"\b\w+\b", text) if w.lower() not in STOP_WORDS]
    return " ".join(words) if words else question


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def coverage_matrix(
    text: torch.Tensor,
    text_mask: torch.Tensor,
    projected: torch.Tensor,
    vision: torch.Tensor,
    valid: torch.Tensor,
    tau_tv: float,
    tau_vv: float,
    alpha: float,
) -> torch.Tensor:
    """C = [P ; alpha * Q] for B crops: [B, T + N, N] in float32.

    text [B, T, D] question embeddings (rows past `text_mask` [B, T] are padding and give zero rows); projected
    [B, N, D]; vision [B, N, Dv]; valid [B, N] bool (invalid tokens: zero rows, zero columns, not counted in N).
    """
    z, v, u = _unit(text.float()), _unit(projected.float()), _unit(vision.float())
    columns = valid[:, None, :]
    p = torch.softmax((z @ v.transpose(1, 2) / tau_tv).masked_fill(~columns, float("-inf")), dim=-1)
    p = (p * text_mask[..., None]) / text_mask.sum(1).clamp(min=1)[:, None, None]
    q = torch.softmax((u @ u.transpose(1, 2) / tau_vv).masked_fill(~columns, float("-inf")), dim=-1)
    q = (q * valid[..., None]) / valid.sum(1).clamp(min=1)[:, None, None]
    return torch.cat([p, alpha * q], dim=1).nan_to_num(0.0)


def greedy_max_coverage(coverage: torch.Tensor, k: int, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """k greedy picks per crop, in pick order: [B, k] column indices of coverage [B, R, N] (entries >= 0).

    excluded [B, N] bool: columns never picked while others remain.
    """
    batch, rows, n = coverage.shape
    best = coverage.new_zeros(batch, rows, 1)
    blocked = torch.zeros(batch, n, dtype=torch.bool, device=coverage.device) if excluded is None else excluded.clone()
    picks = torch.empty(batch, k, dtype=torch.long, device=coverage.device)
    arange = torch.arange(batch, device=coverage.device)
    for step in range(k):
        gain = (coverage - best).clamp_(min=0).sum(1)  # [B, N]
        pick = gain.masked_fill_(blocked, float("-inf")).argmax(-1)  # the first maximum
        picks[:, step] = pick
        blocked[arange, pick] = True
        best = torch.maximum(best, coverage[arange, :, pick][..., None])
    return picks


@dataclass
class MMTok(EncoderMethod):
    """`budget`: tokens kept per crop (video frame, Qwen image), a fraction or a count. `alpha`: weight of the
    vision-coverage rows. `tau_tv` (None: 0.02 LLaVA, 0.01 Qwen) and `tau_vv`: softmax temperatures.
    `question`: overrides the question read from the prompt (one string, or one per batch row). `text`: "auto"
    (the official choice per family), "keywords" or "question" ("Question: " + question)."""

    budget: Budget = 0.2
    alpha: float = 0.5
    tau_tv: float | None = None
    tau_vv: float = 0.2
    question: str | list[str] | None = None
    text: str = "auto"

    name = "mmtok"
    requires = ("question", "projected", "vision_features")
    scopes = ("crop",)
    params = {
        "alpha": Real("[0, inf)", hint="the weight of vision coverage"),
        "tau_tv": OrNone(Real("(0, inf)", hint="a temperature, or None")),
        "tau_vv": Real("(0, inf)", hint="a temperature"),
        "question": OrNone(Texts()),
        "text": Choice(TEXT_MODES),
    }
    layouts = ("native", "official")
    controls = ("budget", "scope", "alpha")
    excludes_pad_border = True  # LLaVA-1.5: patches wholly in the pad-to-square border are never picked

    def planned_count(self, n: int) -> int | None:
        return None  # valid tokens (pad border) are known only from the pixels

    def count_before_encoding(self, n: int, grid: tuple[int, int], crops: int = 1) -> int | None:
        return self.keep_count(n) if n else 0  # n: the valid tokens, read from the pixels by the caller

    def query(self, question: str, family: str) -> str:
        """The text whose embeddings the tokens must cover."""
        qwen = family.startswith("qwen")
        mode = ("question" if qwen else "keywords") if self.text == "auto" else self.text
        return "Question: " + question if mode == "question" else keywords(question)

    def select(self, tokens: VisualTokens) -> Selection:
        query = tokens.question
        tau_tv = self.tau_tv if self.tau_tv is not None else (0.01 if query.family.startswith("qwen") else 0.02)
        n, crops = tokens.num_tokens, tokens.num_crops
        valid = tokens.valid if tokens.valid is not None else torch.ones(crops, n, dtype=torch.bool)
        valid = valid.to(tokens.features.device)
        images = tokens.image_index.tolist() if tokens.image_index is not None else list(range(crops))
        embedded = {i: query.embed(self.query(query.questions[i], query.family)) for i in sorted(set(images))}
        length = max(len(e) for e in embedded.values())
        text = tokens.features.new_zeros(crops, length, embedded[images[0]].shape[-1], dtype=torch.float32)
        text_mask = torch.zeros(crops, length, dtype=torch.bool, device=text.device)
        for crop, image in enumerate(images):
            text[crop, : len(embedded[image])] = embedded[image].float()
            text_mask[crop, : len(embedded[image])] = True
        coverage = coverage_matrix(text, text_mask, tokens.signals["projected"], tokens.signals["vision_features"],
                                   valid, tau_tv, self.tau_vv, self.alpha)  # fmt: skip
        counts = [self.keep_count(int(v)) if v else 0 for v in valid.sum(1).tolist()]
        picks = greedy_max_coverage(coverage, max(max(counts), 1), ~valid)
        # crop c keeps its first counts[c] picks: rank them by pick order (later picks go to a spare column n)
        steps = torch.arange(picks.shape[1], device=picks.device)
        picks = torch.where(steps < torch.tensor(counts, device=picks.device)[:, None], picks, n)
        rank = torch.full((crops, n + 1), float("-inf"), device=picks.device)
        rank.scatter_(1, picks, -steps.float().expand_as(picks))
        return topk_per_crop(rank[:, :n], counts)
