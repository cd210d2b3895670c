"""Comparing decisions (greedy ids, kept tokens) made by two code paths that round differently: two engines,
a padded batch and its rows, compiled and eager, AVX2 and AVX-512 kernels.

Two float computations of the same logits or scores agree only within rounding, so an argmax or top-k whose
winner is within rounding of the runner-up may go either way on either path. The policy (docs/versions.md, "the
tolerance policy"):

- greedy ids are equal step by step until the first step where they part; there, each path's margin between the
  two picks must be within twice the tolerance (a near-tie: each path may pick either), otherwise it is a real
  difference and fails. Steps after a near-tie have different contexts and are not compared; a test states
  how many steps it needs compared (`min_steps`), so a case that ties at once cannot pass having checked nothing;
- kept tokens are equal unless the method's own margin at a decision (measured on the reference's scores by
  `topk_margin`, `vispruner_margins`, `divprune_margin`, `tome_margin`) is within rounding; parity tests choose
  cases whose margins are measured and asserted well above rounding, so their kept tokens must be equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _gap(scores: torch.Tensor | dict, first: int, second: int) -> float:
    """scores[first] - scores[second] in a [V] tensor, or in a {token: value} dict of the top tokens (a token left
    out is at most the smallest value there: the gap is at least that far)."""
    if not isinstance(scores, dict):
        row = scores.detach().float()
        return float(row[first] - row[second])
    values = {int(k): float(v) for k, v in scores.items()}
    floor = min(values.values())
    return values.get(first, floor) - values.get(second, floor)


def greedy_steps_agreeing(
    got: Sequence[int],
    ref: Sequence[int],
    ref_scores: Sequence[torch.Tensor | dict],
    tolerance: float,
    got_scores: Sequence[torch.Tensor | dict] | None = None,
    min_steps: int = 1,
) -> int:
    """Greedy ids `got` against `ref`, with the reference's per-step logits or log-probs `ref_scores` ([V] tensors,
    or {token: value} dicts of the top tokens), and the other path's (`got_scores`) where known. Returns the steps
    whose ids were compared and found equal: all of them, or those before the step where the two part at a
    near-tie. Where they part, each path's scores must hold the two picks within 2 x `tolerance` (each path may be
    `tolerance` off, so their order may flip within twice that); a wider gap is a real difference and fails, as
    does parting before `min_steps` agreeing steps (a case whose margins are too narrow to check anything)."""
    steps = min(len(got), len(ref))
    for step in range(steps):
        mine, theirs = int(got[step]), int(ref[step])
        if mine == theirs:
            continue
        # each path's own pick against the other's, in its own scores
        for name, scores, first, second in (("reference", ref_scores, theirs, mine),
                                            ("other path", got_scores, mine, theirs)):  # fmt: skip
            if scores is None or step >= len(scores):
                continue
            gap = _gap(scores[step], first, second)
            if gap > 2 * tolerance:
                raise AssertionError(
                    f"greedy ids part at step {step} ({mine} vs the reference's {theirs}) with a margin of {gap:.3g} "
                    f"in the {name}'s scores, above 2 x {tolerance:g}: a real difference; got {list(got)}, "
                    f"reference {list(ref)}"
                )
        assert step >= min_steps, (
            f"greedy ids part at a near-tie at step {step} (within 2 x {tolerance:g}), before the {min_steps} compared "
            f"steps this test needs: choose inputs with wider margins; got {list(got)}, reference {list(ref)}"
        )
        return step
    assert len(got) == len(ref), f"different lengths: got {list(got)}, reference {list(ref)}"
    assert steps >= min_steps, f"only {steps} steps to compare, {min_steps} needed"
    return steps


def top2_margin(scores: torch.Tensor) -> float:
    """The gap between the largest and second-largest entry of `scores` [V] (a greedy step's margin)."""
    top = scores.detach().float().topk(2).values
    return float(top[0] - top[1])


def topk_margin(scores: torch.Tensor, k: int) -> float:
    """How far the top-`k` of `scores` [N] is from changing: the gap between its k-th and (k+1)-th entries
    (inf when k keeps all or none)."""
    if k <= 0 or k >= scores.numel():
        return float("inf")
    top = scores.detach().float().flatten().topk(k + 1).values
    return float(top[k - 1] - top[k])


def tome_margin(keys: torch.Tensor, heads: int, r: int, cls: bool) -> float:
    """How far one ToMe block's bipartite matching of one crop is from changing, from its keys [T, heads * d]: the
    smaller of the ranking gap (the r-th and (r+1)-th best scores of the A tokens) and, over the r merging A tokens,
    the gap between their best and second-best B partner (cosines, fp32)."""
    metric = keys.detach().float().view(keys.shape[0], heads, -1).mean(dim=1)
    unit = metric / metric.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scores = unit[0::2] @ unit[1::2].T  # [|A|, |B|]
    if cls:
        scores[0] = float("-inf")
    top2 = scores.topk(2, dim=-1).values
    ranking = topk_margin(top2[:, 0], r)
    merging = top2[:, 0].argsort(descending=True, stable=True)[:r]
    partner = float((top2[merging, 0] - top2[merging, 1]).min()) if r > 0 else float("inf")
    return min(ranking, partner)


def same_kept(got: Sequence[int], ref: Sequence[int], margin: float, tolerance: float, ordered: bool = True) -> bool:
    """Whether two paths kept the same tokens (the same set, when `ordered` is False: an order the method leaves
    arbitrary). Different tokens are no failure only when the method's `margin` at its decision, measured on the
    reference's scores, is within `tolerance` (returns False: the paths' later outputs are not comparable);
    otherwise they fail, naming what each kept."""
    a, b = (list(got), list(ref)) if ordered else (sorted(got), sorted(ref))
    if a == b:
        return True
    only_got, only_ref = sorted(set(got) - set(ref)), sorted(set(ref) - set(got))
    assert margin <= tolerance, (
        f"kept tokens differ (only got: {only_got}, only reference: {only_ref}) although the method's margin "
        f"{margin:.3g} is above the tolerance {tolerance:g}: a real difference"
    )
    return False


def vispruner_margins(scores: torch.Tensor, features: torch.Tensor, count: int, important_ratio: float) -> dict:
    """VisPruner's decisions on one crop (docs/guide/methods.md; vtoken/methods/vispruner.py), and how far each is
    from flipping, from its [CLS] scores [N] and pre-projector features [N, D]:
    "score": the smallest relative gap between consecutive scores from the important/residual boundary on (the
    residual's order splits it into a and b); "similarity": the smallest gap, in every duplicate-removal round,
    between a-tokens' best cosines from the last one dropped on (the cut, and the order of those that stay, which
    splits the next round; the last round's cut only)."""
    scores = scores.detach().float()
    order = scores.argsort(descending=True, stable=True)
    important = int(count * important_ratio)
    ranked = scores[order]
    margins = {"score": float("inf"), "similarity": float("inf")}
    residual, keep = order[important:], count - important
    if count <= 0 or count >= len(scores):  # nothing or everything kept
        return margins
    if keep <= 0:  # no duplicate removal: only the important/residual boundary
        margins["score"] = float((ranked[important - 1] - ranked[important]) / ranked[important - 1].abs())
        return margins
    tail = ranked[max(important - 1, 0) :]
    margins["score"] = float(((tail[:-1] - tail[1:]) / tail[:-1].abs().clamp_min(1e-30)).min())
    unit = F.normalize(features.detach().float(), dim=-1)
    while keep > 0:
        step = min(8, len(residual) - keep)
        if step <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        similarity = (unit[a] @ unit[b].T).amax(-1)
        values = similarity.sort(descending=True).values
        last = len(residual) - step - keep <= 0  # no round after this one
        gaps = values[step - 1 : step + 1] if last else values[step - 1 :]
        if len(gaps) > 1:
            margins["similarity"] = min(margins["similarity"], float((gaps[:-1] - gaps[1:]).min()))
        stay = similarity.argsort(descending=True, stable=True)[step:]
        residual = torch.cat([a[stay], b])
    return margins


def divprune_margin(features: torch.Tensor, count: int) -> float:
    """DivPrune's greedy max-min picks on one image's placed tokens [L, D] (vtoken/methods/divprune.py), and how far
    the closest of its `count` steps is from picking another token: the smallest gap between a step's best and
    second-best candidate distance (the first step: distances to the nearest other token)."""
    unit = F.normalize(features.detach().float(), dim=-1)
    length = len(unit)
    if count <= 0 or count >= length:
        return float("inf")
    distance = 1 - unit @ unit.T  # (copies of one vector, LLaVA-NeXT's newlines, tie only up to rounding here too)

    def step_margin(values: torch.Tensor) -> float:
        return topk_margin(values[torch.isfinite(values)], 1)

    nearest = distance.kthvalue(2, dim=0).values  # each token's distance to its nearest other token
    margin = step_margin(nearest)
    first = int(nearest.argmax())
    blocked = torch.zeros(length, dtype=torch.bool)
    blocked[first] = True
    closest = distance[first].clone()
    for _ in range(count - 1):
        candidates = closest.masked_fill(blocked, float("-inf"))
        margin = min(margin, step_margin(candidates))
        pick = int(candidates.argmax())
        blocked[pick] = True
        closest = torch.minimum(closest, distance[pick])
    return margin
