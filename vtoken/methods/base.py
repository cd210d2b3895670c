"""Method base classes.

A method is a small dataclass. Most are one `score()` function: the base class owns budgets, top-k and ordering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..budget import Budget, check_budget, tokens_to_keep
from ..tokens import Selection, VisualTokens


@dataclass
class Method:
    """A visual-token reduction method.

    name: registered name. stage: where it acts ("encoder" = on the vision features, before the LLM).
    requires: score signals the adapter must provide (see `VisualTokens.signals`).
    """

    budget: Budget = 0.25

    name: ClassVar[str] = ""
    stage: ClassVar[str] = "encoder"
    requires: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.budget = check_budget(self.budget)

    def keep_count(self, n: int) -> int:
        """Tokens kept per crop of n tokens."""
        return tokens_to_keep(self.budget, n)

    def planned_count(self, n: int) -> int | None:
        """Tokens a crop of n keeps, when known before its features exist (None: decided from the data).

        Knowing "how many" before the encoder runs lets the adapter shrink the prompt while the GPU is still idle.
        """
        return self.keep_count(n)

    def select(self, tokens: VisualTokens) -> Selection:
        """Decide which tokens of every crop reach the LLM."""
        raise NotImplementedError


@dataclass
class ScoreMethod(Method):
    """Keep the top-k tokens of each crop by `score`, in ascending (original) order."""

    def score(self, tokens: VisualTokens) -> torch.Tensor:
        """Importance of every token: [C, N], higher is kept first."""
        raise NotImplementedError

    def select(self, tokens: VisualTokens) -> Selection:
        scores = self.score(tokens)
        if tokens.valid is None:
            k = self.keep_count(tokens.num_tokens)
            return Selection(kept=scores.topk(k, dim=-1).indices.sort(dim=-1).values)
        # crops with invalid tokens: budget over the valid ones; rows padded with N after the kept indices
        counts = [self.keep_count(int(v)) if v else 0 for v in tokens.valid.sum(dim=1).tolist()]
        top = scores.float().masked_fill(~tokens.valid, float("-inf")).topk(max(counts), dim=-1).indices
        rank = torch.arange(top.shape[1], device=top.device)
        limit = torch.tensor(counts, device=top.device)[:, None]
        kept = torch.where(rank < limit, top, tokens.num_tokens).sort(dim=-1).values
        return Selection(kept=kept, counts=counts)
