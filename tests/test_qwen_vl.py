"""Qwen2-VL and Qwen2.5-VL: original M-RoPE positions, dynamic resolution, several images, video frames."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_batch_equals_one_by_one, assert_greedy_matches, assert_identity, greedy, make_image
from PIL import Image

import vtoken
from vtoken.adapters import hf
from vtoken.zoo import tiny_qwen2_5_vl, tiny_qwen2_vl

FAMILIES = {"qwen2-vl": tiny_qwen2_vl, "qwen2.5-vl": tiny_qwen2_5_vl}
METHODS = ["random", "pool"]
SIZES = [(448, 448), (500, 300), (300, 700), (120, 90), (1000, 400)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen(request):
    return FAMILIES[request.param]()


def _prompt(processor, question, images=1, videos=0):
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _clip(frames, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)
    return [Image.fromarray(np.roll(base, 4 * i, axis=1)) for i in range(frames)]


def test_identity_at_full_budget(qwen):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = qwen
    cases = [
        processor(images=[make_image(w, h, i)], text=[_prompt(processor, "what is in the image?")], return_tensors="pt")
        for i, (w, h) in enumerate(SIZES[:3])
    ]
    cases.append(processor(videos=[_clip(4)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt"))
    for inputs in cases:
        assert_identity(model, method, inputs, max_new_tokens=4)


def _reference_generate(model, inputs, keep_columns, image_embeds, steps):
    """The bare language model fed the kept embeddings at their ORIGINAL M-RoPE positions (text row contiguous),
    then greedy decoding continuing after the largest position: prefill logits, the generated tokens and
    their per-step logits [steps, 1, V]."""
    inner = model.model
    rope, _ = inner.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        **({"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}),
    )
    ids = inputs["input_ids"][0, keep_columns][None]
    positions = rope[:, :, keep_columns]
    text = torch.arange(ids.shape[1])[None, None]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        visual = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
        embeds[visual] = image_embeds  # an image's or a video's kept tokens
        out = inner.language_model(inputs_embeds=embeds, position_ids=torch.cat([text, positions]), use_cache=True)
        logits = model.lm_head(out.last_hidden_state)
        tokens, cache, nxt = [], hf.cache_out(out), int(positions.max()) + 1
        step_logits = [logits[:, -1]]
        token = logits[:, -1].argmax(-1, keepdim=True)
        for step in range(steps):
            tokens.append(token)
            if step == steps - 1:
                break
            pos = torch.full((3, 1, 1), nxt + step)
            text_pos = torch.full((1, 1, 1), ids.shape[1] + step)
            out = inner.language_model(
                inputs_embeds=model.get_input_embeddings()(token),
                **hf.cache_kwargs(cache),
                position_ids=torch.cat([text_pos, pos]),
                use_cache=True,
            )
            step_logits.append(model.lm_head(out.last_hidden_state)[:, -1])
            token = step_logits[-1].argmax(-1, keepdim=True)
    return logits, torch.cat(tokens, dim=1), torch.stack(step_logits)


@pytest.mark.parametrize("method", METHODS)
def test_pruned_run_equals_language_model_with_original_positions(qwen, method):
    model, processor = qwen
    inputs = processor(
        images=[make_image(448, 448, 3)], text=[_prompt(processor, "what is in the image?")], return_tensors="pt"
    )  # a 16 x 16 merged grid
    k = 64
    with torch.no_grad(), vtoken.patched(model, method, budget=k) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 5)
    assert [r.tokens_out for r in handle.records] == [k]
    with torch.no_grad():
        full = torch.cat(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
    if method == "pool":  # 8 x 8 adaptive average pooling; each cell sits at its centre patch (2i, 2j)
        chosen = F.adaptive_avg_pool2d(full.view(16, 16, -1).permute(2, 0, 1), 8).flatten(1).T
        offsets = torch.tensor([2 * i * 16 + 2 * j for i in range(8) for j in range(8)])
    else:
        offsets = handle.records[0].kept
        chosen = full[offsets]
    ids = inputs["input_ids"][0]
    placeholders = (ids == model.config.image_token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep.nonzero().squeeze(1), chosen, steps=5)
    assert logits.shape == ref_logits.shape
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [0.5, 0.2, 0.05, 17])
def test_exact_budget_for_dynamic_resolutions(qwen, method, budget):
    model, processor = qwen
    with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
        for i, (w, h) in enumerate(SIZES):
            inputs = processor(images=[make_image(w, h, i)], text=[_prompt(processor, "what?")], return_tensors="pt")
            logits = model(**inputs).logits
            t, gh, gw = inputs["image_grid_thw"][0].tolist()
            n = gh * gw // 4
            k = vtoken.tokens_to_keep(budget, n)
            assert [(r.tokens_in, r.tokens_out, r.grid) for r in handle.records] == [(n, k, (gh // 2, gw // 2))]
            assert logits.shape[1] == inputs["input_ids"].shape[1] - n + k


@pytest.mark.parametrize("frames", [1, 4, 32])
def test_video_budget_per_frame(qwen, frames):
    model, processor = qwen
    inputs = processor(videos=[_clip(frames)], text=[_prompt(processor, "what happens?", 0, 1)], return_tensors="pt")
    t, gh, gw = inputs["video_grid_thw"][0].tolist()
    per_frame = gh * gw // 4
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    k = vtoken.tokens_to_keep(0.25, per_frame)
    assert [(r.modality, r.crop, r.tokens_out) for r in handle.records] == [("video", f, k) for f in range(t)]
    assert logits.shape[1] == inputs["input_ids"].shape[1] - t * (per_frame - k)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_images_and_video_in_one_prompt_and_padded_batch(qwen):
    model, processor = qwen
    texts = [_prompt(processor, "compare these.", images=2, videos=1), _prompt(processor, "and this one?")]
    images = [make_image(300, 200, 0), make_image(200, 500, 1), make_image(640, 480, 2)]
    clip = _clip(4)
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.3) as handle:
        batched = processor(images=images, videos=[clip], text=texts, return_tensors="pt", padding=True)
        model.generate(**batched, max_new_tokens=5, do_sample=False)
        assert sorted({(r.modality, r.image) for r in handle.records}) == [
            ("image", 0),
            ("image", 1),
            ("image", 2),
            ("video", 0),
        ]
        first = processor(images=images[:2], videos=[clip], text=texts[:1], return_tensors="pt")
        second = processor(images=images[2:], text=texts[1:], return_tensors="pt")
        assert_batch_equals_one_by_one(model, batched, [first, second])


def test_beams_manual_decoding_and_restore(qwen):
    model, processor = qwen
    inputs = processor(images=[make_image(500, 300, 0)], text=[_prompt(processor, "what?")], return_tensors="pt")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
        with vtoken.patched(model, "pool", budget=0.25):
            beams = model.generate(**inputs, max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
            greedy = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, inputs["input_ids"].shape[1] :]
            # a hand-written loop with the caller's own (unpruned-length) mask
            mask = inputs["attention_mask"]
            out = model(**inputs, use_cache=True)
            tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
            for _ in range(3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(
                    input_ids=tokens[-1], attention_mask=mask, **hf.cache_kwargs(hf.cache_out(out)), use_cache=True
                )
                tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
        after = model.generate(**inputs, max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    assert beams.shape[0] == 2 and torch.equal(
        beams[:, : inputs["input_ids"].shape[1]], inputs["input_ids"].repeat(2, 1)
    )
    assert torch.equal(torch.cat(tokens, 1), greedy)
    assert torch.equal(after, ref) and all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_missing_inputs_are_named(qwen):
    model, processor = qwen
    inputs = processor(images=[make_image(300, 300, 0)], text=[_prompt(processor, "what?")], return_tensors="pt")
    with vtoken.patched(model, "random", budget=0.5):
        with pytest.raises(vtoken.InputError, match="mm_token_type_ids"):
            model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
        with pytest.raises(vtoken.InputError, match="image_grid_thw"):
            model(**{k: v for k, v in inputs.items() if k != "image_grid_thw"})
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention"):
        vtoken.patch(model, "fastervlm", budget=0.25)


def test_encoder_signals_are_in_raster_order(qwen):
    """merge_features = the last ViT block output pooled per 2 x 2 merge group, in raster order: the same
    reordering maps the model's merger applied to that output onto its own (raster-ordered) pooler output."""
    model, processor = qwen
    inputs = processor(
        images=[make_image(448, 448, 5), make_image(300, 500, 6)],
        text=[_prompt(processor, "compare.", images=2)],
        return_tensors="pt",
    )
    visual = model.model.visual
    with torch.no_grad():
        out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        handle = vtoken.patch(model, "random", budget=0.5)
        reordered = handle.adapter.raster_order(visual.merger(out.last_hidden_state), inputs["image_grid_thw"])
        vtoken.unpatch(model)
    torch.testing.assert_close(reordered, out.pooler_output)
    if hasattr(visual, "window_size"):  # Qwen2.5-VL: the window order really differs from raster order here
        assert not torch.allclose(visual.merger(out.last_hidden_state), out.pooler_output)

    seen = {}

    class Spy(vtoken.ScoreMethod):
        name = "spy"
        requires = ("merge_features",)

        def score(self, tokens):
            seen.setdefault("features", []).append(tokens.signals["merge_features"])
            return tokens.signals["merge_features"].norm(dim=-1)

    with torch.no_grad(), vtoken.patched(model, Spy(budget=10)) as handle:
        model(**inputs)
    merge = visual.spatial_merge_size
    groups = out.last_hidden_state.view(-1, merge**2, out.last_hidden_state.shape[-1]).mean(1)
    expected = handle.adapter.raster_order(groups, inputs["image_grid_thw"])
    got = torch.cat([f.flatten(0, 1) for f in seen["features"]])
    torch.testing.assert_close(got, expected)
    for record, features in zip(handle.records, seen["features"], strict=True):
        assert torch.equal(record.kept, features[0].norm(dim=-1).topk(10).indices.sort().values)
