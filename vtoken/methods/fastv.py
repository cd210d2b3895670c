"""FastV: after LLM layer K, keep the visual tokens the last prompt token attends to most (Chen et al., "An Image
is Worth 1/2 Tokens After Layer 2"; official code pkunlp-icler/FastV).

Score of visual token j = post-softmax attention of the last token's query to key j in layer K, mean over heads.
Each batch row keeps its top `keep` visual tokens (a fraction of the row's visual tokens, or a count), in their
original order; layers after K run on the shorter sequence. The official code keeps the kept tokens' original
positions (`positions="original"`, the default); "renumber" gives contiguous ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..budget import Budget, tokens_to_keep
from ..errors import VTokenError
from ..params import Choice, Kept, Layer
from ..tokens import LayerTokens
from .base import PrefillMethod, keep_top, padding_excluded

POSITIONS = ("original", "renumber")


@dataclass
class FastV(PrefillMethod):
    """`layer`: the drop point K (0-based; the paper's K = 2). `keep`: fraction of visual tokens kept, or a count."""

    layer: int = 2
    keep: Budget = 0.5
    positions: str = "original"

    name = "fastv"
    query_rows = "last"
    params = {"keep": Kept(), "layer": Layer(), "positions": Choice(POSITIONS)}
    budget_param = "keep"
    controls = ("layer", "keep")

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layer >= num_layers - 1:
            raise VTokenError(
                f"fastv: layer={self.layer} leaves no later layer to save; this LLM has {num_layers} layers "
                f"(0..{num_layers - 1}), so layer must be at most {num_layers - 2}"
            )
        return (self.layer,)

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        return [tokens_to_keep(self.keep, n) if n else 0 for n in tokens.counts]

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        scores = padding_excluded(tokens.attention[:, -1].float(), tokens)  # the last query row
        return keep_top(scores, self.kept_counts(tokens))
