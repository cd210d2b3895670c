"""HoliTom: holistic token merging for fast video LLMs (Shao et al., "HoliTom: Holistic Token Merging for Fast
Video Large Language Models", NeurIPS 2025; official code cokeshao/HoliTom @e9b2972, METHODS-3-video.md).

The outer-LLM stage, on one video's LLM-input tokens x [F, T, D] (post projector and pooling) and the tower's
last-layer attention a [F, T] (mean over heads, then over queries, pooled like the tokens):

1. Windows: sigma_t,j = cos(x_t,j, x_t+1,j). Merging frames s..e removes (e - s) * #{j : sigma_t,j > tau for all
   t = s..e-1} tokens; a dynamic programme (`vtoken::static_windows`) splits the video into consecutive windows of
   at most `max_window` frames removing the most (strict improvement; among equal windows the shortest). The
   budget is then spread over what is left: r' = min(budget / ((F*T - removed) / (F*T)), 1).
2. Per window (s, e), the static positions are those similar across the whole window (none for one frame):
   - dynamic tokens, per frame: of its n_d other positions it keeps ceil(n_d * r'): with `d` = 0 the top by
     attention; with d > 0, round(ceil(n_d * r') * (1 - d)) by attention and the rest as density-peak centres
     (DPC-kNN, k = min(`k`, their number)) of the frame's other dynamic tokens, each of those merged into its
     nearest centre (Euclidean, the first on ties) as beta * centre + (1 - beta) * mean of its members;
   - static tokens: the window mean of each static position; round(n_s * r') (half to even) of them are DPC-kNN
     centres, every other one joins its nearest centre, merged the same way.
3. Reaching the LLM, per window: its static centres (ascending), then its frames' dynamic tokens frame by frame
   (ascending; with d > 0 the attention picks, then the centres). A static centre is recorded, and on Qwen placed,
   at its position in the window's first frame.

Families: LLaVA-OneVision (official; contiguous positions); Qwen2-VL / Qwen2.5-VL / Qwen3-VL (an extension: the
last full-attention ViT block's attention per temporal patch, pooled over each 2 x 2 merge group; kept tokens keep
their (t, h, w) positions, a static token its window's first frame's).

Inside the LLM (optional, `inner_layer` = K, official env HOLITOM_k / HOLITOM_r; off by default): after layer K - 1,
from its attention of the last prompt token (head mean) over the row's visual tokens (the outer output with its
newline), the round(V * (1 - inner_ratio)) top tokens go on; every other token, in ascending order, is averaged into
its most cosine-similar kept token (h_t <- (h_t + h_n) / 2, the closed form in fp32); kept tokens keep their
positions (gaps), layers before K their whole cache.

Differences from the official code (docs/methods-video-mergers.md): every video of every row; merges in fp32 (the
official: the model's dtype); seeded noise; ties to the lower index; the search is one device kernel (the
official: an O(F^2) Python loop with `.item()` per step). GPU: frames (and videos of equal length) batched, a
fixed number of ops besides the window search; one host sync per call sizes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..budget import Budget
from ..errors import VTokenError
from ..kernels import static_windows
from ..params import Int, Kept, Layer, OrNone, Real, Scope
from ..tokens import LayerTokens, Selection, VisualTokens
from .base import EncoderMethod, PrefillMethod, keep_top
from .density import density_peak_scores, descending_rank, seeded_noise, segment_bounds
from .fastvid import video_selection


def window_gains(similar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """similar: [V, F - 1, T] bool, position j of frames t and t + 1 alike. Returns (run [V, F, T]: how many
    consecutive pairs from frame s on stay alike at j, 0 for the last frame; gain [V, F, F] float32: tokens a
    window s..e removes, (e - s) * #{j : run[s, j] >= e - s}, 0 where e <= s)."""
    videos, pairs, tokens = similar.shape
    frames = pairs + 1
    device = similar.device
    step = torch.arange(pairs, device=device)[None, :, None]
    unlike = torch.where(similar, pairs, step).flip(1).cummin(dim=1).values.flip(1)  # the next pair that differs
    run = torch.cat([unlike - step, torch.zeros(videos, 1, tokens, dtype=torch.long, device=device)], dim=1)
    if pairs == 0:
        return run, torch.zeros(videos, 1, 1, device=device)
    lengths = torch.arange(1, frames, device=device)
    lasting = (run[:, :, None, :] >= lengths[None, None, :, None]).sum(-1)  # [V, F, F - 1]: lasting[s, L - 1]
    span = torch.arange(frames, device=device)[None, :] - torch.arange(frames, device=device)[:, None]  # e - s
    taken = lasting.gather(2, (span - 1).clamp(0, pairs - 1)[None].expand(videos, -1, -1))
    return run, torch.where(span >= 1, span * taken, 0).float()


@dataclass
class MergedWindows:
    """What HoliTom decided for V videos of F frames, T tokens each; `apply` builds the output from any per-token
    features aligned with the tokens (the LLM-input tokens, or Qwen3-VL's DeepStack levels).

    window_mean: [V, F, F] weights of each window's frames at its first frame (1 / L), 0 elsewhere;
    static_members / dynamic_members: [V, F, T, T] 0/1, the tokens each centre absorbs (static: window means at
    the first frame; dynamic: the frame's own; None when d = 0: no dynamic merges); static_centre: [V, F, T]
    centres at first frames; key: [V, F, T] the output order (lower first); keep: [V, F, T] what reaches the LLM;
    beta: a centre's own weight; width: the widest frame's output."""

    window_mean: torch.Tensor
    static_members: torch.Tensor
    dynamic_members: torch.Tensor | None
    static_centre: torch.Tensor
    key: torch.Tensor
    keep: torch.Tensor
    beta: float
    width: int

    def apply(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [V, F, T, D] -> (rows [V, F, T, D] fp32, positions [V, F, T]) in the order they reach the LLM; rows
        past a frame's count are padding."""
        videos, frames, tokens, dim = x.shape
        x = x.float()
        means = torch.matmul(self.window_mean, x.reshape(videos, frames, tokens * dim)).view_as(x)

        def merged(members: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
            count = members.sum(-1, keepdim=True)
            mean = torch.matmul(members, centres) / count.clamp(min=1)
            return torch.where(count > 0, self.beta * centres + (1 - self.beta) * mean, centres)

        dynamic = x if self.dynamic_members is None else merged(self.dynamic_members, x)
        rows = torch.where(self.static_centre[..., None], merged(self.static_members, means), dynamic)
        positions = self.key.argsort(dim=-1)[..., : self.width]
        return rows.gather(2, positions[..., None].expand(-1, -1, -1, dim)), positions


def nearest_centres(dist: torch.Tensor, centre: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """dist: [B, T, T] distances; centre, members: [B, T] bool. Returns [B, T(centre), T(member)] 0/1: each
    member to its nearest centre (the first, in ascending position, on ties)."""
    nearest = dist.masked_fill(~centre[:, None, :], float("inf")).argmin(dim=-1)  # [B, T]
    table = torch.zeros(dist.shape, device=dist.device)
    return table.scatter_(1, nearest[:, None, :], members[:, None, :].float())


def holitom_merge(
    x: torch.Tensor, attention: torch.Tensor, rate: float, noise: torch.Tensor, method: HoliTom
) -> MergedWindows:
    """HoliTom's outer stage on V videos of F frames: x [V, F, T, D], attention [V, F, T], `rate` the budget's
    retention ratio, noise [F, T]."""
    videos, frames, tokens, _ = x.shape
    device = x.device
    unit = F.normalize(x.float(), dim=-1)
    similar = F.cosine_similarity(unit[:, :-1], unit[:, 1:], dim=-1) > method.tau  # [V, F - 1, T]
    run, gain = window_gains(similar)
    start, removed = static_windows(gain, method.max_window)
    index = torch.arange(frames, device=device)
    ends = torch.cat([start[:, 1:] != start[:, :-1], torch.ones_like(start[:, :1], dtype=torch.bool)], dim=1)
    _, end = segment_bounds(ends)
    length = end - start + 1
    total = frames * tokens
    spread = (rate / ((total - removed.double()) / total)).clamp(max=1.0)[:, None]  # r' per video, float64
    first = start == index  # the window's first frame
    at_start = run.gather(1, start[..., None].expand(-1, -1, tokens))
    static = (length >= 2)[..., None] & (at_start >= (length - 1)[..., None])  # [V, F, T]
    # dynamic tokens: per frame, ceil(n_d * r') by attention (and density-peak centres when d > 0)
    dynamic = ~static
    kept = (dynamic.sum(-1).double() * spread).ceil().long()  # [V, F]
    dominant = (kept.double() * (1 - method.d)).round().long()
    contextual = kept - dominant
    picked = (descending_rank(attention.float().masked_fill(static, float("-inf"))) < dominant[..., None]) & dynamic
    flat_noise = noise[None].expand(videos, -1, -1).flatten(0, 1)
    rest = dynamic & ~picked
    if method.d > 0:
        score, dist = density_peak_scores(x.flatten(0, 1), rest.flatten(0, 1),
                                          contextual.flatten().clamp(max=method.k), flat_noise, method.k)  # fmt: skip
        centres = (descending_rank(score).view_as(rest) < contextual[..., None]) & rest
        dynamic_members = nearest_centres(dist, centres.flatten(0, 1), (rest & ~centres).flatten(0, 1))
    else:  # d = 0 (official): the attention picks only, nothing merged among the dynamic tokens
        centres, dynamic_members = torch.zeros_like(rest), None
    # static tokens: window means at the first frame, round(n_s * r') density-peak centres
    same_window = start[:, :, None] == start[:, None, :]
    window_mean = (same_window & first[..., None]).float() / length[..., None]
    means = torch.matmul(window_mean, x.float().reshape(videos, frames, -1)).view(x.shape)
    static_first = static & first[..., None]
    clusters = (static_first.sum(-1).double() * spread).round().long()  # half to even, as Python's round
    score, dist = density_peak_scores(means.flatten(0, 1), static_first.flatten(0, 1),
                                      clusters.flatten().clamp(max=method.k), flat_noise, method.k)  # fmt: skip
    static_centre = (descending_rank(score).view_as(static) < clusters[..., None]) & static_first
    static_members = nearest_centres(dist, static_centre.flatten(0, 1), (static_first & ~static_centre).flatten(0, 1))
    positions = torch.arange(tokens, device=device)
    key = torch.where(static_centre, positions,
                      torch.where(picked, tokens + positions,
                                  torch.where(centres, 2 * tokens + positions, 3 * tokens + positions)))  # fmt: skip
    shape = (videos, frames, tokens, tokens)
    dynamic_members = None if dynamic_members is None else dynamic_members.view(shape)
    return MergedWindows(window_mean, static_members.view(shape), dynamic_members, static_centre, key,
                         static_centre | picked | centres, method.beta, tokens)  # fmt: skip


class ActiveStages:
    """HoliTom's stages: the class declares both it can act at (the registry's view); an instance acts inside the
    LLM only with an `inner_layer`, so that without one it composes with LLM-stage methods (FastV) and installs no
    LLM hooks."""

    def __get__(self, method: HoliTom | None, owner: type) -> tuple[str, ...]:
        if method is None or method.inner_layer is not None:
            return ("encoder", "prefill")
        return ("encoder",)


def running_average(hidden: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """HoliTom's inner merge of one drop point: every visual token not kept goes, in ascending order, into its most
    cosine-similar kept token (similarities of the un-merged states; the first in `order` on ties), h_t <- (h_t +
    h_n) / 2 each time, i.e. h_t / 2^m + sum_i h_(n_i) / 2^(m - i + 1) for members n_1 < ... < n_m.

    hidden: [B, V, D]; valid, keep: [B, V] bool; order: [B, V] the kept tokens' preference order (descending
    attention: the official top-k's). Returns [B, V, D] fp32: the kept tokens' new states (others unchanged)."""
    batch, length, dim = hidden.shape
    x = hidden.float()
    unit = x / x.norm(dim=-1, keepdim=True)
    members = valid & ~keep
    similarity = torch.matmul(unit, unit.transpose(1, 2))  # [B, member, target]
    ranked = similarity.gather(2, order[:, None, :].expand(-1, length, -1))
    ranked = ranked.masked_fill(~keep.gather(1, order)[:, None, :], float("-inf"))
    target = order.gather(1, ranked.argmax(dim=-1))  # [B, V] each member's target
    target = torch.where(members, target, length)  # non-members to a spare slot
    count = torch.zeros(batch, length + 1, device=x.device).scatter_add_(1, target, members.float())
    # a member's place among its target's members, ascending: sort by (target, index)
    index = torch.arange(length, device=x.device)
    by_target = (target * length + index).argsort(dim=1)
    starts = count.cumsum(1) - count  # [B, V + 1] where each target's members start in that order
    place = torch.empty_like(by_target).scatter_(1, by_target, index.expand(batch, -1))  # position in the order
    rank = place - starts.gather(1, target).long() + 1  # 1-based among its target's members
    weight = torch.pow(2.0, -(count.gather(1, target) - rank + 1)).masked_fill(~members, 0.0)
    spare = torch.cat([x * torch.pow(2.0, -count[:, :length])[..., None], x.new_zeros(batch, 1, dim)], 1)
    merged = spare.scatter_add(1, target[..., None].expand(-1, -1, dim), weight[..., None] * x)[:, :length]
    return torch.where(keep[..., None], merged, x)


@dataclass
class HoliTom(EncoderMethod, PrefillMethod):
    """`budget`: the retention ratio of each video (official 0.10), or tokens per frame on average; `tau`: the
    similarity above which a position stays static; `beta`: a merged centre's own weight; `k`: the density's
    neighbours; `d`: the share of a frame's dynamic budget given to density-peak centres (official 0, unverified
    above); `seed`: the densities' noise; `max_window`: the longest window; `inner_layer` / `inner_ratio`: the merge
    inside the LLM before layer `inner_layer` (None: off, the paper's "HoliTom w/o M"; README 18 and 0.5)."""

    budget: Budget = 0.10
    tau: float = 0.8
    beta: float = 0.6
    k: int = 7
    d: float = 0.0
    seed: int = 0
    inner_layer: int | None = None
    inner_ratio: float = 0.5
    max_window: int = 1024
    scope: str = "image"

    name = "holitom"
    stages = ActiveStages()
    requires = ("projected", "tower_attention")
    modalities = ("video",)
    scopes = ("image",)  # the budget is spread over each video's windows
    merges = True
    params = {
        "budget": Kept(),
        "scope": Scope(),
        "tau": Real("[-1, 1]", hint="a cosine similarity"),
        "beta": Real("[0, 1]", hint="a merged centre's own weight"),
        "k": Int(1, hint="the density's nearest neighbours"),
        "d": Real("[0, 1]", hint="the share of dynamic tokens merged by density"),
        "seed": Int(0, hint="the densities' noise"),
        "inner_layer": OrNone(Layer(1, reads=1, hint="the LLM layer the inner merge runs before")),
        "inner_ratio": Real("[0, 1]", hint="the share of the video's tokens merged inside the LLM"),
        "max_window": Int(1, hint="frames in a window at most"),
    }
    controls = ("budget", "tau", "beta", "k")
    signals_note = (
        "HoliTom scores tokens by the vision tower's last-layer attention (mean over heads and queries), which "
        "vtoken reads on SigLIP (LLaVA-OneVision) and Qwen-VL towers"
    )

    # the inner merge: before layer `inner_layer`, from layer inner_layer - 1's attention of the last prompt token
    query_rows = "last"
    reads = ("attention", "hidden")
    positions = "original"  # kept tokens keep their positions (official: position_ids = the kept indices)

    def planned_count(self, n: int) -> int | None:
        return None  # windows and clusters follow the data

    # ----------------------------------------------------------------- inside the LLM (inner_layer)
    def drop_layers(self, num_layers: int) -> tuple[int, ...]:
        if self.inner_layer is None:
            return ()
        if self.inner_layer >= num_layers:
            raise VTokenError(
                f"holitom: inner_layer={self.inner_layer} is beyond this LLM's {num_layers} layers; the merge runs "
                f"before layer inner_layer, reading layer inner_layer - 1: 1..{num_layers - 1}"
            )
        return (self.inner_layer - 1,)

    def kept_counts(self, tokens: LayerTokens) -> list[int]:
        """round(V * (1 - inner_ratio)) of each row's V visual tokens (Python's round, as the official)."""
        return [round(n * (1 - self.inner_ratio)) for n in tokens.counts]

    def keep_mask(self, tokens: LayerTokens) -> torch.Tensor:
        scores = tokens.attention[:, -1].float().masked_fill(~tokens.valid, float("-inf"))  # the last prompt token
        return keep_top(scores, self.kept_counts(tokens))

    def update(self, tokens: LayerTokens, keep: torch.Tensor) -> torch.Tensor:
        scores = tokens.attention[:, -1].float().masked_fill(~tokens.valid, float("-inf"))
        order = scores.argsort(dim=-1, descending=True, stable=True)
        return running_average(tokens.hidden, tokens.valid, keep, order)

    def rate(self, per_frame: int) -> float:
        return self.budget if isinstance(self.budget, float) else min(1.0, self.budget / per_frame)

    def select(self, tokens: VisualTokens) -> Selection:
        """tokens: every frame of the call's videos ([C, T, D] frames, `image_index` = the video, frames in order);
        one host sync sizes the output."""
        if tokens.valid is not None:
            raise VTokenError("holitom takes whole video frames; these crops have tokens that never reach the LLM")
        projected = tokens.signals["projected"]
        per_frame = tokens.num_tokens
        rate = self.rate(per_frame)

        def merge(group: slice, videos: int, frames: int) -> MergedWindows:
            x = projected[group].reshape(videos, frames, per_frame, -1)
            attention = tokens.signals["tower_attention"][group].reshape(videos, frames, per_frame)
            noise = seeded_noise(self.seed, frames, per_frame, projected.device)
            return holitom_merge(x, attention, rate, noise, self)

        return video_selection(tokens, projected, merge)
