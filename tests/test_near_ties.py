"""tests/near_ties.py, the tolerance policy of the tests that compare decisions across code paths: a near-tie is
no failure, a real difference is (each helper fails on one), a case that ties too soon fails instead of passing
having checked nothing, and the measured margins of VisPruner and DivPrune mean what they say (inputs moved by
less than the margin keep the same picks; moved across it, the picks change)."""

import pytest
import torch
from near_ties import (
    divprune_margin,
    greedy_steps_agreeing,
    same_kept,
    top2_margin,
    topk_margin,
    vispruner_margins,
)

import vtoken
from vtoken.tokens import VisualTokens


def _steps(*rows):
    return [torch.tensor(row) for row in rows]


def test_equal_greedy_ids_compare_every_step():
    scores = _steps([0.0, 1.0, 0.5], [2.0, 0.0, 1.0], [0.0, 0.0, 3.0])
    assert greedy_steps_agreeing([1, 0, 2], [1, 0, 2], scores, 1e-4, min_steps=3) == 3


def test_ids_parting_at_a_near_tie_stop_the_comparison_there():
    scores = _steps([0.0, 1.0, 0.5], [2.0, 2.0 - 1e-5, 1.0], [0.0, 0.0, 3.0])
    assert greedy_steps_agreeing([1, 1, 0], [1, 0, 2], scores, 1e-4, min_steps=1) == 1


def test_ids_parting_by_more_than_the_tolerance_are_a_real_difference():
    scores = _steps([0.0, 1.0, 0.5], [2.0, 1.9, 1.0])
    with pytest.raises(AssertionError, match="real difference"):
        greedy_steps_agreeing([1, 1], [1, 0], scores, 1e-4)


def test_the_other_paths_own_scores_are_checked_too():
    """The reference holds its two picks within a near-tie, but the other path ranks them far apart: real."""
    ref, got = _steps([2.0, 2.0 - 1e-5]), _steps([1.0, 2.0])
    with pytest.raises(AssertionError, match="other path"):
        greedy_steps_agreeing([1], [0], ref, 1e-4, got, min_steps=0)


def test_a_near_tie_before_the_needed_steps_fails_instead_of_checking_nothing():
    scores = _steps([1.0, 1.0 - 1e-6, 0.0], [2.0, 0.0, 1.0])
    with pytest.raises(AssertionError, match="wider margins"):
        greedy_steps_agreeing([1, 0], [0, 0], scores, 1e-4, min_steps=1)


def test_top_token_dicts_count_a_token_left_out_as_at_most_their_smallest():
    """vLLM's top-5 logprobs as {token: logprob}: a reference pick missing there is at least as far below."""
    ref = [{"0": -1.0, "1": -1.00001}]
    assert greedy_steps_agreeing([1], [0], ref, 1e-4, min_steps=0) == 0
    with pytest.raises(AssertionError, match="real difference"):
        greedy_steps_agreeing([1], [0], [{"0": -1.0, "5": -3.0}], 1e-4, min_steps=0)


def test_kept_tokens_differ_only_within_the_methods_margin():
    assert same_kept([1, 2, 3], [1, 2, 3], margin=0.0, tolerance=1e-4)
    assert same_kept([3, 1, 2], [1, 2, 3], margin=0.0, tolerance=1e-4, ordered=False)
    assert not same_kept([1, 2, 4], [1, 2, 3], margin=1e-6, tolerance=1e-4)  # a near-tie at the boundary
    with pytest.raises(AssertionError, match=r"only got: \[4\], only reference: \[3\]"):
        same_kept([1, 2, 4], [1, 2, 3], margin=0.5, tolerance=1e-4)


def test_topk_and_top2_margins():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.45])
    assert top2_margin(scores) == pytest.approx(0.4)
    assert topk_margin(scores, 2) == pytest.approx(0.05)
    assert topk_margin(scores, 4) == float("inf")


def _vispruner_kept(scores, features, budget, ratio):
    signals = {"cls_attention": scores[None], "vision_features": features[None]}
    selection = vtoken.VisPruner(budget=budget, important_ratio=ratio).select(
        VisualTokens(features[None], (8, 8), signals)
    )
    return selection.kept_of(0).tolist()


def test_vispruner_margins_bound_what_moves_its_picks():
    """Scores moved by a tenth of the measured relative score margin, features by far less than the cosine margin:
    the same picks. Two residual tokens' scores swapped (a move across a score gap): other picks."""
    g = torch.Generator().manual_seed(3)
    scores, features = torch.rand(64, generator=g) + 0.1, torch.randn(64, 8, generator=g)
    budget, ratio = 40, 0.5
    margins = vispruner_margins(scores, features, budget, ratio)
    assert margins["score"] > 0 and margins["similarity"] > 1e-5
    kept = _vispruner_kept(scores, features, budget, ratio)
    noise = torch.rand(64, generator=g) * 2 - 1
    assert _vispruner_kept(scores * (1 + 0.1 * margins["score"] * noise), features, budget, ratio) == kept
    moved = features + 1e-3 * margins["similarity"] * torch.randn(64, 8, generator=g)
    assert _vispruner_kept(scores, moved, budget, ratio) == kept
    order = scores.argsort(descending=True)
    swapped = scores.clone()
    swapped[order[30]], swapped[order[31]] = scores[order[31]], scores[order[30]]
    assert _vispruner_kept(swapped, features, budget, ratio) != kept
    assert vispruner_margins(scores, features, 64, ratio) == {"score": float("inf"), "similarity": float("inf")}


def test_divprune_margin_bounds_what_moves_its_picks():
    """Features moved by far less than the measured margin: the same picks; the runner-up of the closest step made
    better than the pick by more than that: another pick. Copies of one vector (LLaVA-NeXT's newlines) tie."""
    g = torch.Generator().manual_seed(4)
    features = torch.randn(40, 6, generator=g)

    def picks(f):
        selection = vtoken.DivPrune(budget=8).select(VisualTokens(f[None], (1, len(f)), {}))
        return selection.kept_of(0).tolist()

    margin = divprune_margin(features, 8)
    assert margin > 1e-5
    assert picks(features + 1e-3 * margin * torch.randn(40, 6, generator=g)) == picks(features)
    assert divprune_margin(torch.ones(5, 6), 2) < 1e-6 and divprune_margin(features, 40) == float("inf")
    tied = features.clone()
    tied[7] = features[3] * (1 + 1e-7)  # a token at rounding distance from another, not a copy
    assert divprune_margin(tied, 40 - 1) < 1e-5
