"""Video-LLaVA: image and video towers, per-frame budgets, the frame's [CLS] passed through."""

import pytest
import torch
from conftest import eager_cls_attention, feed_language_model, video_inputs

import vtoken
from vtoken.zoo import tiny_video_llava

METHODS = ["fastervlm", "random", "pool"]


@pytest.fixture(scope="module")
def vl():
    return tiny_video_llava()


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
