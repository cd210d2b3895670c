"""Density-peak clustering (DPC-kNN) scores and the frame segmentation shared by the video mergers (FastVID, HoliTom).

Both official codes score a set of tokens the same way (Du et al.'s DPC-kNN as ToMe-style mergers use it):
distances d_ij = |x_i - x_j| / sqrt(D) in fp32; density_i = exp(-mean of the k smallest d_i.^2, itself included)
plus 1e-6 * U(0, 1) noise to break ties; the parent distance of i = min d_ij over tokens of strictly higher
density (the largest distance of the set for the densest); score = parent distance * density. Centres are the
highest scores. Here every set of a batch is scored at once: sets are rows of a padded [B, N, D] tensor with a
validity mask, so a call is a fixed number of batched ops whatever the set sizes.
"""

from __future__ import annotations

import torch


def seeded_noise(seed: int, frames: int, tokens: int, device: torch.device) -> torch.Tensor:
    """[frames, tokens] U(0, 1) draws from a generator seeded with `seed` on `device`: the tie-breaking noise of a
    video's densities, noise[f, j] for token j of frame f (the official code draws unseeded `torch.rand`)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(frames, tokens, generator=generator, device=device)


def density_peak_scores(
    x: torch.Tensor,
    valid: torch.Tensor | None,
    neighbours: torch.Tensor | int,
    noise: torch.Tensor,
    most: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN scores of B sets of tokens.

    x: [B, N, D] (computed in fp32); valid: [B, N] bool, the set's members (None: all); neighbours: k, an int or
    [B] per set (1 <= k <= the set's size), then `most` (an int) bounds them; noise: [B, N] U(0, 1) draws.
    Returns (score [B, N], -inf outside the set; distances [B, N, N] / sqrt(D), fp32)."""
    x = x.float()
    dist = torch.cdist(x, x) / x.shape[-1] ** 0.5
    if valid is None:
        valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    pair = valid[:, :, None] & valid[:, None, :]
    most = neighbours if isinstance(neighbours, int) else most
    most = max(1, min(most, x.shape[1]))
    nearest = dist.masked_fill(~pair, float("inf")).topk(most, dim=-1, largest=False).values  # [B, N, k]
    if isinstance(neighbours, int):
        mean = (nearest**2).mean(dim=-1)
    else:  # a k per set: the first k of the sorted nearest distances
        count = neighbours.to(x.device).clamp(min=1)
        taken = torch.arange(most, device=x.device) < count[:, None, None]
        mean = torch.where(taken, nearest**2, 0.0).sum(-1) / count[:, None]
    density = (-mean).exp() + noise.to(x.device) * 1e-6
    higher = (density[:, None, :] > density[:, :, None]) & pair  # [b, i, j]: j is denser than i
    largest = dist.masked_fill(~pair, float("-inf")).flatten(1).amax(dim=1)[:, None, None]
    parent = torch.where(higher, dist, largest).amin(dim=-1)
    return (parent * density).masked_fill(~valid, float("-inf")), dist


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's place when its row of `scores` [..., N] is sorted descending (ties: the lower index first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    places = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def frame_segments(unit: torch.Tensor, cuts: int, tau: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FastVID's DySeg on V videos of F frames: unit [V, F, D] the frames' unit global features. With s_f the
    cosine of frames f and f + 1, a segment ends after frame f when s_f is among the `cuts` smallest of its video
    (ties: the earlier frame) or s_f < tau, and at the last frame. Returns (s [V, F - 1], start [V, F], end [V, F]:
    the first and last frame of each frame's segment)."""
    videos, frames = unit.shape[:2]
    similarity = (unit[:, :-1] * unit[:, 1:]).sum(-1)
    smallest = min(cuts, frames - 1)
    rank = descending_rank(-similarity) if frames > 1 else similarity.long()
    cut = (rank < smallest) | (similarity < tau)
    ends = torch.cat([cut, torch.ones(videos, 1, dtype=torch.bool, device=unit.device)], dim=1)
    return (similarity, *segment_bounds(ends))


def segment_bounds(ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ends: [V, F] bool, True where a run of frames ends (the last frame always). Returns (start, end) [V, F]: the
    first and last frame of each frame's run."""
    frames = ends.shape[1]
    index = torch.arange(frames, device=ends.device).expand_as(ends)
    end = torch.where(ends, index, frames).flip(1).cummin(dim=1).values.flip(1)
    before = torch.where(ends, index, -1).cummax(dim=1).values  # the last end at or before each frame
    start = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1] + 1], dim=1)
    return start, end
