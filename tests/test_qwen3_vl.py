"""Qwen3-VL and Qwen3-VL-MoE: original interleaved M-RoPE positions, DeepStack features that follow the
selection, timestamped video frames, FastV inside the LLM before and after the last DeepStack layer."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_batch_beams_and_restore, assert_greedy_matches, assert_identity, greedy, make_image

import vtoken
from vtoken.adapters import hf
from vtoken.images import example_clip
from vtoken.zoo import build_prompt, tiny_qwen3_vl, tiny_qwen3_vl_moe

FAMILIES = {"qwen3-vl": tiny_qwen3_vl, "qwen3-vl-moe": tiny_qwen3_vl_moe}
METHODS = ["random", "pool", "mmtok", "fourier"]
SIZES = [(448, 448), (500, 300), (300, 700), (120, 90), (1000, 400)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen3(request):
    return FAMILIES[request.param]()


def _image(processor, size=(448, 448), seed=0, question="what is in the image?"):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, question)], return_tensors="pt")


def _video(processor, frames=8, question="what happens?"):
    """One clip of `frames` frames, every frame kept (`frames / 2` temporal patches, each its own run)."""
    prompt = build_prompt(processor, question, num_images=0, num_videos=1)
    return processor(videos=[example_clip(frames)], text=[prompt], return_tensors="pt", do_sample_frames=False)


def test_identity_at_full_budget(qwen3):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = qwen3
    for inputs in [_image(processor, size, i) for i, size in enumerate(SIZES[:2])] + [_video(processor, 4)]:
        assert_identity(model, method, inputs, max_new_tokens=4)


def _reference_generate(model, inputs, keep_columns, visual_embeds, deepstack, steps):
    """The bare language model fed the kept embeddings and their DeepStack features at their ORIGINAL M-RoPE
    positions (text row contiguous), then greedy decoding after the largest position: prefill logits, tokens and
    their per-step logits [steps, 1, V]."""
    inner = model.model
    rope, _ = inner.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
    )
    ids = inputs["input_ids"][0, keep_columns][None]
    positions = rope[:, :, keep_columns]
    text = torch.arange(ids.shape[1])[None, None]
    visual = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        embeds[visual] = visual_embeds
        out = inner.language_model(
            inputs_embeds=embeds,
            position_ids=torch.cat([text, positions]),
            visual_pos_masks=visual,
            deepstack_visual_embeds=deepstack,
            use_cache=True,
        )
        logits = model.lm_head(out.last_hidden_state)
        tokens, cache, nxt = [], hf.cache_out(out), int(positions.max()) + 1
        step_logits = [logits[:, -1]]
        token = logits[:, -1].argmax(-1, keepdim=True)
        for step in range(steps):
            tokens.append(token)
            if step == steps - 1:
                break
            position = torch.cat([torch.full((1, 1, 1), ids.shape[1] + step), torch.full((3, 1, 1), nxt + step)])
            out = inner.language_model(
                inputs_embeds=model.get_input_embeddings()(token),
                **hf.cache_kwargs(cache),
                position_ids=position,
                use_cache=True,
            )
            step_logits.append(model.lm_head(out.last_hidden_state)[:, -1])
            token = step_logits[-1].argmax(-1, keepdim=True)
    return logits, torch.cat(tokens, dim=1), torch.stack(step_logits)


def _kept_columns(inputs, token_id, offsets):
    ids = inputs["input_ids"][0]
    placeholders = (ids == token_id).nonzero().squeeze(1)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[placeholders] = False
    keep[placeholders[offsets]] = True
    return keep.nonzero().squeeze(1)


@pytest.mark.parametrize("method", ["random", "pool"])
def test_pruned_image_equals_language_model_with_original_positions_and_deepstack(qwen3, method):
    model, processor = qwen3
    inputs = _image(processor)  # a 14 x 14 merged grid
    k = 49
    with torch.no_grad(), vtoken.patched(model, method, budget=k) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 5)
    assert [r.tokens_out for r in handle.records] == [k]
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    levels = [torch.cat(out.pooler_output)] + [torch.cat(level) for level in out.deepstack_features]
    assert len(levels) == 3  # the merged tokens and two DeepStack levels
    if method == "pool":  # 7 x 7 average pooling of 2 x 2 cells; each cell sits at its top-left token (2i, 2j)
        levels = [F.avg_pool2d(x.T.reshape(-1, 14, 14), 2).flatten(1).T for x in levels]
        offsets = torch.tensor([2 * i * 14 + 2 * j for i in range(7) for j in range(7)])
    else:
        offsets = handle.records[0].kept
        levels = [x[offsets] for x in levels]
    keep = _kept_columns(inputs, model.config.image_token_id, offsets)
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep, levels[0], levels[1:], steps=5)
    assert logits.shape == ref_logits.shape
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)


def test_pruned_video_equals_language_model_with_timestamps_and_deepstack(qwen3):
    """Each temporal patch is its own placeholder run after its `<t seconds>` text; each keeps its budget."""
    model, processor = qwen3
    inputs = _video(processor, 8)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    per_frame = h * w // 4
    assert (t, per_frame) == (4, 16)
    text = processor.tokenizer.decode(inputs["input_ids"][0])
    assert text.count("seconds>") == t and text.count("<|vision_start|><|video_pad|>") == t
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        generated = greedy(model, inputs, 4)
    assert [(r.modality, r.crop, r.tokens_out) for r in handle.records] == [("video", f, 4) for f in range(t)]
    offsets = torch.cat([r.kept + f * per_frame for f, r in enumerate(handle.records)])
    with torch.no_grad():
        out = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    levels = [torch.cat(out.pooler_output)[offsets]] + [torch.cat(level)[offsets] for level in out.deepstack_features]
    keep = _kept_columns(inputs, model.config.video_token_id, offsets)
    ref_logits, *ref_greedy = _reference_generate(model, inputs, keep, levels[0], levels[1:], steps=4)
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert_greedy_matches(generated, ref_greedy)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [0.5, 0.1, 7])
def test_exact_budget_for_sizes_and_frames(qwen3, method, budget):
    model, processor = qwen3
    with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
        for i, size in enumerate(SIZES):
            inputs = _image(processor, size, i, "what?")
            logits = model(**inputs).logits
            _, gh, gw = inputs["image_grid_thw"][0].tolist()
            n = gh * gw // 4
            kept = [r.tokens_out for r in handle.records]
            if method != "fourier":  # fourier keeps the nearest smaller grid, tested in test_fourier
                assert kept == [vtoken.tokens_to_keep(budget, n)]
            assert handle.records[0].tokens_in == n
            assert logits.shape[1] == inputs["input_ids"].shape[1] - n + kept[0]
        if method == "random":
            for frames in (2, 6, 16):
                inputs = _video(processor, frames)
                t, gh, gw = inputs["video_grid_thw"][0].tolist()
                n = gh * gw // 4
                logits = model(**inputs).logits
                k = vtoken.tokens_to_keep(budget, n)
                assert [(r.crop, r.tokens_out) for r in handle.records] == [(f, k) for f in range(t)]
                assert logits.shape[1] == inputs["input_ids"].shape[1] - t * (n - k)


def test_padded_batch_beams_and_restore(qwen3):
    model, processor = qwen3
    texts = [build_prompt(processor, "compare these.", 2, 1), build_prompt(processor, "and this one?")]
    images = [make_image(300, 200, 0), make_image(200, 500, 1), make_image(640, 480, 2)]
    clip = example_clip(4)
    batched = processor(images=images, videos=[clip], text=texts, return_tensors="pt", padding=True)
    singles = [
        processor(images=images[:2], videos=[clip], text=texts[:1], return_tensors="pt"),
        processor(images=images[2:], text=texts[1:], return_tensors="pt"),
    ]
    assert_batch_beams_and_restore(model, "random", batched, singles)  # every method: tests/test_contract.py


# ----------------------------------------------------------------- FastV inside the LLM, around DeepStack
def _fastv_reference(model, inputs, layer, keep):
    """FastV by hand on the unpatched model: the eager layer-`layer` attention of the last token picks the visual
    tokens (head mean, top `keep`), then every later layer runs the FULL sequence with the dropped tokens masked
    out as keys; DeepStack is added by the stock code path. Returns the kept offsets and the logits of the kept
    columns. (Dropped tokens then influence nothing that remains, so this equals running without them.)"""
    lm = model.model.language_model
    seen = {}
    hook = lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attention = model(**inputs, output_attentions=True).attentions[layer][0, :, -1].mean(0)
    finally:
        hook.remove()
        model.set_attn_implementation("sdpa")
    ids = inputs["input_ids"][0]
    visual = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
    offsets = attention[visual].topk(keep).indices.sort().values
    dropped = visual.clone()
    dropped[visual.nonzero().squeeze(1)[offsets]] = False
    length = len(ids)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    masks = [causal, causal & ~dropped[None, :]]
    embeds, positions = seen["inputs_embeds"], seen["position_ids"]  # [3, B, L]: t/h/w rows only in a forward
    rotary = lm.rotary_emb(embeds, positions)
    deepstack, where = seen["deepstack_visual_embeds"], seen["visual_pos_masks"]
    hidden = embeds
    with torch.no_grad():
        for index, decoder_layer in enumerate(lm.layers):
            allowed = masks[index > layer]
            mask = torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]
            hidden = decoder_layer(hidden, attention_mask=mask, position_embeddings=rotary)
            if index < len(deepstack):
                hidden = hidden.clone()
                hidden[where] += deepstack[index]
        logits = model.lm_head(lm.norm(hidden))
    return offsets, logits[:, ~dropped]


@pytest.mark.parametrize("layer", [0, 2])  # before the last DeepStack layer (1), and after it
@pytest.mark.parametrize("video", [False, True])
def test_fastv_around_deepstack_equals_a_masked_reference(layer, video):
    model, processor = tiny_qwen3_vl()
    inputs = _video(processor, 4) if video else _image(processor, (320, 320))
    visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    visual += int((inputs["input_ids"] == model.config.video_token_id).sum())
    keep = visual // 4
    offsets, ref = _fastv_reference(model, inputs, layer, keep)
    with torch.no_grad(), vtoken.patched(model, "fastv", layer=layer, keep=keep) as handle:
        logits = model(**inputs).logits
    assert torch.equal(handle.records[-1].kept, offsets)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max() <= 1e-5


def test_fastv_identity_and_batch_around_deepstack(qwen3):
    model, processor = qwen3
    texts = [build_prompt(processor, "what is this?"), build_prompt(processor, "describe the image please.")]
    images = [make_image(300, 200, 0), make_image(200, 400, 1)]
    batched = processor(images=images, text=texts, return_tensors="pt", padding=True)
    singles = [processor(images=[i], text=[t], return_tensors="pt") for i, t in zip(images, texts, strict=True)]
    from conftest import assert_batch_equals_one_by_one

    for layer in (0, 2):
        assert_identity(model, vtoken.FastV(layer=layer, keep=1.0), batched)
        with torch.no_grad(), vtoken.patched(model, vtoken.FastV(layer=layer, keep=0.25)):
            assert_batch_equals_one_by_one(model, batched, singles)
    # an encoder stage and FastV together: both DeepStack paths at once
    with torch.no_grad(), vtoken.patched(model, [vtoken.Random(budget=0.5), vtoken.FastV(layer=0, keep=0.5)]):
        assert_batch_equals_one_by_one(model, batched, singles)


@pytest.mark.parametrize("method", ["pool", "fourier"])
def test_deepstack_levels_follow_the_merge(qwen3, method):
    """Merging methods: every DeepStack level reaching the model is merged exactly as the merged tokens are
    (pool: 2 x 2 averages; fourier: the same DCT low-pass grid), per image."""
    from vtoken.methods.fourier import dct_lowpass

    model, processor = qwen3
    inputs = processor(
        images=[make_image(448, 448, 0), make_image(448, 320, 1)],
        text=[build_prompt(processor, "compare.", 2)],
        return_tensors="pt",
    )
    grids = [(14, 14), (10, 14)]
    seen = {}
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(kw["mm_encoder_outputs"]["image"].__dict__), with_kwargs=True
    )
    try:
        with torch.no_grad(), vtoken.patched(model, method, budget=0.25):
            model(**inputs)
    finally:
        hook.remove()
    with torch.no_grad():
        full = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    for index, (h, w) in enumerate(grids):
        for got, whole in zip(
            [seen["pooler_output"][index]] + [level[index] for level in seen["deepstack_features"]],
            [full.pooler_output[index]] + [level[index] for level in full.deepstack_features],
            strict=True,
        ):
            grid = whole.view(h, w, -1)
            if method == "pool":
                expected = F.avg_pool2d(grid.permute(2, 0, 1), 2).flatten(1).T
            else:
                out_h, out_w = got.shape[0] // (w // 2), w // 2  # sqrt(0.25) of each side
                expected = dct_lowpass(grid, out_h, out_w).flatten(0, 1)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(seen["deepstack_features"]) == 2


def test_fastv_with_beams(qwen3):
    """Beams and num_return_sequences under FastV: keep=1.0 gives the stock beams; at 30 % every sequence runs."""
    model, processor = qwen3
    inputs = _image(processor, (320, 320))
    beams = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**inputs, **beams)
        with vtoken.patched(model, vtoken.FastV(layer=0, keep=1.0)):
            same = model.generate(**inputs, **beams)
        with vtoken.patched(model, vtoken.FastV(layer=0, keep=0.3)) as handle:
            out = model.generate(**inputs, **beams)
    assert torch.equal(same, ref) and out.shape == ref.shape
    assert {r.tokens_out for r in handle.records} == {vtoken.tokens_to_keep(0.3, handle.records[0].tokens_in)}
