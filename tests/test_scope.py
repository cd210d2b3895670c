"""Per-image budgets (scope="image") next to per-crop budgets (the default)."""

import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.tokens import VisualTokens


def test_image_scope_is_one_topk_over_all_crops_of_an_image():
    scores = torch.tensor([[9.0, 8, 7, 6], [1.0, 2, 3, 0], [3.0, 4, 1, 2]])  # crops 0, 1 of image 0; crop 2 image 1
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    tokens = VisualTokens(torch.zeros(3, 4, 2), (2, 2), {"cls_attention": scores}, torch.tensor([0, 0, 1]), valid)
    image_scope = vtoken.FasterVLM(budget=0.5, scope="image").select(tokens)
    # image 0: 7 valid tokens -> 4 kept, all from crop 0 (9, 8, 7, 6); image 1: 4 -> 2 kept (4, 3)
    assert image_scope.counts == [4, 0, 2]
    assert [image_scope.kept_of(c).tolist() for c in range(3)] == [[0, 1, 2, 3], [], [0, 1]]
    # per crop instead: 2 of 4, 2 of the 3 valid, 2 of 4
    crop_scope = vtoken.FasterVLM(budget=0.5).select(tokens)
    assert [crop_scope.kept_of(c).tolist() for c in range(3)] == [[0, 1], [1, 2], [0, 1]]


def test_pool_refuses_image_scope():
    with pytest.raises(vtoken.VTokenError, match="scope='image'; accepted: crop"):
        vtoken.Pool(budget=0.25, scope="image")


@pytest.mark.parametrize("method", ["fastervlm", "random"])
def test_anyres_image_keeps_its_budget_over_all_crops(method):
    from vtoken.zoo import build_prompt, tiny_llava_next

    model, processor = tiny_llava_next()
    for i, size in enumerate([(800, 300), (1000, 1000), (50, 20)]):
        inputs = processor(images=[make_image(*size, i)], text=[build_prompt(processor, "what?")], return_tensors="pt")
        with torch.no_grad(), vtoken.patched(model, vtoken.make_method(method, budget=0.2, scope="image")) as handle:
            model(**inputs)
        total_in = sum(r.tokens_in for r in handle.records)
        assert sum(r.tokens_out for r in handle.records) == vtoken.tokens_to_keep(0.2, total_in)
        assert len({r.tokens_out for r in handle.records}) > 1 or method == "random"


def test_video_keeps_its_budget_over_all_frames():
    from vtoken.images import example_clip
    from vtoken.zoo import build_prompt, tiny_qwen2_vl

    model, processor = tiny_qwen2_vl()
    inputs = processor(videos=[example_clip(8)], text=[build_prompt(processor, "what?", 0, 1)], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, vtoken.Random(budget=0.1, scope="image")) as handle:
        logits = model(**inputs).logits
    total_in = sum(r.tokens_in for r in handle.records)
    kept = sum(r.tokens_out for r in handle.records)
    assert kept == vtoken.tokens_to_keep(0.1, total_in) and len(handle.records) == 4
    assert logits.shape[1] == inputs["input_ids"].shape[1] - total_in + kept
