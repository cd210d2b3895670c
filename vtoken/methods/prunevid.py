"""PruneVid: visual token pruning for efficient video LLMs (Huang et al., "PruneVid: Visual Token Pruning for Efficient
Video Large Language Models", ACL 2025 Findings; official code Visual-AI/PruneVid @b12600c, PLLaVA only, CC BY-NC-SA:
described here, not copied; METHODS-4-video.md).

Encoder stage, on one video's LLM-input tokens x [F, T, D] (post projector and pooling, no newline):

1. Frames: g_f = mean_t x_f,t; density-peak clustering (DPC-kNN, k' = min(`k`, F)) picks n_c = max(1, int(F *
   `segment_ratio`)) centres (the best scores; ties: the lower frame); every frame takes the rank of its nearest
   centre (ties: the better-ranked centre), a centre its own.
2. Refinement: each label keeps its longest runs of frames when at least 2 long (all of them when tied); every
   other frame is free. Each gap of free frames, left to right, takes the label of its longer neighbour block (the
   left one measured as already relabelled; ties and a lone left neighbour: left; no neighbour: label 0), one
   device kernel (`vtoken::fill_gaps`).
3. Windows: the maximal runs of equal labels.
4. Static positions of a window of W >= 2 frames: s_j = mean over ordered pairs of distinct frames of cos(x_a,j,
   x_b,j) > `tau` (computed as (|sum of unit vectors|^2 - sum of their squared norms) / (W (W - 1))); W = 1: none.
5. Static group: the window mean of each static position (ascending). More than `min_tokens` of them: DPC-kNN with
   int(n * `cluster_ratio`) centres (at least 1), every token to its nearest centre (Euclidean; ties: the better
   rank), a centre to itself; the output is each cluster's plain mean in centre-rank order (descending score).
   Otherwise the means unchanged. Recorded at the centre's (own) position in the window's first frame.
6. Dynamic groups: per frame of the window, its non-static positions, clustered exactly as in 5; recorded at the
   centre's position in its own frame.
7. Output per video: windows in order, each [static group, frame 1's dynamic group, ..., frame W's].

Prefill stage (`layer` = K; None: the encoder stage alone, LightCompress's form):

8. After layer K has run on the whole sequence, every visual token j is scored by the layer's attention without
   rotary and without a causal mask: per head h and query row r (every token after the row's last visual token),
   p = softmax over all keys of q_h,r . k_g(h),j * scaling (q, k the projections before rotary, after QK-norm where
   the layer has it; g(h) the head's KV group); score_j = max over heads, then over rows.
9. Each window keeps its int(n_static * `alpha`) best static tokens, each frame its int(n_dynamic * `alpha`) best
   dynamic tokens (ties: the lower index; 0 allowed); kept ascending; other tokens (text, OneVision's newline) stay.
10. The KV caches of layers 0..K are cut to what is kept; later layers run on it; positions stay the original ones.

Signals: "projected" (the tokens in the LLM's space) and "projected_merge" (the family takes a merge of them as it
is: no projector after selection). Families: LLaVA-OneVision (the paper's; the video's one
newline after its tokens, never a candidate; contiguous positions), Qwen2-VL / Qwen2.5-VL / Qwen3-VL (extension: each
token at its recorded (t, h, w); Qwen3-VL's timestamps stay). Images are refused.

Differences from the official code (docs/differences.md): every video of every row (the official: one video, batch
1, frame count and pooling fixed by its config); fewer than 7 frames (the official k = 7 > F raises: k' = min(k, F))
and fewer than 4 (int(F / 4) = 0 centres: at least 1); a one-frame window (a division by zero: nothing static);
seeded noise (the official: unseeded `torch.rand`); ties to the lower index; merges in fp32 (the official: the
model's dtype); grouped-query attention (the official un-rotated product skips `repeat_kv` and crashes: each head
reads its KV group). GPU: frames, groups and videos of equal length batched, a fixed number of ops and one kernel
for the gap scan; one host sync per call sizes the output and the groups' counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..errors import VTokenError
from ..geometry.tables import on_device
from ..kernels import fill_gaps
from ..kernels.plain_attention import plain_attention_max  # noqa: F401 - step 8's read, the engine's
from ..params import Int, Layer, OrNone, Param, Real
from ..tokens import LayerTokens, Selection, VisualTokens
from .base import EncoderMethod, PrefillMethod, droppable_layers
from .density import density_peak_scores, descending_rank, segment_bounds
from .fastvid import video_selection

if TYPE_CHECKING:
    from ..modelview import ModelView


# whether vtoken's LLM engine runs the cut inside the LLM (steps 8-10): it reads the plain attention
# ("plain_attention" of the rows after the row's last visual token) and hands the encoder stage's groups on
# (`LayerTokens.groups` / `group_sizes` from `Selection.groups` / `group_sizes`); while False, `patch` refuses
# layer=K and the tools fit layer=None (the encoder stage alone)
CUT_WIRED = True


@dataclass(frozen=True)
class NoBudget(Param):
    """A parameter a method inherits but does not have: only None."""

    def check(self, method: Any, name: str, value: Any) -> Any:
        if value is not None:
            raise VTokenError(f"{method.name}: {name}={value!r}; it has none ({self.hint})")
        return None

    def accepts(self, value: Any) -> bool:
        return value is None

    def text(self) -> str:
        return f"None ({self.hint})"


def prunevid_noise(seed: int, frames: int, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The densities' tie-breaking noise of a video: ([F] U(0, 1) for the frames, [F, T] for the tokens: a group's
    token j at frame f draws entry [f, j], the static group of a window the row of its first frame), drawn in that
    order from one generator seeded with `seed` on `device` (the official code draws unseeded `torch.rand`)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    first = torch.rand(frames, generator=generator, device=device)
    return first, torch.rand(frames, tokens, generator=generator, device=device)


def frame_labels(means: torch.Tensor, noise: torch.Tensor, k: int, centres: int) -> torch.Tensor:
    """Step 1 on V videos: means [V, F, D] the frames' mean tokens, noise [F]. Returns [V, F] int64 labels: each
    frame's nearest centre's rank (0 = the best score; a centre its own), `centres` centres, density over the
    min(k, F) nearest frames (itself included)."""
    videos, frames = means.shape[:2]
    score, dist = density_peak_scores(means, None, min(k, frames), noise[None].expand(videos, -1))
    order = score.argsort(dim=-1, descending=True, stable=True)  # frames by rank
    by_rank = dist.gather(2, order[:, None, :].expand(-1, frames, -1))  # [V, F, F]: distance to each rank's frame
    by_rank = by_rank.masked_fill(torch.arange(frames, device=means.device) >= centres, float("inf"))
    nearest = by_rank.argmin(dim=-1)  # the first minimum: the better-ranked centre on ties
    rank = descending_rank(score)
    return torch.where(rank < centres, rank, nearest)


def refine_labels(labels: torch.Tensor) -> torch.Tensor:
    """Step 2 on V videos: labels [V, F] (values < F) -> [V, F] refined labels. A label keeps its longest runs
    when at least 2 frames long (all of the tied ones); every gap of other frames takes a neighbour's label
    (`vtoken::fill_gaps`)."""
    videos, frames = labels.shape
    device = labels.device
    index = torch.arange(frames, device=device)
    ends = torch.cat([labels[:, 1:] != labels[:, :-1], torch.ones(videos, 1, dtype=torch.bool, device=device)], 1)
    start, end = segment_bounds(ends)
    run = end - start + 1  # each frame's run length
    longest = torch.zeros(videos, frames, dtype=torch.long, device=device).scatter_reduce(1, labels, run, "amax")
    kept = (run == longest.gather(1, labels)) & (run >= 2)
    after = torch.where(kept, index, frames).flip(1).cummin(dim=1).values.flip(1)  # the first kept frame from f on
    found = after < frames
    after = after.clamp(max=frames - 1)
    right_length = torch.where(found, run.gather(1, after), 0)
    right_label = torch.where(found, labels.gather(1, after), 0)
    return fill_gaps(labels, kept, right_length, right_label)


@dataclass
class MergedGroups:
    """What PruneVid's encoder stage decided for V videos of F frames, T tokens each; `apply` builds the output
    from any per-token features aligned with the tokens (the LLM-input tokens, or Qwen3-VL's DeepStack levels).

    window_mean: [V, F, F] each window's frames weighted 1 / W at its first frame (0 elsewhere); members: [V, F, 2,
    T, T] 0/1, the tokens (positions) each output absorbs, group 0 = the static group of the window starting at the
    frame (window means), 1 = the frame's dynamic group (its own tokens); order: [V, F, T] the output rows of each
    frame as (group * T + position), the frame's static outputs first, each group in output order; keep: [V, F, T]
    the positions each frame's outputs are recorded at; kinds: [V, F, 2] outputs per group; width: T."""

    window_mean: torch.Tensor
    members: torch.Tensor
    order: torch.Tensor
    keep: torch.Tensor
    kinds: torch.Tensor
    width: int

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [V, F, T, D] -> (rows [V, F, T, D] fp32, positions [V, F, T]) in output order; rows past a frame's
        count are padding."""
        videos, frames, tokens, dim = x.shape
        x = x.float()
        means = torch.matmul(self.window_mean, x.reshape(videos, frames, tokens * dim)).view_as(x)
        groups = torch.stack([means, x], dim=2)  # [V, F, 2, T, D]
        count = self.members.sum(-1, keepdim=True)
        merged = torch.matmul(self.members, groups) / count.clamp(min=1)  # each output: its members' plain mean
        rows = merged.flatten(2, 3).gather(2, self.order[..., None].expand(-1, -1, -1, dim))
        return rows, self.order % tokens

    def group_rows(self) -> torch.Tensor:
        """[V, F, T] each output row's group: 0 static, 1 dynamic."""
        return self.order // self.order.shape[-1]


def prunevid_merge(
    x: torch.Tensor, frame_noise: torch.Tensor, token_noise: torch.Tensor, method: PruneVid
) -> MergedGroups:
    """PruneVid's encoder stage (steps 1-7) on V videos of F frames: x [V, F, T, D]; noise as `prunevid_noise`."""
    videos, frames, tokens, dim = x.shape
    device = x.device
    x = x.float()
    centres = max(1, int(frames * method.segment_ratio))
    labels = refine_labels(frame_labels(x.mean(dim=2), frame_noise, method.k, centres))
    # windows: maximal runs of equal labels
    ends = torch.cat([labels[:, 1:] != labels[:, :-1], torch.ones(videos, 1, dtype=torch.bool, device=device)], 1)
    start, end = segment_bounds(ends)
    length = end - start + 1
    first = start == torch.arange(frames, device=device)
    at_first = ((start[:, :, None] == start[:, None, :]) & first[..., None]).float()  # [V, F(first), F]
    # static positions: mean cosine over ordered pairs of distinct frames, from sums of unit vectors
    unit = F.normalize(x, dim=-1)
    sums = torch.matmul(at_first, unit.reshape(videos, frames, tokens * dim)).view_as(x)
    squares = torch.matmul(at_first, (unit * unit).sum(-1))  # [V, F, T]
    pairs = (length * (length - 1)).clamp(min=1)[..., None]
    similar = ((sums * sums).sum(-1) - squares) / pairs > method.tau
    static_first = similar & (first & (length >= 2))[..., None]  # [V, F, T] at windows' first frames
    static = static_first.gather(1, start[..., None].expand(-1, -1, tokens))  # each frame's window's
    window_mean = at_first / length[:, :, None]
    means = torch.matmul(window_mean, x.reshape(videos, frames, tokens * dim)).view_as(x)
    # every group of every frame as one padded batch: [static group at a window's first frame, dynamic group]
    member = torch.stack([static_first, ~static], dim=2).flatten(0, 2)  # [B, T], B = V * F * 2
    features = torch.stack([means, x], dim=2).flatten(0, 2)  # [B, T, D]
    count = member.sum(-1)
    clustered = count > method.min_tokens
    quota = torch.where(clustered, (count.double() * method.cluster_ratio).floor().long().clamp(min=1), count)
    noise = token_noise[None, :, None].expand(videos, -1, 2, -1).flatten(0, 2)
    score, dist = density_peak_scores(features, member, count.clamp(min=1, max=method.k), noise, method.k)
    rank = descending_rank(score)  # members (finite scores) first
    position = torch.arange(tokens, device=device)
    order = score.argsort(dim=-1, descending=True, stable=True)
    by_rank = dist.gather(2, order[:, None, :].expand(-1, tokens, -1))  # [B, T, T]: distance to each rank's token
    by_rank = by_rank.masked_fill(position[None, None, :] >= quota[:, None, None], float("inf"))
    nearest = order.gather(1, by_rank.argmin(dim=-1))  # each token's nearest centre (the better rank on ties)
    centre = member & ((rank < quota[:, None]) | ~clustered[:, None])  # a group of few tokens passes through
    target = torch.where(clustered[:, None] & ~centre, nearest, position)
    members = torch.zeros(member.shape[0], tokens, tokens, device=device)
    members = members.scatter_(1, target[:, None, :], member[:, None, :].float())  # [B, centre, member]
    slot = torch.where(clustered[:, None], rank, member.long().cumsum(-1) - 1)  # output order within the group
    kind = torch.arange(2, device=device).repeat(videos * frames)[:, None]
    key = torch.where(centre, kind * tokens + slot, 2 * tokens + kind * tokens + position)
    centre = centre.view(videos, frames, 2, tokens)
    rows = key.view(videos, frames, 2 * tokens).argsort(dim=-1)[..., :tokens]  # static outputs, then dynamic
    shape = (videos, frames, 2, tokens, tokens)
    return MergedGroups(window_mean, members.view(shape), rows, centre[:, :, 0] | centre[:, :, 1], centre.sum(-1),
                        tokens)  # fmt: skip


# --------------------------------------------------------------------------- the prefill stage's functions
def group_quota_keep(
    scores: torch.Tensor, groups: torch.Tensor, quotas: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Step 9: scores [B, V], groups [B, V] each visual token's group (0..G-1; -1: never dropped), quotas [B, G] how
    many of each group are kept, valid [B, V]. Returns [B, V] bool: every group's `quota` best tokens (ties: the
    lower index) and every ungrouped valid token. One stable sort, no host sync."""
    batch, length = scores.shape
    width = quotas.shape[1]
    device = scores.device
    grouped = valid & (groups >= 0)
    group = torch.where(grouped, groups, width)  # others to a spare group
    order = scores.float().masked_fill(~grouped, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    order = order.gather(1, group.gather(1, order).argsort(dim=-1, stable=True))  # by group, then score, then index
    sizes = torch.zeros(batch, width + 1, dtype=torch.long, device=device).scatter_add_(
        1, group, torch.ones_like(group)
    )
    starts = sizes.cumsum(1) - sizes
    sorted_group = group.gather(1, order)
    rank = torch.arange(length, device=device) - starts.gather(1, sorted_group)
    limit = torch.cat([quotas.to(device), torch.zeros(batch, 1, dtype=quotas.dtype, device=device)], 1)
    chosen = rank < limit.gather(1, sorted_group)
    keep = torch.zeros(batch, length, dtype=torch.bool, device=device).scatter(1, order, chosen)
    return keep | (valid & (groups < 0))


class ActiveStages:
    """PruneVid's stages: the class declares every stage it can act at (the registry's view); an instance with
    `layer=None` acts before the LLM only (the LightCompress form), so it composes with LLM-stage methods."""

    def __get__(self, method: PruneVid | None, owner: type) -> tuple[str, ...]:
        if method is None or method.layer is not None:
            return ("encoder", "prefill", "decode")
        return ("encoder",)


@dataclass
class PruneVid(EncoderMethod, PrefillMethod):
    """`tau`: the mean cosine similarity above which a position is static in its window; `segment_ratio`: frame
    clusters per frame (at least 1); `cluster_ratio`: density-peak centres per token of a group of more than
    `min_tokens`; `k`: the densities' nearest neighbours; `alpha`: the share of every group kept after layer
    `layer` (None: no cut inside the LLM); `seed`: the densities' noise.

    Every token kept, the unpatched model exactly: `tau=1.0, min_tokens` >= the tokens per frame, `layer=None`
    (`cluster_ratio=1.0` keeps every token too, in density order: on LLaVA-OneVision's contiguous positions that
    is another sequence)."""

    tau: float = 0.8
    segment_ratio: float = 0.25
    cluster_ratio: float = 0.5
    k: int = 7
    min_tokens: int = 14
    alpha: float = 0.4
    layer: int | None = 10
    seed: int = 0
    budget: None = None
    scope: str = "image"

    name = "prunevid"
    stages = ActiveStages()
    requires = ("projected", "projected_merge")
    modalities = ("video",)
    scopes = ("image",)  # windows span a video's frames
    merges = True
    params = {
        "budget": NoBudget(hint="how many tokens PruneVid keeps follows the video: set cluster_ratio and alpha"),
        "tau": Real("[-1, 1]", hint="a cosine similarity"),
        "segment_ratio": Real("(0, 1]", hint="frame clusters per frame"),
        "cluster_ratio": Real("(0, 1]", hint="centres per token of a group"),
        "k": Int(1, hint="the densities' nearest neighbours"),
        "min_tokens": Int(0, hint="groups of at most this many tokens pass unclustered"),
        "alpha": Real("[0, 1]", hint="the share of each group kept after `layer`"),
        "layer": OrNone(Layer(hint="the LLM layer after which the visual tokens are cut (None: no cut)")),
        "seed": Int(0, hint="the densities' noise"),
    }
    budget_param = None  # its counts follow the video (cluster_ratio, alpha): no common budget sets them
    controls = ("tau", "cluster_ratio", "alpha", "layer")
    signals_note = (
        "PruneVid merges a video's LLM-input tokens; families that project only the selected tokens (LLaVA-NeXT-Video, "
        "Video-LLaVA, InternVL, PerceptionLM) cannot take such a merge yet"
    )

    # the cut inside the LLM (steps 8-10): after layer `layer`, the plain attention of every token after the row's
    # last visual token, kept tokens at their original positions, the caches of layers 0..layer cut
    query_rows = "after_visual"
    reads = ("plain_attention",)
    positions = "original"

    @classmethod
    def fit(cls, model: ModelView) -> dict[str, Any]:
        """The cut after the deepest softmax-attention layer at or before the official 10 that a drop can follow;
        while the engine cannot run the cut (`CUT_WIRED`), the encoder stage alone (layer=None)."""
        scored = droppable_layers(model)
        if not CUT_WIRED:
            return {"layer": None}
        return {"layer": max([k for k in scored if k <= cls.defaults()["layer"]] or scored[:1])} if scored else {}

    def planned_count(self, n: int) -> int | None:
        return None  # windows and clusters follow the data

    # ----------------------------------------------------------------- encoder stage
    def select(self, tokens: VisualTokens) -> Selection:
        """tokens: every frame of the call's videos ([C, T, D] frames, `image_index` = the video, frames in order);
        one host sync sizes the output and the groups. The selection's `groups` say each output row's group (2c for
        the static group of the window starting at crop c, 2c + 1 for crop c's dynamic group), `group_sizes` their
        sizes: what step 9 keeps a share of."""
        if tokens.valid is not None:
            raise VTokenError("prunevid takes whole video frames; these crops have tokens that never reach the LLM")
        projected = tokens.signals["projected"]
        per_frame = tokens.num_tokens

        def merge(group: slice, videos: int, frames: int) -> MergedGroups:
            x = projected[group].reshape(videos, frames, per_frame, -1)
            frame_noise, token_noise = prunevid_noise(self.seed, frames, per_frame, projected.device)
            return prunevid_merge(x, frame_noise, token_noise, self)

        return video_selection(tokens, projected, merge)

    # ----------------------------------------------------------------- prefill stage
    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.layer is None:
            return ()
        if self.layer >= num_layers - 1:
            raise VTokenError(
                f"prunevid: layer={self.layer} leaves no later layer to run on the cut; this LLM has {num_layers} "
                f"layers (0..{num_layers - 1}), so layer must be at most {num_layers - 2} (or None: the encoder "
                "stage alone)"
            )
        if CUT_WIRED:
            return (self.layer,)
        raise VTokenError(
            f"prunevid: layer={self.layer} cuts the video tokens inside the LLM after layer {self.layer}, which needs "
            "what vtoken's LLM engine does not give a method yet: the layer's attention without rotary and causal "
            "mask (from its queries and keys before rotary, max over heads) and the encoder stage's windows and "
            "frames handed on to the cut; pass layer=None for the encoder stage alone (LightCompress's form)"
        )

    def cut_layers(self, drop_layers: tuple[int, ...]) -> range:
        """The caches of layers 0..K (every layer that ran on the whole sequence) are cut to the kept tokens."""
        return range(drop_layers[-1] + 1) if drop_layers else range(0)

    def quotas(self, sizes: list[list[int]]) -> list[list[int]]:
        """Per row, per group, the tokens step 9 keeps: int(size * alpha)."""
        return [[int(n * self.alpha) for n in row] for row in sizes]

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        """Every row's kept visual tokens (host): its groups' quotas and its ungrouped tokens (OneVision's newline)."""
        sizes = self._group_sizes(tokens)
        return [sum(q) + n - sum(s) for q, s, n in zip(self.quotas(sizes), sizes, tokens.counts, strict=True)]

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        sizes = self._group_sizes(tokens)
        rows = tokens.attention.float()
        if tokens.row_valid is not None:
            rows = rows.masked_fill(~tokens.row_valid[..., None], float("-inf"))
        scores = rows.amax(dim=1)  # the max over query rows (heads were maxed by the read)
        width = max((len(row) for row in sizes), default=0)
        quotas = on_device([q for row in self.quotas(sizes) for q in row + [0] * (width - len(row))],
                           scores.device).view(len(sizes), width)  # fmt: skip
        return group_quota_keep(scores, tokens.groups, quotas, tokens.valid)

    def _group_sizes(self, tokens: LayerTokens) -> list[list[int]]:
        sizes = getattr(tokens, "group_sizes", None)
        if sizes is None or getattr(tokens, "groups", None) is None:
            raise VTokenError("prunevid: the cut inside the LLM needs the encoder stage's groups (LayerTokens.groups)")
        return sizes
