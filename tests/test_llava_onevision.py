"""LLaVA-OneVision: SigLIP (no [CLS]), anyres_max_9 packing incl. downsampling, multi-image, pooled video."""

import pytest
import torch
from conftest import (
    assert_identity,
    feed_language_model,
    make_image,
    video_inputs,
)

import vtoken
from vtoken.zoo import build_prompt, tiny_onevision

SIZES = [(384, 384), (800, 300), (1600, 1500), (200, 900), (1000, 700)]


@pytest.fixture(scope="module")
def ov():
    return tiny_onevision()


def _image(processor, size, seed=0):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, "what?")], return_tensors="pt")


def test_identity_for_single_multi_image_and_video(ov):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = ov
    cases = [_image(processor, s, i) for i, s in enumerate(SIZES[:3])]
    cases.append(
        processor(
            images=[make_image(800, 300), make_image(200, 900, 1)],
            text=[build_prompt(processor, "compare.", 2)],
            return_tensors="pt",
        )
    )
    cases.append(video_inputs(processor, 4, "what?"))
    for inputs in cases:
        assert_identity(model, method, inputs, max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 50])
def test_exact_budget_per_crop_and_equivalence_with_stock_packing(ov, budget):
    model, processor = ov
    for i, size in enumerate(SIZES):
        inputs = _image(processor, size, i)
        with torch.no_grad(), vtoken.patched(model, "random", budget=budget) as handle:
            logits = model(**inputs).logits
        base, grid = handle.records
        assert (base.crop, base.tokens_in, grid.crop) == (0, 729, 1)
        for r in handle.records:
            assert r.tokens_out == vtoken.tokens_to_keep(budget, r.tokens_in) and len(r.kept) == r.tokens_out
        rows, cols = grid.grid
        assert grid.tokens_in == rows * cols
        with torch.no_grad():  # the stock packing: 729 base tokens, then rows of `cols` tokens + a newline each
            packed = model.model.get_image_features(
                inputs["pixel_values"], inputs["image_sizes"], batch_num_images=inputs["batch_num_images"]
            ).pooler_output[0]
        assert len(packed) == 729 + rows * (cols + 1)
        keep = [int(j) for j in base.kept]
        kept_rows = {}
        for t in grid.kept.tolist():
            kept_rows.setdefault(t // cols, []).append(t % cols)
        for row in sorted(kept_rows):
            start = 729 + row * (cols + 1)
            keep += [start + c for c in sorted(kept_rows[row])] + [start + cols]
        image = packed[torch.tensor(keep)]
        ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, size


@pytest.mark.parametrize("frames", [1, 4, 32])
def test_video_per_frame_budget_with_one_trailing_newline(ov, frames):
    model, processor = ov
    inputs = video_inputs(processor, frames, "what?")
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert [(r.modality, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        ("video", f, 196, 49) for f in range(frames)
    ]
    with torch.no_grad():
        stock = model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output[0]  # [F*196 + 1, D]
        frames_tokens = stock[:-1].view(frames, 196, -1)
        video = torch.cat([*(frames_tokens[f, r.kept] for f, r in enumerate(handle.records)), stock[-1:]])
        ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, video)
    assert (logits - ref).abs().max() <= 1e-5 and out.shape[1] == inputs["input_ids"].shape[1] + 2
