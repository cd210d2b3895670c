"""Checks every family shares: exact image budgets over sizes, multi-image prompts, clear shape errors."""

import pytest
import torch
from conftest import make_image

import vtoken
from vtoken.zoo import TINY_MODELS, build_prompt

SIZES = [(336, 336), (800, 300), (300, 900), (50, 20), (1000, 700)]


@pytest.fixture(scope="module", params=["tiny-llava-next-video", "tiny-video-llava"])
def family(request):
    return TINY_MODELS[request.param]()


def test_image_budgets_are_exact_for_every_size(family):
    model, processor = family
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.3) as handle:
        for i, size in enumerate(SIZES):
            inputs = processor(
                images=[make_image(*size, i)], text=[build_prompt(processor, "what?")], return_tensors="pt"
            )
            model(**inputs)
            assert handle.records
            assert all(r.tokens_out == vtoken.tokens_to_keep(0.3, r.tokens_in) for r in handle.records)


def test_llava_next_multi_image_prompt():
    model, processor = TINY_MODELS["tiny-llava-next"]()
    images = [make_image(800, 300), make_image(300, 900, 1)]
    inputs = processor(images=images, text=[build_prompt(processor, "compare.", num_images=2)], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        with vtoken.patched(model, "fastervlm", budget=1.0):
            assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), ref)
        with vtoken.patched(model, "fastervlm", budget=0.25) as handle:
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert {r.image for r in handle.records} == {0, 1} and out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_wrong_pixel_shapes_are_named(name):
    model, processor = TINY_MODELS[name]()
    inputs = processor(images=[make_image(400, 300)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    key = next(k for k in ("pixel_values", "pixel_values_images") if k in inputs)
    bad = dict(inputs, **{key: inputs[key][..., :100]})  # crops cut to the wrong width / patch volume
    with vtoken.patched(model, "random", budget=0.5), pytest.raises(vtoken.InputError, match="pixel_values"):
        model(**bad)
    assert vtoken.handle_of(model) is None
