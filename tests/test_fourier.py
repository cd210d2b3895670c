"""Fourier-VLM (METHODS.md): orthonormal 2-D DCT low-pass, checked against scipy and on the models it fits."""

import numpy as np
import pytest
import scipy.fft
import torch
from conftest import assert_identity, feed_language_model, inputs_for, make_image, video_inputs

import vtoken
from vtoken.images import example_clip
from vtoken.methods.fourier import dct, dct_lowpass, idct
from vtoken.zoo import TINY_MODELS, build_prompt


@pytest.mark.parametrize("shape", [(24, 24), (7, 13), (1, 5)])
def test_dct_equals_scipy_dctn_ortho(shape):
    x = torch.randn(*shape, 3, dtype=torch.float64)
    ours = dct(dct(x, dim=0), dim=1)
    ref = scipy.fft.dctn(x.numpy(), axes=(0, 1), norm="ortho")
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(idct(idct(ours, dim=0), dim=1).numpy(), x.numpy(), atol=1e-12)


@pytest.mark.parametrize("size", [(12, 12), (8, 5), (24, 24), (1, 1)])
def test_lowpass_equals_scipy_and_scales_a_constant_grid(size):
    h, w = size
    x = torch.randn(2, 24, 24, 4, dtype=torch.float64)
    ours = dct_lowpass(x, h, w)
    block = scipy.fft.dctn(x.numpy(), axes=(1, 2), norm="ortho")[:, :h, :w]
    ref = scipy.fft.idctn(block, axes=(1, 2), norm="ortho")
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-10)
    constant = torch.full((1, 24, 24, 2), 3.0, dtype=torch.float64)
    np.testing.assert_allclose(dct_lowpass(constant, h, w).numpy(), 3.0 * np.sqrt(24 * 24 / (h * w)), rtol=1e-12)


def test_output_grid_from_reserve_ratio_or_budget():
    assert vtoken.FourierDCT().output_grid(24, 24) == (12, 12)  # default budget 0.25 = official reserve 12
    assert vtoken.FourierDCT(reserve=6).output_grid(24, 24) == (6, 6)
    assert vtoken.FourierDCT(ratio=2 / 3).output_grid(30, 45) == (20, 30)
    assert vtoken.FourierDCT(budget=64).output_grid(24, 24) == (8, 8)
    for bad in [dict(reserve=0), dict(reserve=2.5), dict(ratio=0), dict(ratio=1.5), dict(budget=0)]:
        with pytest.raises(vtoken.VTokenError):
            vtoken.FourierDCT(**bad)


@pytest.mark.parametrize("reserve", [16, 12, 8, 6])
def test_llava_pruned_run_equals_language_model_fed_scipy_lowpass(llava, photos, reserve):
    model, processor = llava
    inputs = inputs_for(processor, [photos["chelsea"]], ["what is in the image?"])
    with torch.no_grad(), vtoken.patched(model, "fourier", reserve=reserve) as handle:
        logits = model(**inputs).logits
    assert [(r.tokens_in, r.tokens_out, r.kept) for r in handle.records] == [(576, reserve**2, None)]
    with torch.no_grad():
        hidden = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[-2][0, 1:]
        grid = hidden.double().view(24, 24, -1).numpy()
        block = scipy.fft.dctn(grid, axes=(0, 1), norm="ortho")[:reserve, :reserve]
        low = torch.from_numpy(scipy.fft.idctn(block, axes=(0, 1), norm="ortho")).float().flatten(0, 1)
        image = model.model.multi_modal_projector(low)
    ref = feed_language_model(model, inputs["input_ids"], model.config.image_token_id, image)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-4


def test_llava_identity_at_full_size(llava, photos):
    model, processor = llava
    assert_identity(model, vtoken.FourierDCT(reserve=24), inputs_for(processor, [photos["rocket"]], ["what?"]))


def test_video_llava_frames():
    model, processor = TINY_MODELS["tiny-video-llava"]()
    inputs = processor(videos=[example_clip(4)], text=[build_prompt(processor, "what?", 0, 1)], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, "fourier", reserve=8) as handle:
        logits = model(**inputs).logits
    assert [(r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [(f, 256, 64) for f in range(4)]
    assert logits.shape[1] == inputs["input_ids"].shape[1] - 4 * (256 - 64)


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_qwen_reduced_grid_drives_positions_and_placeholders(name):
    """After the merger: the 16 x 16 grid low-passed to 10 x 10 (ratio 2/3); the model sees the prompt it would
    build for a 10 x 10 grid: that many placeholders, M-RoPE positions of the smaller grid."""
    model, processor = TINY_MODELS[name]()
    inputs = processor(images=[make_image(448, 448)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    assert_identity(model, vtoken.FourierDCT(ratio=1.0), inputs)
    with torch.no_grad(), vtoken.patched(model, vtoken.FourierDCT(ratio=2 / 3)) as handle:
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(256, 100)]
    with torch.no_grad():
        merged = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        block = scipy.fft.dctn(merged.double().view(16, 16, -1).numpy(), axes=(0, 1), norm="ortho")[:10, :10]
        image = torch.from_numpy(scipy.fft.idctn(block, axes=(0, 1), norm="ortho")).float().flatten(0, 1)
        ids = inputs["input_ids"][0]
        ph = (ids == model.config.image_token_id).nonzero().squeeze(1)
        new_ids = torch.cat([ids[: ph[0]], ids[ph[:100]], ids[ph[-1] + 1 :]])[None]
        types = (new_ids == model.config.image_token_id).int()
        rope, _ = model.model.get_rope_index(
            new_ids, mm_token_type_ids=types, image_grid_thw=torch.tensor([[1, 20, 20]])
        )
        embeds = model.get_input_embeddings()(new_ids)
        embeds[new_ids == model.config.image_token_id] = image
        text = torch.arange(new_ids.shape[1])[None, None]
        out = model.model.language_model(inputs_embeds=embeds, position_ids=torch.cat([text, rope]))
        ref = model.lm_head(out.last_hidden_state)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-4
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


def test_llava_next_video_frames_equal_the_scipy_low_pass_fed_to_the_llm():
    model, processor = TINY_MODELS["tiny-llava-next-video"]()
    inputs = video_inputs(processor)
    assert_identity(model, vtoken.FourierDCT(reserve=12), inputs)  # the full 12 x 12 frame grid
    with torch.no_grad(), vtoken.patched(model, "fourier", reserve=5) as handle:
        logits = model(**inputs).logits
    assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(144, 25)] * 4
    with torch.no_grad():
        frames = inputs["pixel_values_videos"][0]
        patches = model.model.vision_tower(frames, output_hidden_states=True).hidden_states[-2][:, 1:]
        pooled = model.model.vision_resampler(patches).double().view(4, 12, 12, -1).numpy()
        block = scipy.fft.dctn(pooled, axes=(1, 2), norm="ortho")[:, :5, :5]
        low = torch.from_numpy(scipy.fft.idctn(block, axes=(1, 2), norm="ortho")).float().flatten(0, 2)
        visual = model.model.multi_modal_projector(low)
    ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, visual)
    assert (logits - ref).abs().max() <= 1e-4


def test_onevision_video_frames_keep_their_reserve():
    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = video_inputs(processor)
    with torch.no_grad(), vtoken.patched(model, "fourier", reserve=3) as handle:
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    side = handle.records[0].grid[0]
    assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(side * side, 9)] * 4
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    assert_identity(model, vtoken.FourierDCT(reserve=side), inputs)
