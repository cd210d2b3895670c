"""DART: duplication-aware token reduction (Wen et al., "Stop Looking for Important Tokens in Multimodal Language
Models: Duplication Matters More"; official code ZichenWen1/DART, as vendored in VTC-Bench and LightCompress).

At the input of decoder layer K (`layer`, i.e. after layer K - 1), from layer K - 1:
- pivots: the `image_pivots` visual tokens and the `text_pivots` text tokens after the image with the largest L1
  norm of their post-RoPE key (heads concatenated);
- every pivot in turn, visited in the order of Python's `list(set(...))` over the pivots' sequence indices (image
  pivots first, then text pivots, each by descending norm: the official order, which changes the kept set), takes
  the TOPK remaining non-pivot visual tokens least similar to it: lowest cosine similarity of the layer's output
  hidden states passed through the LLM's final norm; taken tokens leave the pool.
Kept: the image pivots and every pick, in their original order. TOPK = int(V * keep / (image_pivots +
text_pivots)) for a fraction `keep` of a row's V visual tokens, or keep // (image_pivots + text_pivots) for a count
(the official `max_num_trunction`); `keep=1.0` (or a count >= V) keeps every token. No attention weights are read,
so SDPA/flash stay on. `positions="original"` (official: kept tokens keep their positions, decoding continues at
the unpruned length) or "renumber".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..errors import VTokenError
from ..params import Choice, Int, Kept, Layer
from ..tokens import LayerTokens
from .base import PrefillMethod

POSITIONS = ("original", "renumber")


def descending(values: torch.Tensor, count: int) -> list[int]:
    """Indices of the `count` largest entries of `values` [n], largest first (ties: lower index first)."""
    return torch.sort(-values, stable=True).indices[:count].tolist()


def dart_pick(
    keys: torch.Tensor,
    normed: torch.Tensor,
    index: list[int],
    text_keys: torch.Tensor,
    text_normed: torch.Tensor,
    text_index: list[int],
    image_pivots: int,
    text_pivots: int,
    per_pivot: int,
) -> list[int]:
    """One row's kept visual tokens (ascending positions 0..V-1).

    keys [V, K] / text_keys [T, K]: post-RoPE keys; normed [V, D] / text_normed [T, D]: final-normed hidden states;
    index / text_index: each token's index in the row's LLM input (the pivots' visiting order is Python's set order
    over these, as in the official code).
    """
    image = descending(keys.float().abs().sum(-1), min(image_pivots, len(index)))
    text = descending(text_keys.float().abs().sum(-1), min(text_pivots, len(text_index)))
    vectors = {index[i]: normed[i] for i in image} | {text_index[t]: text_normed[t] for t in text}
    pool = [i for i in range(len(index)) if i not in set(image)]
    kept = set(image)
    for pivot in list(set([index[i] for i in image] + [text_index[t] for t in text])):  # Python set order
        if not pool:
            break
        similarity = F.cosine_similarity(vectors[pivot].float()[None], normed[pool].float(), dim=-1)
        taken = [pool[k] for k in torch.sort(similarity, stable=True).indices[:per_pivot].tolist()]
        kept.update(taken)
        taken_set = set(taken)
        pool = [i for i in pool if i not in taken_set]
    return sorted(kept)


@dataclass
class DART(PrefillMethod):
    """`layer`: K, the first layer that runs on the kept tokens (reads layer K - 1; the paper's K = 2). `keep`:
    fraction of each row's visual tokens the picks aim at, or a count (see the module docstring)."""

    layer: int = 2
    keep: Budget = 0.222
    image_pivots: int = 4
    text_pivots: int = 4
    positions: str = "original"

    name = "dart"
    reads = ("keys", "normed")
    params = {
        "keep": Kept(),
        "layer": Layer(
            1, reads=1, hint="the first LLM layer that runs on the kept tokens; DART reads the layer before it"
        ),
        "image_pivots": Int(1, hint="official: 4"),
        "text_pivots": Int(0, hint="official: 4"),
        "positions": Choice(POSITIONS),
    }
    budget_param = "keep"
    controls = ("layer", "keep")

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layer > num_layers - 1:
            raise VTokenError(
                f"dart: layer={self.layer} is not a layer of this LLM, which has {num_layers} layers "
                f"(0..{num_layers - 1}); layer is the first layer that runs on the kept tokens, at most "
                f"{num_layers - 1}"
            )
        return (self.layer - 1,)

    def per_pivot(self, n: int) -> int:
        """TOPK: the visual tokens each pivot picks in a row of n."""
        pivots = self.image_pivots + self.text_pivots
        return self.keep // pivots if isinstance(self.keep, int) else int(n * self.keep / pivots)

    def keeps_all(self, n: int) -> bool:
        return self.keep >= n if isinstance(self.keep, int) else self.keep == 1.0

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        kept = torch.zeros_like(tokens.valid)
        text = tokens.text
        for row, n in enumerate(tokens.counts):
            mine = tokens.valid[row].nonzero().squeeze(1)  # this row's visual slots (rows are padded)
            if n == 0 or self.keeps_all(n):
                kept[row, mine] = True
                continue
            words = text.valid[row]
            picks = dart_pick(
                tokens.keys[row, mine], tokens.normed[row, mine], tokens.index[row, mine].tolist(),
                text.keys[row, words], text.normed[row, words], text.index[row, words].tolist(),
                self.image_pivots, self.text_pivots, self.per_pivot(n),
            )  # fmt: skip
            kept[row, mine[picks]] = True
        return kept
