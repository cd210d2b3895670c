"""Video-LLaVA: image and video towers, per-frame budgets, the frame's [CLS] passed through."""

import pytest
import torch
from conftest import (
    assert_batch_beams_and_restore,
    assert_identity,
    eager_cls_attention,
    feed_language_model,
    make_image,
    video_inputs,
)

import vtoken
from vtoken.images import example_clip
from vtoken.zoo import build_prompt, tiny_video_llava

METHODS = ["fastervlm", "random", "pool"]


@pytest.fixture(scope="module")
def vl():
    return tiny_video_llava()


@pytest.mark.parametrize("method", METHODS)
def test_identity_for_images_and_video(vl, method):
    model, processor = vl
    image = processor(images=[make_image(300, 200)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    for inputs in (image, video_inputs(processor, 4)):
        assert_identity(model, method, inputs, max_new_tokens=4)


@pytest.mark.parametrize("frames", [1, 4, 32])
@pytest.mark.parametrize("method", METHODS)
def test_per_frame_budget_and_equivalence(vl, frames, method):
    model, processor = vl
    inputs = video_inputs(processor, frames)
    k = 64
    with torch.no_grad(), vtoken.patched(model, method, budget=k) as handle:
        logits = model(**inputs).logits
    assert [(r.modality, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        ("video", f, 256, k) for f in range(frames)
    ]
    # reference: per frame [CLS] + the chosen patches, projected, fed to the bare language model
    with torch.no_grad():
        hidden = model.model.video_tower(inputs["pixel_values_videos"][0], output_hidden_states=True).hidden_states[-2]
        if method == "pool":  # 64 = 8 x 8 adaptive pooling of the 16 x 16 patch grid
            grid = hidden[:, 1:].reshape(frames, 16, 16, -1).permute(0, 3, 1, 2)
            patches = torch.nn.functional.adaptive_avg_pool2d(grid, 8).flatten(2).transpose(1, 2)
        else:
            patches = torch.stack([hidden[f, 1:][r.kept] for f, r in enumerate(handle.records)])
        video = model.model.multi_modal_projector(torch.cat([hidden[:, :1], patches], dim=1)).flatten(0, 1)
        ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, video)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_fastervlm_per_frame_matches_eager_video_tower_attention(vl):
    model, processor = vl
    inputs = video_inputs(processor, 4)
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=0.1) as handle:
        model(**inputs)
    scores = eager_cls_attention(model.model.video_tower, inputs["pixel_values_videos"][0])
    for frame, record in enumerate(handle.records):
        assert torch.equal(record.kept, scores[frame].topk(record.tokens_out).indices.sort().values)


def test_batch_of_videos_beams_and_restore(vl):
    model, processor = vl
    texts = [
        build_prompt(processor, "what happens?", 0, 1),
        build_prompt(processor, "describe the video in detail.", 0, 1),
    ]
    clips = [example_clip(4), example_clip(4, size=160)]
    batched = processor(videos=clips, text=texts, return_tensors="pt", padding=True)
    singles = [processor(videos=[clips[i]], text=[texts[i]], return_tensors="pt") for i in range(2)]
    assert_batch_beams_and_restore(model, "fastervlm", batched, singles)
