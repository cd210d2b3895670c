"""InternVL: tiles + thumbnail grouped by placeholder runs, pixel-shuffled tokens, video frames, [CLS] signals."""

import pytest
import torch
from conftest import assert_identity, make_image, shortened_prompt, video_inputs

import vtoken
from vtoken.zoo import build_prompt, tiny_internvl

# (width, height) -> tiles the processor cuts (max 6), a thumbnail added when there is more than one
SIZES = {(800, 300): 4, (300, 900): 4, (224, 224): 1, (1000, 700): 7, (50, 20): 3}


@pytest.fixture(scope="module")
def ivl():
    return tiny_internvl()


def _image(processor, size, seed=0, question="what?"):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, question)], return_tensors="pt")


def _two_images(processor):
    images = [make_image(800, 300), make_image(224, 224, 1)]
    return processor(images=images, text=[build_prompt(processor, "compare.", 2)], return_tensors="pt")


def stock_tokens(model, pixel_values):
    """[tiles, 256, D]: what the stock model scatters into the placeholders, tile by tile."""
    with torch.no_grad():
        return model.model.get_image_features(pixel_values).pooler_output


def reference_logits(model, input_ids, kept_embeddings):
    """The bare LLM fed by hand: each placeholder run shortened to exactly its kept embeddings, contiguous
    positions."""
    _, embeds = shortened_prompt(model, input_ids, model.config.image_token_id, kept_embeddings)
    with torch.no_grad():
        return model.lm_head(model.model.language_model(inputs_embeds=embeds).last_hidden_state)


def kept_per_run(stock, records, runs):
    """Per placeholder run, the stock tokens of the kept indices. runs: per placeholder run, (modality, item, crops)
    of the records it holds, crops in the processor's order (an image's tiles, then the thumbnail; a video's
    frames are one run each); `stock` rows follow the runs' tiles in order."""
    by_key = {(r.modality, r.image, r.crop): r.kept for r in records}
    out, first = [], 0
    for modality, item, crops in runs:
        out.append(torch.cat([stock[first + i, by_key[(modality, item, c)]] for i, c in enumerate(crops)]))
        first += len(crops)
    return out


def test_identity_for_multi_image_prompts_and_video(ivl):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = ivl
    assert_identity(model, method, _two_images(processor), max_new_tokens=3)
    assert_identity(model, method, video_inputs(processor, 3, "what?"), max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 50])
def test_exact_budget_per_tile_and_equivalence_with_the_stock_tokens(ivl, budget):
    model, processor = ivl
    for i, (size, tiles) in enumerate(SIZES.items()):
        inputs = _image(processor, size, i)
        assert inputs["pixel_values"].shape[0] == tiles
        with torch.no_grad(), vtoken.patched(model, "random", budget=budget) as handle:
            logits = model(**inputs).logits
        assert sorted(r.crop for r in handle.records) == list(range(tiles))
        for r in handle.records:
            assert (r.tokens_in, r.tokens_out, len(r.kept)) == (256, vtoken.tokens_to_keep(budget, 256), r.tokens_out)
            assert r.grid == (16, 16)
        stock = stock_tokens(model, inputs["pixel_values"])
        kept = kept_per_run(stock, handle.records, [("image", 0, range(tiles))])
        ref = reference_logits(model, inputs["input_ids"], kept)
        assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, size


@pytest.mark.parametrize("frames", [1, 4, 8])
def test_video_frames_are_one_crop_each_with_their_budget(ivl, frames):
    model, processor = ivl
    inputs = video_inputs(processor, frames, "what?")
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.25) as handle:
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    # one video, its frames its crops ("FrameN:" runs)
    assert [(r.modality, r.image, r.crop, r.tokens_in, r.tokens_out) for r in handle.records] == [
        ("video", 0, f, 256, 64) for f in range(frames)
    ]
    stock = stock_tokens(model, inputs["pixel_values"])
    runs = [("video", 0, [f]) for f in range(frames)]
    ref = reference_logits(model, inputs["input_ids"], kept_per_run(stock, handle.records, runs))
    assert (logits - ref).abs().max() <= 1e-5 and out.shape[1] == inputs["input_ids"].shape[1] + 2


def test_images_and_video_in_one_prompt(ivl):
    from vtoken.images import example_clip

    model, processor = ivl
    prompt = build_prompt(processor, "compare.", num_images=1, num_videos=1)
    inputs = processor(images=[make_image(800, 300)], videos=[example_clip(2)], text=[prompt], return_tensors="pt")
    with torch.no_grad(), vtoken.patched(model, "random", budget=0.1) as handle:
        logits = model(**inputs).logits
    assert [(r.modality, r.image, r.crop) for r in handle.records] == [
        ("image", 0, 0), ("image", 0, 1), ("image", 0, 2), ("image", 0, 3), ("video", 0, 0), ("video", 0, 1)
    ]  # fmt: skip
    stock = stock_tokens(model, inputs["pixel_values"])
    runs = [("image", 0, range(4)), ("video", 0, [0]), ("video", 0, [1])]
    ref = reference_logits(model, inputs["input_ids"], kept_per_run(stock, handle.records, runs))
    assert (logits - ref).abs().max() <= 1e-5


def eager_cls_scores(model, pixel_values, layer):
    """Independent [CLS] scores per token: an eager copy of the tower run with output_attentions, the head-mean
    [CLS] row over the patches of the layer whose output is hidden_states[layer], then the model's own pixel
    shuffle applied to that map and averaged over each group."""
    from transformers import InternVLVisionModel

    tower = model.model.vision_tower
    config = tower.config.__class__.from_dict(tower.config.to_dict())
    config._attn_implementation = "eager"
    eager = InternVLVisionModel(config).eval()
    eager.load_state_dict(tower.state_dict())
    with torch.no_grad():
        attentions = eager(pixel_values, output_attentions=True).attentions
        index = layer % (len(attentions) + 1) - 1
        patches = attentions[index][:, :, 0, 1:].mean(1)  # [T, 1024]
        maps = patches.view(len(patches), 32, 32, 1)
        return model.model.pixel_shuffle(maps, 0.5).mean(-1).flatten(1)  # [T, 256]


@pytest.fixture(scope="module")
def qk_norm_ivl():
    model, processor = tiny_internvl(qk_norm=True)
    with torch.no_grad():  # non-trivial norm weights, so reading q/k before the norm would give other scores
        for layer in model.model.vision_tower.encoder.layer:
            for norm in (layer.attention.q_norm, layer.attention.k_norm):
                norm.weight.uniform_(0.2, 3.0)
    return model, processor


@pytest.mark.parametrize("layer", [-1, -2])
def test_cls_score_equals_eager_attention_after_qk_norm(qk_norm_ivl, layer):
    model, processor = qk_norm_ivl
    model.config.vision_feature_layer = layer
    try:
        inputs = _image(processor, (800, 300))
        with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=20) as handle:
            model(**inputs)
            _, signals = handle.adapter.vision_tokens(inputs["pixel_values"])
            scores = signals["cls_attention"]()
    finally:
        model.config.vision_feature_layer = -1
    reference = eager_cls_scores(model, inputs["pixel_values"], layer)
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=1e-7)
    assert [r.crop for r in handle.records] == [0, 1, 2, 3]  # processor order: tiles, then the thumbnail
    for record in handle.records:
        assert torch.equal(record.kept, reference[record.crop].topk(20).indices.sort().values)


def test_cls_scores_keep_sdpa_on(ivl, monkeypatch):
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, processor = ivl
    calls, original = [], sdpa_attention.sdpa_attention_forward

    def spy(module, *args, **kwargs):
        calls.append((type(module).__name__, kwargs.get("output_attentions")))
        return original(module, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    with torch.no_grad(), vtoken.patched(model, "hired", rate=0.25):
        model.generate(**_image(processor, (800, 300)), max_new_tokens=2, do_sample=False)
    assert ("InternVLVisionAttention", None) in calls and any(name == "Qwen2Attention" for name, _ in calls)


def test_hired_thumbnail_is_the_base_view(ivl):
    model, processor = ivl
    inputs = _image(processor, (1000, 700))  # 6 tiles + thumbnail
    with torch.no_grad(), vtoken.patched(model, "hired", rate=0.25) as handle:
        model(**inputs)
        _, signals = handle.adapter.vision_tokens(inputs["pixel_values"], None, None)
        early, final = signals["cls_attention@0"](), signals["cls_attention"]()
    method = vtoken.HiRED(rate=0.25)
    budgets = method.crop_budgets(early[-1], 1, 6, 16, 16)  # base view (the thumbnail) first, then the 6 tiles
    records = handle.records  # the processor's order: 6 tiles, then the thumbnail
    assert [r.tokens_out for r in records] == budgets[1:] + budgets[:1]
    assert budgets[0] == int(int(7 * 256 * 0.25) * 0.5)
    for record in records:
        assert torch.equal(record.kept, final[record.crop].topk(record.tokens_out).indices.sort().values)
    video = video_inputs(processor, 2, "what?")
    with torch.no_grad(), vtoken.patched(model, "hired", rate=0.25) as handle:
        model(**video)
    assert [r.tokens_out for r in handle.records] == [64, 64]  # single-crop variant per frame
    with pytest.raises(vtoken.VTokenError, match="partition='bands'"):
        vtoken.patch(model, vtoken.HiRED(partition="tiles"))
    assert vtoken.handle_of(model) is None


# LLMs FastV is checked on: InternVL 3's Qwen2 and InternVL 3.5's Qwen3, whose QK-norm the LLM probe reads after
FASTV_LLMS = ["qwen2", "qwen3"]


@pytest.mark.parametrize("text_model", FASTV_LLMS)
def test_fastv_matches_the_layer_by_layer_reference(text_model):
    """FastV on InternVL's LLM (1-D RoPE): per-step logits of 4 greedy tokens and the kept tokens equal an eager
    layer-by-layer reference (the one tests/test_llm_stages.py runs on LLaVA)."""
    import copy

    from conftest import captured_llm_input
    from test_llm_stages import fastv_rule, patched_generate, reference_generate

    model, processor = tiny_internvl(text_layers=4, text_model=text_model)
    with torch.no_grad():  # non-trivial QK-norm weights where the LLM has them
        for layer in model.model.language_model.layers:
            for name in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name).weight.uniform_(0.2, 3.0)
    inputs = _image(processor, (800, 300), question="what is in the image? answer with one word.")
    for method, renumber in ((vtoken.FastV(layer=1, keep=0.25), False),
                             (vtoken.FastV(layer=2, keep=100, positions="renumber"), True)):  # fmt: skip
        logits, records, _ = patched_generate(model, inputs, method, steps=4)
        embeds = captured_llm_input(model, inputs)
        ids = inputs["input_ids"][0]
        visual = set((ids == model.config.image_token_id).nonzero().squeeze(1).tolist())
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        ref_logits, kept_after, _ = reference_generate(
            eager.model.language_model, eager.lm_head, embeds, visual,
            fastv_rule(vtoken.tokens_to_keep(method.keep, len(visual))), method.drop_layers(4), renumber, [], steps=4,
        )  # fmt: skip
        (record,) = records
        assert (record.kept + min(visual)).tolist() == kept_after[0]
        assert (logits - ref_logits).abs().max() <= 1e-4


def test_fastv_on_a_qwen3_llm_runs(ivl):
    """FastV on InternVL3.5's Qwen3 LLM (QK-norm) runs and keeps its count; its scores read q/k as the LLM
    probe hooks them (see the QK-norm probe fix in adapters/llm/probe.py)."""
    model, processor = tiny_internvl(text_model="qwen3")
    inputs = _image(processor, (800, 300))
    assert_identity(model, vtoken.FastV(layer=0, keep=1.0), inputs, max_new_tokens=2)
    with torch.no_grad(), vtoken.patched(model, vtoken.FastV(layer=0, keep=0.25)) as handle:
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert [r.tokens_out for r in handle.records] == [vtoken.tokens_to_keep(0.25, 1024)]
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


def test_refusals_are_clear(ivl):
    model, processor = ivl
    with pytest.raises(vtoken.MissingSignalError, match="tower_merge"):
        vtoken.patch(model, "mustdrop")
    inputs = _image(processor, (800, 300))
    bad = dict(inputs, pixel_values=inputs["pixel_values"][:3])  # a tile missing
    with vtoken.patched(model, "random", budget=0.5), pytest.raises(vtoken.InputError, match="placeholder runs"):
        model(**bad)


def test_checkpoint_round_trip_keeps_tiles_video_and_cls_scores(ivl, tmp_path, monkeypatch):
    from vtoken.images import example_clip
    from vtoken.zoo import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = ivl
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load(str(tmp_path))
    assert type(loaded) is type(model)
    prompt = build_prompt(loaded_processor, "compare.", num_images=1, num_videos=1)
    inputs = loaded_processor(images=[make_image(800, 300)], videos=[example_clip(2)], text=[prompt],
                              return_tensors="pt")  # fmt: skip
    expected_inputs = processor(images=[make_image(800, 300)], videos=[example_clip(2)], text=[prompt],
                                return_tensors="pt")  # fmt: skip
    assert torch.equal(inputs["input_ids"], expected_inputs["input_ids"])
    with torch.no_grad():
        with vtoken.patched(model, "fastervlm", budget=0.25):
            expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        with vtoken.patched(loaded, "fastervlm", budget=0.25) as handle:
            got = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected) and [r.tokens_out for r in handle.records] == [64] * 6
