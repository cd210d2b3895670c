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

from vtoken.kernels import greedy_least_similar

from ..budget import Budget
from ..errors import VTokenError
from ..geometry.tables import on_device
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

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        """Image pivots plus each pivot's picks (capped by what the pool has left), per row: known on the host."""
        return [plan[0] for plan in self._plans(tokens)]

    def _plans(self, tokens: LayerTokens) -> list[tuple[int, int, int, list[int]]]:
        """Per row: (tokens kept, image pivots, text pivots, tokens each visited pivot takes)."""
        words = tokens.text.known if tokens.text.known is not None else tokens.text.valid.sum(1).tolist()
        plans = []
        for n, t in zip(tokens.counts, words, strict=True):
            if n == 0 or self.keeps_all(n):
                plans.append((n, 0, 0, []))
                continue
            image, text = min(self.image_pivots, n), min(self.text_pivots, t)
            pool, per, takes = n - image, self.per_pivot(n), []
            for _ in range(image + text):
                takes.append(min(per, pool))
                pool -= takes[-1]
            plans.append((image + sum(takes), image, text, takes))
        return plans

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        """`dart_pick` for every row at once: pivots by key norm, then the pivots' greedy picks in the official
        visiting order, which is Python's set order over the pivots' sequence indices: read back once per drop
        (the method's one host sync), every other step a fixed burst on the device."""
        valid, text = tokens.valid, tokens.text
        plans = self._plans(tokens)
        if all(image == 0 for _, image, _, _ in plans):  # nothing dropped in any row
            return valid.clone()
        device, (batch, length) = valid.device, valid.shape
        norms = tokens.keys.float().abs().sum(-1)
        if any(n != length for n in tokens.counts):  # padding entries never pivots
            norms = norms.masked_fill(~valid, float("-inf"))
        # largest first, ties to the lower index (a stable descending sort)
        image = torch.sort(norms, dim=1, descending=True, stable=True).indices[:, : self.image_pivots]  # [B, <= ip]
        text_norms = text.keys.float().abs().sum(-1)
        if text.known is None or any(n != text_norms.shape[1] for n in text.known):
            text_norms = text_norms.masked_fill(~text.valid, float("-inf"))
        words = torch.sort(text_norms, dim=1, descending=True, stable=True).indices[:, : self.text_pivots]  # [B, <= tp]
        wide, words_wide = image.shape[1], words.shape[1]
        # the one read: the pivots' indices in the LLM input (their visiting order) and their slots
        read = torch.cat([tokens.index.gather(1, image), text.index.gather(1, words), image, words], 1).tolist()
        takes, pivot_rows = [], []
        steps = max(len(plan[3]) for plan in plans)
        for row, (_, ip, tp, take) in enumerate(plans):  # the official visiting order, on the host
            where = read[row]
            candidates = where[:ip] + where[wide : wide + tp]
            position = {index: k if k < ip else wide + k - ip for k, index in enumerate(candidates)}
            visits = [position[index] for index in list(set(candidates))]  # noqa: C405 - Python's set order
            visits += [0] * (steps - len(visits))
            takes += take + [0] * (steps - len(take))
            # each candidate's row among the image tokens (slots) then the text tokens (length + slot)
            slots = where[wide + words_wide :]
            rows = slots[:wide] + [length + w for w in slots[wide:]]
            pivot_rows += [rows[k] for k in visits]
        # every visual and text token's unit vector at once (each row normalised alone, as `unit` does it); the
        # pivots are rows of it, in their visiting order
        units = unit(torch.cat([tokens.normed, text.normed], 1))
        pivots = on_device(pivot_rows, device).view(batch, steps)
        pivots = units.gather(1, pivots[:, :, None].expand(-1, -1, units.shape[-1]))
        similarity = pivots @ units[:, :length].transpose(1, 2)  # [B, steps, V] cosine similarities
        counts = [plan[1] for plan in plans]
        takes = on_device(takes, device).view(batch, steps)
        if any(n != wide for n in counts):  # rows with fewer tokens than pivots, or keeping all
            pivot_rank = torch.arange(wide, device=device)
            image = image.masked_fill(pivot_rank >= on_device(counts, device)[:, None], length)
            kept = torch.zeros(batch, length + 1, dtype=torch.bool, device=device).scatter_(1, image, True)
            kept = kept[:, :length]
            kept |= greedy_least_similar(similarity, valid & ~kept, takes)  # one op: the pivots' greedy
        else:  # the pool: valid tokens but the image pivots; kept: the pivots and the pool's picks
            pool = valid.scatter(1, image, False)
            kept = (valid ^ pool) | greedy_least_similar(similarity, pool, takes)  # one op: the pivots' greedy
        everything = [plan[1] == 0 for plan in plans]
        if any(everything):
            kept |= valid & on_device([int(e) for e in everything], device).bool()[:, None]
        return kept


def unit(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] in fp32 divided by its L2 norm (clamped at 1e-8), as `F.cosine_similarity` normalises."""
    x = x.float()
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-8)
