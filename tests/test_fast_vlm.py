"""FastVLM: timm FastViTHD tower (stride 64, no [CLS]) in a TimmWrapperModel, MLP projector, Qwen2 LLM."""

import copy

import pytest
import torch
from conftest import assert_identity, feed_language_model, make_image

import vtoken
from vtoken.methods.fourier import dct_lowpass
from vtoken.methods.pool import pool_weights
from vtoken.zoo import build_prompt, tiny_fastvlm

# (height, width) crops the processor makes: 6 x 6, 4 x 7 and 3 x 2 token grids
CROPS = [(384, 384), (256, 448), (192, 128)]


@pytest.fixture(scope="module")
def fastvlm():
    return tiny_fastvlm()


def _inputs(processor, crop=(384, 384), seed=0, question="what is in the image?"):
    processor = copy.deepcopy(processor)
    processor.image_processor.crop_size = {"height": crop[0], "width": crop[1]}
    processor.image_processor.size = {"shortest_edge": max(crop)}
    return processor(images=[make_image(700, 400, seed)], text=[build_prompt(processor, question)], return_tensors="pt")


def _features(model, pixel_values):
    """The stock tower's flattened feature map, [B, N, C] (what the model projects)."""
    with torch.no_grad():
        return model.model.vision_tower(pixel_values).last_hidden_state.flatten(2).transpose(1, 2)


def test_identity_at_full_budget_for_every_crop_shape(fastvlm):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = fastvlm
    for i, crop in enumerate(CROPS):
        assert_identity(model, method, _inputs(processor, crop, i), max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 5])
def test_exact_budget_and_equivalence_with_the_llm_fed_by_hand(fastvlm, budget):
    model, processor = fastvlm
    project = model.model.multi_modal_projector
    for i, crop in enumerate(CROPS):
        inputs = _inputs(processor, crop, i)
        grid = (crop[0] // 64, crop[1] // 64)
        n = grid[0] * grid[1]
        k = vtoken.tokens_to_keep(budget, n)
        features = _features(model, inputs["pixel_values"])[0]
        for method in ("random", "mmtok", "pool"):
            with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
                logits = model(**inputs).logits
            (record,) = handle.records
            assert (record.tokens_in, record.tokens_out, record.grid) == (n, k, grid)
            if method == "pool":
                visual = project(pool_weights(*grid, k) @ features)
            else:
                assert len(record.kept) == k and torch.equal(record.kept, record.kept.sort().values)
                visual = project(features[record.kept])
            ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
            assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, (method, crop)


def test_fourier_hands_the_llm_a_smaller_grid(fastvlm):
    model, processor = fastvlm
    inputs = _inputs(processor, (256, 448))
    with torch.no_grad(), vtoken.patched(model, vtoken.FourierDCT(ratio=0.5)) as handle:
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(28, 6)]  # 4 x 7 -> 2 x 3
    features = _features(model, inputs["pixel_values"])[0].view(4, 7, -1)
    with torch.no_grad():
        visual = model.model.multi_modal_projector(dct_lowpass(features, 2, 3).flatten(0, 1))
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert (logits - ref).abs().max() <= 1e-5 and out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_the_tiny_towers_features_carry_the_image(fastvlm):
    """Regression (found by test_fuzz): the tiny tower's features were ~1e-22 (transformers' init), so every MMTok
    selection was a tie and pruning never changed the logits. Now which tokens are kept matters."""
    model, processor = fastvlm
    inputs = _inputs(processor)
    assert float(_features(model, inputs["pixel_values"]).abs().mean()) > 1e-3
    with torch.no_grad():
        logits = []
        for seed in (0, 1):
            with vtoken.patched(model, vtoken.Random(budget=0.1, seed=seed)):
                logits.append(model(**inputs).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-4
