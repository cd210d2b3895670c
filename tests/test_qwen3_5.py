"""Qwen3.5 and Qwen3.5-MoE: the encoder stage on the Qwen3-VL tower (no DeepStack) with original M-RoPE positions;
FastV in the hybrid LLM (Gated DeltaNet linear attention + full attention): drops after full-attention layers only,
later layers (recurrent ones included) run on the shorter sequence."""

import pytest
import torch
from conftest import assert_batch_beams_and_restore, assert_identity, make_image

import vtoken
from vtoken.adapters import hf
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
    assert model.config.text_config.layer_types == ["linear_attention", "full_attention"] * 2
    assert not hasattr(model.model.visual, "deepstack_merger_list")


def test_identity_at_full_budget(qwen35):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
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
        tokens, cache, nxt = [ref[:, -1].argmax(-1, keepdim=True)], hf.cache_out(out), int(positions.max()) + 1
        for step in range(3):
            position = torch.cat([torch.full((1, 1, 1), kept_ids.shape[1] + step), torch.full((3, 1, 1), nxt + step)])
            out = inner.language_model(
                inputs_embeds=model.get_input_embeddings()(tokens[-1]),
                **hf.cache_kwargs(cache),
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


def test_drops_at_linear_attention_layers_are_refused_at_patch(qwen35):
    model, _ = qwen35
    before = _hooks(model)
    for layer in (0, 2):
        with pytest.raises(vtoken.VTokenError, match=r"Gated DeltaNet linear attention.*full-attention layer: \[1\]"):
            vtoken.patch(model, [vtoken.Random(budget=0.5), vtoken.FastV(layer=layer)])
        assert vtoken.handle_of(model) is None and "generate" not in model.__dict__ and _hooks(model) == before


def _fastv_reference(model, inputs, layer, keep):
    """FastV by hand on the unpatched hybrid LLM: the eager attention of the last token in full-attention layer
    `layer` picks the visual tokens (head mean, top `keep`); the layers after it, linear-attention ones included,
    run on the kept columns only (their slices of the M-RoPE tables, a causal mask). Returns the kept offsets and
    the logits."""
    lm = model.model.language_model
    seen = {}
    hook = lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(**inputs, output_attentions=True).attentions  # full-attention layers only
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    full_layers = [i for i, kind in enumerate(lm.config.layer_types) if kind == "full_attention"]
    attention = attentions[full_layers.index(layer)][0, :, -1].mean(0)
    ids = inputs["input_ids"][0]
    visual = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
    offsets = attention[visual].topk(keep).indices.sort().values
    kept = ~visual
    kept[visual.nonzero().squeeze(1)[offsets]] = True
    embeds, positions = seen["inputs_embeds"], seen["position_ids"]  # [3, B, L]
    hidden = embeds
    with torch.no_grad():
        for index, decoder_layer in enumerate(lm.layers):
            if index == layer + 1:
                hidden, positions = hidden[:, kept], positions[:, :, kept]
            length = hidden.shape[1]
            causal = torch.zeros(length, length).masked_fill(~torch.ones(length, length).bool().tril(), float("-inf"))
            mask = causal[None, None] if lm.config.layer_types[index] == "full_attention" else None
            rotary = lm.rotary_emb(hidden, positions)
            hidden = decoder_layer(hidden, attention_mask=mask, position_embeddings=rotary)
        logits = model.lm_head(lm.norm(hidden))
    return offsets, logits


@pytest.mark.parametrize("video", [False, True])
def test_fastv_after_a_full_attention_layer_equals_a_reference(video):
    model, processor = tiny_qwen3_5()
    inputs = _video(processor, 4) if video else _image(processor, (320, 320))
    visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    visual += int((inputs["input_ids"] == model.config.video_token_id).sum())
    keep = visual // 4
    offsets, ref = _fastv_reference(model, inputs, 1, keep)
    with torch.no_grad(), vtoken.patched(model, "fastv", layer=1, keep=keep) as handle:
        logits = model(**inputs).logits
    assert torch.equal(handle.records[-1].kept, offsets)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max() <= 1e-5


def test_fastv_identity_batch_and_decoding_with_the_hybrid_cache(qwen35):
    """keep=1.0 is the identity; a padded batch equals one-by-one runs through generate's hybrid cache (recurrent
    states of the kept tokens, a shorter KV cache in the later full-attention layer); with an encoder stage too."""
    from conftest import assert_batch_equals_one_by_one

    model, processor = qwen35
    texts = [build_prompt(processor, "what is this?"), build_prompt(processor, "describe the image please.")]
    images = [make_image(300, 200, 0), make_image(200, 400, 1)]
    batched = processor(images=images, text=texts, return_tensors="pt", padding=True)
    singles = [processor(images=[i], text=[t], return_tensors="pt") for i, t in zip(images, texts, strict=True)]
    assert_identity(model, vtoken.FastV(layer=1, keep=1.0), batched)
    for methods in ([vtoken.FastV(layer=1, keep=0.25)], [vtoken.Pool(budget=0.5), vtoken.FastV(layer=1, keep=0.5)]):
        with torch.no_grad(), vtoken.patched(model, methods) as handle:
            assert_batch_equals_one_by_one(model, batched, singles)
            model(**batched)
        assert [r.stage for r in handle.records][-2:] == ["prefill.layer1"] * 2
    with torch.no_grad(), vtoken.patched(model, vtoken.FastV(layer=1, keep=0.25)) as handle:
        cache = hf.cache_out(model(**singles[0], use_cache=True))
    dropped = handle.records[-1].tokens_in - handle.records[-1].tokens_out
    assert cache.layers[3].keys.shape[2] == cache.layers[1].keys.shape[2] - dropped == cache.get_seq_length() - dropped


def test_fastv_with_beams(qwen35):
    """Beams and num_return_sequences under FastV: keep=1.0 gives the stock beams; at 30 % every sequence runs."""
    model, processor = qwen35
    inputs = _image(processor, (320, 320))
    beams = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**inputs, **beams)
        with vtoken.patched(model, vtoken.FastV(layer=1, keep=1.0)):
            same = model.generate(**inputs, **beams)
        with vtoken.patched(model, vtoken.FastV(layer=1, keep=0.3)) as handle:
            out = model.generate(**inputs, **beams)
    assert torch.equal(same, ref) and out.shape == ref.shape
    assert {r.tokens_out for r in handle.records} == {vtoken.tokens_to_keep(0.3, handle.records[0].tokens_in)}
