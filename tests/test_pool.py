import pytest
import torch
import torch.nn.functional as F

import vtoken
from vtoken.methods.pool import pool_weights
from vtoken.tokens import VisualTokens


def _tokens(h=24, w=24, d=8, crops=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return VisualTokens(torch.randn(crops, h * w, d, generator=g), (h, w))


@pytest.mark.parametrize("budget, side", [(144, 12), (36, 6), (64, 8), (576, 24), (1, 1), (0.25, 12)])
def test_pool_equals_adaptive_avg_pool_when_k_is_square(budget, side):
    tokens = _tokens()
    pooled = vtoken.Pool(budget=budget).select(tokens).features
    grid = tokens.features.view(2, 24, 24, -1).permute(0, 3, 1, 2)
    ref = F.adaptive_avg_pool2d(grid, side).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pooled, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [288, 58, 29, 2, 7, 575, 100])
@pytest.mark.parametrize("grid", [(24, 24), (24, 36), (13, 7)])
def test_pool_gives_exactly_k_averages_of_rectangles(k, grid):
    h, w = grid
    k = min(k, h * w)
    weights = pool_weights(h, w, k)
    assert weights.shape == (k, h * w)
    torch.testing.assert_close(weights.sum(1), torch.ones(k))
    covered = torch.zeros(h * w)
    for row in weights:
        block = (row > 0).view(h, w)
        rows, cols = block.any(1).nonzero().squeeze(1), block.any(0).nonzero().squeeze(1)
        # the support is one full rectangle with equal weights
        assert block.sum() == len(rows) * len(cols)
        assert rows.diff().eq(1).all() and cols.diff().eq(1).all()
        assert torch.allclose(row[row > 0], row[row > 0][0])
        covered += row > 0
    assert covered.min() >= 1  # every patch contributes to some output token


def test_cached_pool_weights_work_outside_the_inference_mode_they_were_first_made_in():
    """The cached weights are never inference tensors: a first call under `torch.inference_mode()` must not break a
    later call that autograd records (it raised "Inference tensors cannot be saved for backward")."""
    from vtoken.methods.pool import pool_anchors, pool_weights

    pool_weights.cache_clear()
    pool_anchors.cache_clear()
    with torch.inference_mode():
        vtoken.Pool(budget=4).select(vtoken.VisualTokens(torch.randn(1, 16, 3), (4, 4)))
    features = torch.randn(1, 16, 3, requires_grad=True)
    pooled = vtoken.Pool(budget=4).select(vtoken.VisualTokens(features, (4, 4))).features
    pooled.sum().backward()
    assert torch.allclose(features.grad, torch.full_like(features, 0.25))
