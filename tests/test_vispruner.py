"""VisPruner (METHODS-2.md): important + diverse tokens against a plain-loop reference written from the spec, the
official code's odd-residual crash handled, a hand-made crop whose answer is known, and the method through
`vtoken.patch` on the [CLS] families against eager attention and the bare language model fed by hand."""

import pytest
import torch
from conftest import (
    eager_cls_attention,
    feed_language_model,
    inputs_for,
    make_image,
    mask_outside_unpadded,
)

import vtoken
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt


def reference(scores, features, budget, ratio, valid=None):
    """One crop straight from METHODS-2.md, in plain Python: the kept indices, ascending."""
    candidates = [j for j in range(len(scores)) if valid is None or bool(valid[j])]
    count = vtoken.tokens_to_keep(budget, len(candidates))
    important = int(count * ratio)
    diverse = count - important
    ranked = sorted(candidates, key=lambda j: (-float(scores[j]), j))
    residual = ranked[important:]
    # cosines in fp32, as the method computes them: the tiny towers' features are near-parallel (cos ~ 0.999), so
    # fp64 would reorder near-ties
    unit = features.float() / features.float().norm(dim=-1, keepdim=True)
    while diverse > 0:
        step = min(8, len(residual) - diverse)
        if step <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        similarity = (unit[a] @ unit[b].T).amax(-1).tolist()
        order = sorted(range(len(a)), key=lambda i: (-similarity[i], i))
        residual = [a[i] for i in order[step:]] + b
    return sorted(ranked[:important] + (residual if diverse > 0 else []))


def test_a_hand_made_crop_whose_answer_is_known():
    """Scores rank the patches 0..7. Important: 0 and 1. Residual 2..7, two diverse tokens to keep: round one
    drops every a-token (2, 4, 6; r = 4 > |a| = 3), leaving 3, 5, 7; round two (r = 1) pits a = (3, 7) against
    b = (5): 7 duplicates 5, so 7 goes. Kept: 0, 1, 3, 5."""
    scores = torch.arange(8.0, 0, -1)[None]
    features = torch.randn(1, 8, 2, generator=torch.Generator().manual_seed(0))
    features[0, 3], features[0, 5], features[0, 7] = (
        torch.tensor([1.0, 0]),
        torch.tensor([0, 1.0]),
        torch.tensor([0, 2.0]),
    )
    tokens = VisualTokens(features, (2, 4), {"cls_attention": scores, "vision_features": features})
    assert vtoken.VisPruner(budget=4).select(tokens).kept.tolist() == [[0, 1, 3, 5]]


@pytest.mark.parametrize(
    "budget, ratio", [(22, 0.5), (21, 0.5), (64, 0.5), (70, 0.3), (9, 0.0), (12, 1.0), (0.25, 0.5)]
)
def test_random_crops_equal_the_reference(budget, ratio):
    """T = 22, r = 0.5 is the official code's IndexError (an odd residual count); T = 70, r = 0.3 keeps
    int(70 * 0.3) = 20 important tokens, as Python's int() does."""
    g = torch.Generator().manual_seed(int(budget * 100))
    scores, features = torch.rand(3, 120, generator=g), torch.randn(3, 120, 8, generator=g)
    scores[0, 7] = scores[0, 2]  # a tie: the lower index ranks first
    features[1, 40:60] = features[1, 20]  # exact duplicates
    valid = torch.rand(3, 120, generator=g) > 0.2
    valid[0] = True
    selection = vtoken.VisPruner(budget=budget, important_ratio=ratio).select(
        VisualTokens(features, (10, 12), {"cls_attention": scores, "vision_features": features}, valid=valid)
    )
    for c in range(3):
        assert selection.kept_of(c).tolist() == reference(scores[c], features[c], budget, ratio, valid[c])


def test_ratio_one_is_fastervlm_and_keeping_all_is_the_identity():
    g = torch.Generator().manual_seed(1)
    scores, features = torch.rand(2, 36, generator=g), torch.randn(2, 36, 4, generator=g)
    tokens = VisualTokens(features, (6, 6), {"cls_attention": scores, "vision_features": features})
    assert torch.equal(vtoken.VisPruner(budget=9, important_ratio=1.0).select(tokens).kept,
                       vtoken.FasterVLM(budget=9).select(tokens).kept)  # fmt: skip
    assert vtoken.VisPruner(budget=1.0).select(tokens).kept.tolist() == [list(range(36))] * 2


@pytest.mark.parametrize("budget, ratio", [(64, 0.5), (22, 0.5), (0.1, 0.25)])
def test_llava_equals_eager_reference_and_the_language_model_fed_by_hand(llava, photos, budget, ratio):
    model, processor = llava
    inputs = inputs_for(processor, [photos["astronaut"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, vtoken.VisPruner(budget=budget, important_ratio=ratio)) as handle:
        logits = model(**inputs).logits
    tower = model.model.vision_tower
    scores = eager_cls_attention(tower, inputs["pixel_values"])
    with torch.no_grad():
        features = tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        kept = reference(scores[0], features[0], budget, ratio)
        visual = model.model.multi_modal_projector(features[0, kept])
    assert handle.records[0].kept.tolist() == kept
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", ["native", "official"])
def test_llava_next_selects_per_crop_among_the_tokens_each_layout_keeps(layout):
    """Native: every crop keeps its budget of the tokens that survive unpadding; official: of all its tokens
    (VisPruner's official code selects per crop, then packs as FasterVLM's: no unpadding, no newlines)."""
    model, processor = TINY_MODELS["tiny-llava-next"]()
    inputs = processor(images=[make_image(800, 300)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, "vispruner", budget=40, layout=layout) as handle:
        model(**inputs)
    layout_of = handle.adapter.crop_layout(inputs["image_sizes"][0])
    crops = inputs["pixel_values"][0, : layout_of.num_crops]
    scores = eager_cls_attention(model.model.vision_tower, crops)
    with torch.no_grad():
        features = model.model.vision_tower(crops, output_hidden_states=True).hidden_states[-2][:, 1:]
    for record in handle.records:
        c = record.crop
        valid = None if layout == "official" else mask_outside_unpadded(scores[c], c, layout_of) > float("-inf")
        assert record.kept.tolist() == reference(scores[c], features[c], 40, 0.5, valid), c
