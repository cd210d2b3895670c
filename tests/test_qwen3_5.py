"""Qwen3.5 and Qwen3.5-MoE: the encoder stage on the Qwen3-VL tower (no DeepStack) with original M-RoPE positions;
LLM stages refused at `patch` (a hybrid LLM: Gated DeltaNet linear attention in 3 of every 4 layers)."""

import pytest
import torch
from conftest import assert_batch_beams_and_restore, assert_identity, make_image

import vtoken
from vtoken.images import example_clip
from vtoken.zoo import build_prompt, tiny_qwen3_5, tiny_qwen3_5_moe

FAMILIES = {"qwen3.5": tiny_qwen3_5, "qwen3.5-moe": tiny_qwen3_5_moe}
SIZES = [(448, 448), (500, 300), (300, 700), (120, 90)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen35(request):
    return FAMILIES[request.param]()


def _image(processor, size=(448, 448), seed=0, question="what is in the image?"):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, question)], return_tensors="pt")


def _video(processor, frames=8):
    prompt = build_prompt(processor, "what happens?", num_images=0, num_videos=1)
    return processor(videos=[example_clip(frames)], text=[prompt], return_tensors="pt", do_sample_frames=False)


def test_the_llm_is_hybrid(qwen35):
    model, _ = qwen35
    assert model.config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert not hasattr(model.model.visual, "deepstack_merger_list")


@pytest.mark.parametrize("method", ["random", "pool", "mmtok", "fourier"])
def test_identity_at_full_budget(qwen35, method):
    model, processor = qwen35
    for inputs in [_image(processor, SIZES[1]), _video(processor, 4)]:
        assert_identity(model, method, inputs, max_new_tokens=4)


@pytest.mark.parametrize("video", [False, True])
def test_pruned_run_equals_language_model_with_original_positions(qwen35, video):
    """The bare hybrid LLM fed the kept embeddings at their original M-RoPE positions, by hand (prefill logits,
    then greedy decoding after the largest position through its recurrent + KV cache)."""
    model, processor = qwen35
    inputs = _video(processor, 8) if video else _image(processor)
    token_id = model.config.video_token_id if video else model.config.image_token_id
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, inputs["input_ids"].shape[1] :]
    inner = model.model
    grid = inputs["video_grid_thw" if video else "image_grid_thw"]
    per_frame = int(grid[0, 1] * grid[0, 2]) // 4
    offsets = torch.cat([r.kept + f * per_frame for f, r in enumerate(handle.records)])
    with torch.no_grad():
        if video:
            features = inner.get_video_features(inputs["pixel_values_videos"], grid).pooler_output
        else:
            features = inner.get_image_features(inputs["pixel_values"], grid).pooler_output
    chosen = torch.cat(features)[offsets]
    ids = inputs["input_ids"][0]
    placeholders = (ids == token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    rope, _ = inner.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
    )
    kept_ids, positions = ids[keep][None], rope[:, :, keep]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(kept_ids)
        embeds[kept_ids == token_id] = chosen
        text = torch.arange(kept_ids.shape[1])[None, None]
        out = inner.language_model(inputs_embeds=embeds, position_ids=torch.cat([text, positions]), use_cache=True)
        ref = model.lm_head(out.last_hidden_state)
        tokens, cache, nxt = [ref[:, -1].argmax(-1, keepdim=True)], out.past_key_values, int(positions.max()) + 1
        for step in range(3):
            position = torch.cat([torch.full((1, 1, 1), kept_ids.shape[1] + step), torch.full((3, 1, 1), nxt + step)])
            out = inner.language_model(
                inputs_embeds=model.get_input_embeddings()(tokens[-1]),
                past_key_values=cache,
                position_ids=position,
                use_cache=True,
            )
            tokens.append(model.lm_head(out.last_hidden_state)[:, -1].argmax(-1, keepdim=True))
    assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5
    assert torch.equal(generated, torch.cat(tokens, dim=1))


@pytest.mark.parametrize("budget", [0.5, 0.1, 7])
def test_exact_budget_for_sizes_and_frames(qwen35, budget):
    model, processor = qwen35
    with torch.no_grad(), vtoken.patched(model, "pool", budget=budget) as handle:
        for i, size in enumerate(SIZES):
            inputs = _image(processor, size, i, "what?")
            logits = model(**inputs).logits
            n = int(inputs["image_grid_thw"][0, 1:].prod()) // 4
            assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(n, vtoken.tokens_to_keep(budget, n))]
            assert logits.shape[1] == inputs["input_ids"].shape[1] - n + handle.records[0].tokens_out
        for frames in (2, 6, 16):
            inputs = _video(processor, frames)
            t, gh, gw = inputs["video_grid_thw"][0].tolist()
            n, k = gh * gw // 4, vtoken.tokens_to_keep(budget, gh * gw // 4)
            logits = model(**inputs).logits
            assert [(r.crop, r.tokens_out) for r in handle.records] == [(f, k) for f in range(t)]
            assert logits.shape[1] == inputs["input_ids"].shape[1] - t * (n - k)


def test_padded_batch_beams_and_restore(qwen35):
    model, processor = qwen35
    texts = [build_prompt(processor, "compare these.", 2, 1), build_prompt(processor, "and this one?")]
    images = [make_image(300, 200, 0), make_image(200, 500, 1), make_image(640, 480, 2)]
    clip = example_clip(4)
    batched = processor(images=images, videos=[clip], text=texts, return_tensors="pt", padding=True)
    singles = [
        processor(images=images[:2], videos=[clip], text=texts[:1], return_tensors="pt"),
        processor(images=images[2:], text=texts[1:], return_tensors="pt"),
    ]
    assert_batch_beams_and_restore(model, "random", batched, singles)


def _hooks(model):
    return {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for name, m in model.named_modules()}


@pytest.mark.parametrize("method", [vtoken.FastV(layer=0), vtoken.FastV(layer=2), vtoken.MustDrop()])
def test_llm_stages_are_refused_at_patch_with_the_reason(qwen35, method):
    model, _ = qwen35
    before = _hooks(model)
    with pytest.raises(vtoken.VTokenError, match="Gated DeltaNet linear attention"):
        vtoken.patch(model, [vtoken.Random(budget=0.5), method])
    assert vtoken.handle_of(model) is None and "generate" not in model.__dict__ and _hooks(model) == before
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention"):
        vtoken.patch(model, "fastervlm", budget=0.25)
