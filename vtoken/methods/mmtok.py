"""MMTok: multimodal coverage maximisation (Dong et al., 2025; official code Ironieser/MMTok).

Every crop keeps the k tokens that greedily maximise how well they *cover* both the question's text tokens and
the crop's own vision tokens. For a crop with projected tokens v [N, D] (the LLM's space), vision features u
[N, Dv] and question embeddings z [T, D], all L2-normalised (x / max(|x|, 1e-8)) and in float32:

    P = softmax_j(z v^T / tau_tv) / T            text -> vision coverage   [T, N]
    Q = softmax_j(u u^T / tau_vv) / N            vision -> vision coverage [N, N]
    C = [P ; alpha * Q]                                                     [T + N, N]

Greedy max coverage, k steps: gain_j = sum over rows of max(C[row, j] - best[row], 0) (chosen and excluded
columns -inf), pick the first argmax, best <- max(best, C[:, j]). Kept indices ascending; a crop of N <= k
valid tokens keeps them all. The greedy runs as the custom op `vtoken::greedy_max_coverage`
(`vtoken.kernels.coverage`, the step kernel SCOPE's weighted greedy shares): on CUDA one Triton launch per step
over every crop; its PyTorch reference (k batched steps) elsewhere. Counts come from the host-side valid counts
(LLaVA-1.5's pad border is read from the pixels: its valid counts are read back once, the one host sync).

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
from torch.nn.utils.rnn import pad_sequence

from vtoken.kernels.coverage import greedy_max_coverage as coverage_picks

from ..budget import Budget
from ..params import Choice, OrNone, Real, Texts
from ..tokens import Selection, VisualTokens
from .base import EncoderMethod, valid_mask

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

    excluded [B, N] bool: columns never picked while others remain. (The custom op `vtoken::greedy_max_coverage`
    with k steps for every crop.)
    """
    batch, _, n = coverage.shape
    if excluded is None:
        excluded = torch.zeros(batch, n, dtype=torch.bool, device=coverage.device)
    counts = torch.full((batch,), k, dtype=torch.long, device=coverage.device)
    return coverage_picks(coverage, excluded, counts, k)


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
        crops = tokens.num_crops
        device = tokens.features.device
        valid = valid_mask(tokens, device)
        # every image's question embedded once (its rows padded), then gathered for its crops on the device
        embedded = [query.embed(self.query(question, query.family)).float().to(device) for question in query.questions]
        table = pad_sequence(embedded, batch_first=True)
        table_mask = pad_sequence([torch.ones(len(e), dtype=torch.bool, device=device) for e in embedded], True)
        images = tokens.image_index.to(device) if tokens.image_index is not None else torch.arange(crops, device=device)
        text, text_mask = table[images], table_mask[images]
        coverage = coverage_matrix(text, text_mask, tokens.signals["projected"], tokens.signals["vision_features"],
                                   valid, tau_tv, self.tau_vv, self.alpha)  # fmt: skip
        counts = [self.keep_count(v) if v else 0 for v in tokens.host_valid_counts()]
        picks = coverage_picks(coverage, ~valid, self.keep_counts(valid.sum(1)), max(max(counts, default=0), 1))
        return Selection(kept=picks.sort(dim=-1).values, counts=counts)  # padded with N past each count
