import sys
from pathlib import Path

import numpy as np
import torch
from conftest import inputs_for

from vtoken.overlay import kept_overlay, model_view

sys.path.insert(0, str(Path(__file__).parents[1] / "demo"))


def test_model_view_inverts_the_processor_normalisation(llava, photos):
    processor = llava[1]
    inputs = inputs_for(processor, [photos["astronaut"]], ["a"])
    view = model_view(
        inputs["pixel_values"][0], processor.image_processor.image_mean, processor.image_processor.image_std
    )
    expected = photos["astronaut"].resize((336, 336), resample=3)  # square photo: resize only, no crop
    diff = np.abs(np.asarray(view, dtype=np.int32) - np.asarray(expected, dtype=np.int32))
    assert view.size == (336, 336) and np.median(diff) <= 2


def test_overlay_dims_exactly_the_dropped_patches():
    image = __import__("PIL.Image", fromlist=["Image"]).new("RGB", (40, 20), (200, 100, 40))
    out = np.asarray(kept_overlay(image, torch.tensor([0, 7]), grid=(2, 4), dim=0.5))
    assert (out[:10, :10] == [200, 100, 40]).all()  # patch 0 kept
    assert (out[10:, 30:] == [200, 100, 40]).all()  # patch 7 kept
    assert (out[:10, 10:20] == [100, 50, 20]).all()  # patch 1 dropped
    assert np.asarray(kept_overlay(image, None, (2, 4))).tolist() == np.asarray(image).tolist()


def test_demo_compare_reports_answers_and_kept_tokens(llava, photos):
    from app import compare

    model, processor = llava
    result = compare(model, processor, photos["coffee"], "what is in the image?", "fastervlm", 0.25, max_new_tokens=3)
    assert result["patched"]["records"][0].tokens_out == 144
    assert result["overlay"].size == (336, 336)
    assert "576 -> 144" in result["summary"]
    assert isinstance(result["unpatched"]["answer"], str)


def test_demo_compare_on_other_families():
    from app import compare

    from vtoken.zoo import TINY_MODELS

    for name in ("tiny-qwen2-vl", "tiny-llava-next", "tiny-internvl", "tiny-gemma3"):
        model, processor = TINY_MODELS[name]()
        image = __import__("vtoken.images", fromlist=["example_image"]).example_image(300)
        result = compare(model, processor, image, "what?", "random", 0.25, max_new_tokens=2)
        assert result["overlay"].size[0] > 0 and "kept" in result["summary"]


def test_demo_opens_on_vtoken_minis_example():
    from app import compare, starting_example

    from vtoken.mini import example
    from vtoken.zoo import load

    model, processor = load("vtoken-mini")
    image, question = starting_example("vtoken-mini")
    assert question == example()[1]
    result = compare(model, processor, image, question, "fastervlm", 0.25, max_new_tokens=3)
    assert result["unpatched"]["answer"] == example()[2]  # the answer the scene was drawn with
    assert result["overlay"].size == (192, 192) and "144 -> 36" in result["summary"]
