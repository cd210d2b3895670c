"""LLaVA-NeXT-Video: per-frame budgets on the resampled 12 x 12 grid; images as LLaVA-NeXT."""

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_cls_attention, feed_language_model, video_inputs

import vtoken
from vtoken.zoo import tiny_llava_next_video


@pytest.fixture(scope="module")
def nv():
    return tiny_llava_next_video()


@pytest.mark.parametrize("frames", [1, 4, 32])
def test_per_frame_budget_and_equivalence(nv, frames):
    model, processor = nv
    inputs = video_inputs(processor, frames)
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
    assert [(r.modality, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        ("video", f, 144, 36) for f in range(frames)
    ]
    with torch.no_grad():  # the stock video features, 144 per frame, keeping the recorded tokens
        full = model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output[0].view(frames, 144, -1)
        video = torch.cat([full[f, r.kept] for f, r in enumerate(handle.records)])
        ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, video)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def test_fastervlm_score_is_the_pooled_eager_cls_attention(nv):
    model, processor = nv
    inputs = video_inputs(processor, 2)
    with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=20) as handle:
        model(**inputs)
    scores = eager_cls_attention(model.model.vision_tower, inputs["pixel_values_videos"][0])
    pooled = F.avg_pool2d(scores.view(-1, 1, 24, 24), 2).flatten(1)
    for frame, record in enumerate(handle.records):
        assert torch.equal(record.kept, pooled[frame].topk(20).indices.sort().values)
