"""VidCom2 (METHODS-2.md): frame budgets and distinct-token selection against a plain-Python reference written from
the spec, the official rounding (half to even), videos only (images refused at the call, image-only families at
patch), and the method on the video families against the bare language model fed by hand."""

import math

import numpy as np
import pytest
import torch
from conftest import (
    assert_batch_equals_one_by_one,
    assert_greedy_matches,
    assert_identity,
    captured_llm_input,
    feed_language_model,
    greedy,
    make_image,
    shortened_prompt,
    video_inputs,
)
from PIL import Image
from test_qwen_vl import _prompt, _reference_generate

import vtoken
from vtoken.tokens import VisualTokens
from vtoken.zoo import TINY_MODELS, build_prompt

SCALES = (1 / 8, 1 / 4, 1 / 2, 1, 2)


def reference(tokens, rate, dtype=torch.float64):
    """One video [F, tpf, D] straight from the spec, scores and budgets in plain Python: kept indices per frame."""
    frames, per_frame, dim = tokens.shape
    flat = tokens.reshape(-1, dim).to(dtype)
    variance = ((flat - flat.mean(0)) ** 2).mean(0).tolist()
    channels = sorted(range(dim), key=lambda c: (variance[c], c))[: dim // 2]
    x = flat[:, channels]
    x = (x / x.norm(dim=-1, keepdim=True)).view(frames, per_frame, -1)
    video_centre, frame_centres = x.reshape(-1, x.shape[-1]).mean(0), x.mean(1)

    def g(token, centre):
        squared = float(((token - centre) ** 2).sum())
        return sum(math.exp(-squared / (2 * a)) for a in SCALES)

    to_video = [[g(x[f, t], video_centre) for t in range(per_frame)] for f in range(frames)]
    to_frame = [[g(x[f, t], frame_centres[f]) for t in range(per_frame)] for f in range(frames)]
    uniqueness = [-sum(row) / per_frame for row in to_video]
    top = max(uniqueness)
    weights = [math.exp((u - top) / 0.01) for u in uniqueness]
    p = [w / sum(weights) for w in weights]
    kept = []
    for f in range(frames):
        scale = min(1.0, rate * (1 + p[f] - sum(p) / frames))
        count = max(1, round(scale * per_frame))  # Python's round: half to even, as torch.round
        order = sorted(range(per_frame), key=lambda t: (to_video[f][t] + to_frame[f][t], t))
        kept.append(sorted(order[:count]))
    return kept


@pytest.mark.parametrize("rate, count", [(0.625, 2), (0.875, 4), (0.375, 2), (0.125, 1), (0.01, 1)])
def test_frame_budgets_round_half_to_even(rate, count):
    """One frame: p = (1), so scale = R and k = round(R * tpf): 2.5 -> 2, 3.5 -> 4, 1.5 -> 2, 0.5 -> 0 -> 1."""
    tokens = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(0))
    selection = vtoken.VidCom2(budget=rate).select(VisualTokens(tokens, (2, 2), {"projected": tokens}))
    assert selection.counts_per_crop() == [count]


def test_the_unique_frame_gets_the_larger_budget():
    """Frames 0-2 repeat one pattern, frame 3 is different: frame 3 is far from the video mean, so its share
    p is ~1 and it keeps R * (1 + 1 - 1/4) of its tokens; the others R * (1 - 1/4)."""
    g = torch.Generator().manual_seed(1)
    pattern = torch.randn(1, 16, 8, generator=g)
    tokens = torch.cat([pattern.expand(3, -1, -1), torch.randn(1, 16, 8, generator=g) * 3])
    selection = vtoken.VidCom2(budget=0.5).select(VisualTokens(tokens, (4, 4), {"projected": tokens}))
    assert selection.counts_per_crop() == [6, 6, 6, 14]  # round(0.375 * 16), round(0.875 * 16)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rate", [0.25, 0.1, 0.6, 1.0])
def test_random_videos_equal_the_reference(seed, rate):
    g = torch.Generator().manual_seed(seed)
    frames = [3, 1, 5]
    tokens = torch.randn(sum(frames), 12, 10, generator=g) * torch.rand(10, generator=g) * 4  # channel scales vary
    tokens[4:6] = tokens[4:6] * 0.2 + tokens[3]  # similar frames
    videos = torch.arange(3).repeat_interleave(torch.tensor(frames))
    selection = vtoken.VidCom2(budget=rate).select(VisualTokens(tokens, (3, 4), {"projected": tokens}, videos))
    first = 0
    for count in frames:
        expected = reference(tokens[first : first + count], rate)
        assert [selection.kept_of(f).tolist() for f in range(first, first + count)] == expected
        first += count


def test_a_count_budget_is_tokens_per_frame_on_average():
    tokens = torch.randn(2, 20, 6, generator=torch.Generator().manual_seed(2))
    signals = {"projected": tokens}
    by_count = vtoken.VidCom2(budget=5).select(VisualTokens(tokens, (4, 5), signals, torch.zeros(2)))
    by_rate = vtoken.VidCom2(budget=0.25).select(VisualTokens(tokens, (4, 5), signals, torch.zeros(2)))
    assert torch.equal(by_count.kept, by_rate.kept)


def _placed(model, inputs, token_id):
    """The unpatched model's embeddings at the `token_id` placeholders (what the LLM receives): [L, D]."""
    return captured_llm_input(model, inputs)[0][inputs["input_ids"][0] == token_id]


@pytest.mark.parametrize("frames", [4, 7])
def test_onevision_equals_the_reference_and_the_llm_fed_by_hand(frames):
    """OneVision packs a video as its frames' pooled tokens and one newline: the newline stays."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    inputs = video_inputs(processor, frames)
    placed = _placed(model, inputs, model.config.video_token_id)
    per_frame = (len(placed) - 1) // frames
    tokens = placed[:-1].view(frames, per_frame, -1)
    kept = reference(tokens, 0.25, torch.float32)
    with torch.no_grad(), vtoken.patched(model, "vidcom2") as handle:
        logits = model(**inputs).logits
    assert [r.kept.tolist() for r in handle.records] == kept
    assert all(r.modality == "video" and r.tokens_in == per_frame for r in handle.records)
    visual = torch.cat([tokens[f, k] for f, k in enumerate(kept)] + [placed[-1:]])
    ref = feed_language_model(model, inputs["input_ids"], model.config.video_token_id, visual)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5


def _clip(frames, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return [Image.fromarray(np.roll(base, 8 * i, axis=1)) for i in range(frames)]


def test_qwen2_vl_keeps_original_positions():
    model, processor = TINY_MODELS["tiny-qwen2-vl"]()
    inputs = processor(videos=[_clip(8)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    placed = _placed(model, inputs, model.config.video_token_id)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    tokens = placed.view(t, h * w // 4, -1)
    kept = reference(tokens, 0.3, torch.float32)
    with torch.no_grad(), vtoken.patched(model, vtoken.VidCom2(budget=0.3)) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 4)
    assert [r.kept.tolist() for r in handle.records] == kept
    offsets = torch.cat([torch.tensor(k) + f * tokens.shape[1] for f, k in enumerate(kept)])
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.video_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep.nonzero().squeeze(1), placed[offsets], steps=4)
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)


def test_internvl_groups_a_videos_frames_from_the_prompt():
    model, processor = TINY_MODELS["tiny-internvl"]()
    inputs = video_inputs(processor, 5)
    placed = _placed(model, inputs, model.config.image_token_id)
    with torch.no_grad(), vtoken.patched(model, "vidcom2") as handle:
        logits = model(**inputs).logits
    kept = reference(placed.view(5, -1, placed.shape[-1]), 0.25, torch.float32)
    assert [(r.modality, r.image, r.crop) for r in handle.records] == [("video", 0, f) for f in range(5)]
    assert [r.kept.tolist() for r in handle.records] == kept
    frames = placed.view(5, -1, placed.shape[-1])
    _, embeds = shortened_prompt(model, inputs["input_ids"], model.config.image_token_id,
                                 [frames[f, k] for f, k in enumerate(kept)])  # fmt: skip
    with torch.no_grad():
        ref = model.lm_head(model.model.language_model(inputs_embeds=embeds).last_hidden_state)
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    image = processor(images=[make_image(300, 200)], text=[build_prompt(processor, "what?")], return_tensors="pt")
    with vtoken.patched(model, "vidcom2"), pytest.raises(vtoken.InputError, match="videos only.*image 0"):
        model(**image)


def test_one_frame_at_full_rate_is_the_identity_and_a_batch_equals_its_rows():
    """R = 1 keeps every token only where no frame is less unique than the mean: a one-frame video. Videos of a
    batch keep different numbers of tokens, also under beam search."""
    model, processor = TINY_MODELS["tiny-onevision"]()
    assert_identity(model, vtoken.VidCom2(budget=1.0), video_inputs(processor, 1), max_new_tokens=3)
    questions = ["what happens?", "describe it."]
    prompts = [build_prompt(processor, q, num_images=0, num_videos=1) for q in questions]
    clips = [_clip(4, 1), _clip(4, 2)]
    batched = processor(videos=clips, text=prompts, return_tensors="pt", padding=True)
    singles = [processor(videos=[c], text=[p], return_tensors="pt") for c, p in zip(clips, prompts, strict=True)]
    with torch.no_grad(), vtoken.patched(model, "vidcom2") as handle:
        assert_batch_equals_one_by_one(model, batched, singles, max_new_tokens=4)
        model(**batched)
        totals = [sum(r.tokens_out for r in handle.records if r.image == v) for v in (0, 1)]
        assert totals[0] != totals[1]  # the videos keep different numbers: the forward takes them as one item
        beams = model.generate(**batched, max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False)
    assert beams.shape[0] == 4
