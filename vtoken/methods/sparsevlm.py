"""SparseVLM: text-guided visual-token sparsification with token recycling (Zhang et al., "SparseVLM: Visual Token
Sparsification for Efficient Vision-Language Model Inference", ICML 2025; official code Gumpest/SparseVLMs, v1.0).

- Raters, once per prompt, from the LLM's input embeddings: with V a row's visual embeddings and T every token
  after its (first) image, m = softmax over T of the raw dot products V T^T, averaged over V; the raters are the
  text tokens with m_t > mean(m) (when all m_t are equal, e.g. a single text token: all of them).
- After each layer in `layers`, score of a visual token = that layer's post-softmax causal attention (head mean)
  from the raters to it, averaged over the raters (rows only: SDPA/flash stay on). A row keeps its top
  min(k_s, n - 1) of its n current visual tokens (`keep`, or the official table chosen by `budget`): one token is
  always dropped, so there is no keep-all setting.
- Recycling: the top int(0.3 * n_drop) + 1 dropped tokens by the same score are clustered by DPC-kNN on the
  layer's output hidden states (distances / sqrt(C), k = cluster count = int(m / 10) + 1, density exp(-mean
  squared distance to the k nearest) plus U(0, 1e-6) noise from a generator seeded with `seed` for every row and
  drop, centres = the largest distance-to-denser-token x density, every token to its nearest centre; in float64);
  each cluster becomes sum / (count + 1e-6), placed right after the row's kept visual tokens, in centre order;
  they count as visual tokens at later drops.
Later layers get contiguous renumbered positions; decoding continues, layer by layer, right after that layer's own
prompt (the official code has no decode stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import VTokenError
from ..geometry.tables import on_device
from ..params import Choice, Counts, Int, Layers, OrNone
from ..tokens import LayerTokens, Merged
from ..validation import integer
from .base import PrefillMethod, droppable_layers, keep_top, nearest_layers

# the official settings: visual tokens kept after layers 2, 6 and 15 for an average of ~192/128/96/64 per layer
BUDGETS = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
RECYCLED_SHARE = 0.3  # of the dropped tokens, the best scored this share (+ 1) are recycled
TOKENS_PER_CLUSTER = 10
NOISE = 1e-6
OFFICIAL_HINT = "the official settings: average visual tokens per layer; or keep=(k1, k2, ...) with explicit counts"


def rater_mask(visual: torch.Tensor, visual_valid: torch.Tensor, text: torch.Tensor, text_valid: torch.Tensor):
    """[B, T] bool: the raters among text tokens [B, T, D] by the visual embeddings [B, V, D] (see the module)."""
    logits = (visual.float() @ text.float().transpose(1, 2)).masked_fill(~text_valid[:, None, :], float("-inf"))
    relevance = logits.softmax(dim=-1).nan_to_num(0.0) * visual_valid[:, :, None]  # [B, V, T]
    m = relevance.sum(1) / visual_valid.sum(1, keepdim=True).clamp(min=1)  # [B, T]
    mean = (m * text_valid).sum(1, keepdim=True) / text_valid.sum(1, keepdim=True).clamp(min=1)
    raters = (m > mean) & text_valid
    alike = ~raters.any(1, keepdim=True)  # every m_t equal: none is above the mean
    return raters | (alike & text_valid)


def dpc_knn_merge(x: torch.Tensor, clusters: int, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cluster tokens x [N, C] into `clusters` by DPC-kNN and merge each cluster to sum / (count + 1e-6).

    noise: [N] added to the densities (ties). Returns the merged tokens [clusters, C] (fp32) in centre order (by
    descending distance x density) and the centres' indices into x [clusters]. Computed in float64: the densities
    of close tokens differ by about the 1e-6 noise, which fp32 near 1.0 (a 6e-8 step) cannot order reliably, so
    in fp32 the clusters would follow rounding (and differ between a batch and its rows run alone).
    """
    x = x.double()
    distance = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / x.shape[1] ** 0.5
    nearest = distance.topk(clusters, dim=-1, largest=False).values
    density = (-(nearest**2).mean(-1)).exp() + noise.to(x)
    denser = density[None, :] > density[:, None]  # [i, j]: token j is denser than token i
    parent = torch.where(denser, distance, distance.max()).min(-1).values
    centres = (parent * density).topk(clusters).indices
    assign = distance[centres].argmin(0)  # nearest centre (first on ties)
    assign[centres] = torch.arange(clusters, device=x.device)
    sums = x.new_zeros(clusters, x.shape[1]).index_add_(0, assign, x)
    counts = torch.bincount(assign, minlength=clusters).to(x)
    return (sums / (counts[:, None] + 1e-6)).float(), centres


def dpc_knn_merge_rows(
    x: torch.Tensor, counts: list[int], clusters: list[int], noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dpc_knn_merge` for every row of x [B, N, C] at once: row b clusters its first counts[b] tokens into
    clusters[b] (0: none); noise [N] (row b adds its first counts[b]). Returns merged tokens [B, K, C] (fp32, K =
    max clusters, rows padded with zeros) and the centres' indices into each row [B, K] (padding: 0). Padding
    tokens sit at infinite distance, so each row's numbers are its own; no host sync."""
    batch, width = x.shape[:2]
    device = x.device
    most = max(clusters, default=0)
    x = x.double()
    # every row full (each clusters all `width` tokens into `most`): no mask has anything to mask, so none is made
    full = all(n == width for n in counts)
    every = all(k == most for k in clusters)
    real = None if full else torch.arange(width, device=device) < on_device(counts, device)[:, None]  # [B, N]
    pair = None if full else real[:, :, None] & real[:, None, :]
    distance = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / x.shape[2] ** 0.5
    if pair is not None:
        distance = distance.masked_fill(~pair, float("inf"))
    nearest = distance.topk(most, dim=-1, largest=False).values  # [B, N, K] ascending
    even = len(set(clusters)) == 1
    squared = nearest**2
    if even:
        mean = squared.mean(-1)
    else:
        limit = on_device(clusters, device)
        used = torch.arange(most, device=device) < limit[:, None, None]
        mean = squared.masked_fill(~used, 0.0).sum(-1) / limit[:, None].clamp(min=1)
    density = (-mean).exp() + noise[:width].to(x)
    denser = density[:, None, :] > density[:, :, None]  # [b, i, j]: token j is denser than token i
    # each row's largest distance
    top = (distance if pair is None else distance.masked_fill(~pair, float("-inf"))).amax(dim=(1, 2), keepdim=True)
    parent = torch.where(denser if real is None else denser & real[:, None, :], distance, top).min(-1).values
    score = parent * density if real is None else (parent * density).masked_fill(~real, float("-inf"))
    centres = score.topk(most, dim=-1).indices  # [B, K] by descending score
    centre_real = None if every else torch.arange(most, device=device) < on_device(clusters, device)[:, None]
    to_centre = distance.gather(1, centres[:, :, None].expand(-1, -1, width))  # [B, K, N]
    if centre_real is not None:
        to_centre = to_centre.masked_fill(~centre_real[:, :, None], float("inf"))
    assign = to_centre.argmin(1)  # nearest centre, first on ties
    own = torch.cat([assign, torch.zeros_like(assign[:, :1])], 1)  # every centre is its own cluster's (a row's
    # centres beyond its count write a dump column; padding: cluster `most`, a dump too)
    placed = centres if centre_real is None else centres.masked_fill(~centre_real, width)
    own = own.scatter(1, placed, torch.arange(most, device=device).expand(batch, -1))
    assign = own[:, :width] if real is None else own[:, :width].masked_fill(~real, most)
    sums = x.new_zeros(batch, most + 1, x.shape[2]).scatter_add_(1, assign[:, :, None].expand_as(x), x)
    ones = x.new_ones(batch, width) if real is None else real.to(x)
    sizes = x.new_zeros(batch, most + 1).scatter_add_(1, assign, ones)
    merged = (sums / (sizes[:, :, None] + 1e-6))[:, :most].float()
    if centre_real is None:
        return merged, centres
    return merged.masked_fill(~centre_real[:, :, None], 0.0), centres.masked_fill(~centre_real, 0)


@dataclass
class SparseVLM(PrefillMethod):
    """`budget`: the official setting (192, 128, 96 or 64 visual tokens on average, default 192) or `keep`: the
    tokens kept after each layer of `layers` explicitly; `seed`: the density noise's generator seed."""

    budget: int | None = None
    keep: tuple[int, ...] | None = None
    layers: tuple[int, ...] = (2, 6, 15)
    seed: int = 0

    name = "sparsevlm"
    query_rows = "chosen"
    reads = ("attention", "hidden")
    params = {
        "layers": Layers("(2, 6, 15)"),
        "seed": Int(0, hint="the density noise's generator seed"),
        "budget": OrNone(Choice(tuple(sorted(BUDGETS)), hint=OFFICIAL_HINT)),
        "keep": OrNone(Counts(hint="the tokens kept after each layer of layers")),
    }
    budget_param = "budget"  # an official setting: a count (a fraction leaves it unset)
    merges = True  # recycled tokens are merged into cluster centres
    controls = ("layers", "keep")
    demo_params = {"keep": BUDGETS[192]}  # the counts control shows the official 192 setting

    @classmethod
    def fit(cls, model) -> dict:
        """The official layers scaled to a shallower LLM's depth, the official counts of the last ones."""
        scored = droppable_layers(model)
        if not scored:
            return {}
        layers = nearest_layers(scored, cls.defaults()["layers"], model.llm_layers)
        return {"layers": tuple(layers), "keep": BUDGETS[192][-len(layers) :]}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is not None and self.keep is not None:
            raise VTokenError("sparsevlm: give budget (an official setting) or keep (explicit counts), not both")
        if self.keep is not None:
            expected = f"{len(self.layers)} token counts >= 1, one per layer of layers={self.layers}"
            keep = self.keep
            if isinstance(keep, (str, bytes)) or not isinstance(keep, Sequence) or len(keep) != len(self.layers):
                raise VTokenError(f"sparsevlm: keep={keep!r}; expected {expected}, e.g. (300, 200, 110)")
            self.keep = tuple(integer(self.name, "keep", k, 1, hint=expected) for k in keep)
        elif len(self.layers) != 3:
            raise VTokenError(
                f"sparsevlm: the official budgets give 3 counts, for 3 layers; layers={self.layers} has "
                f"{len(self.layers)}: give keep=(...) with one count per layer"
            )

    @property
    def counts(self) -> tuple[int, ...]:
        """Visual tokens kept after each layer of `layers` (before recycling)."""
        return self.keep if self.keep is not None else BUDGETS[self.budget or 192]

    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layers[-1] >= num_layers - 1:
            raise VTokenError(
                f"sparsevlm: layers={self.layers} needs drop points before the last layer; this LLM has "
                f"{num_layers} layers (0..{num_layers - 1})"
            )
        return self.layers

    def choose_rows(self, visual, visual_valid, text, text_valid) -> torch.Tensor:
        return rater_mask(visual, visual_valid, text, text_valid)

    def scores(self, tokens: LayerTokens) -> torch.Tensor:
        """[B, V] the raters' mean attention to each visual token (-inf where invalid); made once per drop (kept on
        `tokens`: `keep_mask` and `merge` both read it)."""
        made = tokens.__dict__.get("_sparsevlm_scores")
        if made is not None:
            return made
        raters = tokens.row_valid.sum(1, keepdim=True).clamp(min=1)
        scores = tokens.attention.float().sum(1) / raters
        if any(n != scores.shape[1] for n in tokens.counts):  # padding entries
            scores = scores.masked_fill(~tokens.valid, float("-inf"))
        tokens.__dict__["_sparsevlm_scores"] = scores
        return scores

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        k = self.counts[self.layers.index(tokens.layer)]
        return [min(k, n - 1) if n else 0 for n in tokens.counts]

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        return keep_top(self.scores(tokens), self.kept_counts(tokens))

    def recycled(self, dropped: int) -> tuple[int, int]:
        """Of `dropped` tokens, how many are recycled and into how many clusters (0, 0: none dropped)."""
        if dropped == 0:
            return 0, 0
        recycled = int(dropped * RECYCLED_SHARE) + 1
        return recycled, recycled // TOKENS_PER_CLUSTER + 1

    def merge(self, tokens: LayerTokens, keep: torch.Tensor) -> Merged | None:
        """Recycling for every row at once; the counts come from the host (`recycled`), so nothing waits."""
        kept = self.kept_counts(tokens)
        plans = [self.recycled(n - k) for n, k in zip(tokens.counts, kept, strict=True)]
        counts, clusters = [p[0] for p in plans], [p[1] for p in plans]
        if max(clusters, default=0) == 0:
            return None
        scores = self.scores(tokens).masked_fill(keep, float("-inf"))  # the dropped ones (padding is -inf already)
        # dropped, best first (a stable descending sort: ties to the lower index)
        best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : max(counts)]
        noise = self._noise(max(counts), scores.device)
        hidden = tokens.hidden.gather(1, best[:, :, None].expand(-1, -1, tokens.hidden.shape[-1]))
        merged, centres = dpc_knn_merge_rows(hidden, counts, clusters, noise)
        if all(k == merged.shape[1] for k in clusters):
            valid = torch.ones(merged.shape[:2], dtype=torch.bool, device=best.device)
        else:
            valid = torch.arange(merged.shape[1], device=best.device) < on_device(clusters, best.device)[:, None]
        return Merged(merged, valid, best.gather(1, centres), known=clusters)

    def _noise(self, count: int, device: torch.device) -> torch.Tensor:
        """The density noise: the seed's generator's first `count` draws (the same for every row and drop), made
        once per count and device (a drop then reads it: no host work, no copy)."""
        made = self.__dict__.setdefault("_noises", {})
        key = (count, str(torch.device(device)), self.seed)
        if key not in made:
            noise = torch.rand(count, generator=torch.Generator().manual_seed(self.seed)) * NOISE
            cpu = torch.device(device).type == "cpu"
            made[key] = noise if cpu else noise.pin_memory().to(device, non_blocking=True)
        return made[key]
