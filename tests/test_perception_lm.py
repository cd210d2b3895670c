"""PerceptionLM: timm PE tower (Eva, [CLS], 2-D RoPE) in a TimmWrapperModel, MLP projector + 2 x 2 pooling, tiles
(thumbnail + tiles per image, one tile per video frame), Llama LLM."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_identity, feed_language_model, make_image, video_inputs

import vtoken
from vtoken.methods.fourier import dct_lowpass
from vtoken.methods.pool import pool_weights
from vtoken.zoo import build_prompt, tiny_perception_lm

SIZES = [(800, 300), (300, 300), (50, 20)]  # 3, 5 and 4 tiles of 128 px; 4 x 4 pooled tokens each


@pytest.fixture(scope="module")
def plm():
    return tiny_perception_lm()


def _image(processor, size=(800, 300), seed=0, question="what is in the image?"):
    return processor(images=[make_image(*size, seed)], text=[build_prompt(processor, question)], return_tensors="pt")


def _cases(processor):
    cases = [_image(processor, size, i) for i, size in enumerate(SIZES)]
    cases.append(  # two images in one prompt (the processor stacks images with equal tile counts)
        processor(
            images=[make_image(800, 300), make_image(790, 310, 1)],
            text=[build_prompt(processor, "compare.", 2)],
            return_tensors="pt",
        )
    )
    cases.append(video_inputs(processor, 4, "what?"))
    return cases


def _stock_tiles(model, inputs):
    """The model's own pooled, projected tokens of every tile (frame): [tiles, 16, D], and the placeholder id."""
    key = "pixel_values" if "pixel_values" in inputs else "pixel_values_videos"
    token = model.config.image_token_id if key == "pixel_values" else model.config.video_token_id
    with torch.no_grad():
        return model.model.get_image_features(inputs[key]).pooler_output, token


def feed_runs(model, input_ids, token_id, runs):
    """Reference logits: the bare LLM on `input_ids[0]` with its i-th run of `token_id` placeholders replaced by
    exactly the embeddings `runs[i]` [n_i, D] (several images or videos in one prompt), contiguous positions."""
    ids, parts, start, run = input_ids[0].tolist(), [], 0, 0
    while start < len(ids):
        if ids[start] != token_id:
            parts.append(ids[start])
            start += 1
            continue
        while start < len(ids) and ids[start] == token_id:
            start += 1
        parts += [token_id] * len(runs[run])
        run += 1
    new_ids = torch.tensor(parts)[None]
    visual = torch.cat(runs)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(new_ids)
        embeds[new_ids == token_id] = visual
        return model.lm_head(model.model.language_model(inputs_embeds=embeds).last_hidden_state)


def eager_pooled_cls_scores(model, tiles):
    """Independent FasterVLM scores: the last block of an unfused copy of the tower gives its full attention map
    (timm hands the post-softmax map to attn_drop); [CLS] row, head mean, patch keys, 2 x 2 average pooling."""
    tower = copy.deepcopy(model.model.vision_tower.timm_model)
    attention = tower.blocks[-1].attn
    attention.fused_attn = False
    maps = []
    attention.attn_drop.register_forward_hook(lambda m, a, out: maps.append(out))
    with torch.no_grad():
        tower.forward_features(tiles)
    row = maps[0][:, :, 0, 1:].mean(1)  # [T, 64]
    return F.adaptive_avg_pool2d(row.view(-1, 1, 8, 8), (4, 4)).flatten(1)


def test_identity_for_tiles_multi_image_and_video(plm):
    method = "random"  # the family's own inputs with one method; every method: tests/test_contract.py's identity row
    model, processor = plm
    for inputs in _cases(processor):
        assert_identity(model, method, inputs, max_new_tokens=3)


@pytest.mark.parametrize("budget", [0.5, 0.1, 3])
def test_exact_budget_per_tile_and_equivalence_with_the_llm_fed_by_hand(plm, budget):
    model, processor = plm
    k = vtoken.tokens_to_keep(budget, 16)
    for inputs in _cases(processor):
        stock, token = _stock_tiles(model, inputs)
        tiles = stock.shape[0]
        for method in ("random", "fastervlm", "mmtok", "pool"):
            with torch.no_grad(), vtoken.patched(model, method, budget=budget) as handle:
                logits = model(**inputs).logits
            records = handle.records
            assert [(r.crop, r.tokens_in, r.tokens_out, r.grid) for r in records] == [
                (t % (tiles // len({r.image for r in records})), 16, k, (4, 4)) for t in range(tiles)
            ]
            if method == "pool":
                kept = [pool_weights(4, 4, k) @ stock[t] for t in range(tiles)]
            else:
                kept = [stock[t, r.kept] for t, r in enumerate(records)]
            items = len({r.image for r in records})
            runs = [torch.cat(kept[i * tiles // items : (i + 1) * tiles // items]) for i in range(items)]
            ref = feed_runs(model, inputs["input_ids"], token, runs)
            assert logits.shape == ref.shape and (logits - ref).abs().max() <= 1e-5, method


def test_fastervlm_keeps_the_top_pooled_cls_attention_of_every_tile(plm):
    model, processor = plm
    for inputs in (_image(processor, (300, 300)), video_inputs(processor, 3, "what?")):
        key = "pixel_values" if "pixel_values" in inputs else "pixel_values_videos"
        scores = eager_pooled_cls_scores(model, inputs[key].flatten(0, 1))
        with torch.no_grad(), vtoken.patched(model, "fastervlm", budget=5) as handle:
            model(**inputs)
        expected = scores.topk(5, dim=1).indices.sort(1).values
        assert torch.equal(torch.stack([r.kept for r in handle.records]), expected)


def test_fourier_low_passes_every_tile(plm):
    model, processor = plm
    inputs = _image(processor)
    with torch.no_grad(), vtoken.patched(model, vtoken.FourierDCT(reserve=2)) as handle:
        logits = model(**inputs).logits
    assert [(r.tokens_in, r.tokens_out) for r in handle.records] == [(16, 4)] * 3
    stock, token = _stock_tiles(model, inputs)
    visual = dct_lowpass(stock.view(3, 4, 4, -1), 2, 2).flatten(0, 2)
    ref = feed_language_model(model, inputs["input_ids"], token, visual)
    assert (logits - ref).abs().max() <= 1e-5


def test_bad_shapes_and_a_tower_without_cls(plm):
    model, processor = plm
    inputs = _image(processor)
    with vtoken.patched(model, "random", budget=0.5):
        with pytest.raises(vtoken.InputError, match=r"pixel_values of shape \(1, 3, 3, 128, 100\)"):
            model(**dict(inputs, pixel_values=inputs["pixel_values"][..., :100]))
        with pytest.raises(vtoken.InputError, match=r"\[num_images, tiles, 3, H, W\]"):
            model(**dict(inputs, pixel_values=inputs["pixel_values"][0]))
    no_cls = tiny_perception_lm()[0]
    no_cls.config.vision_use_cls_token = False
    with pytest.raises(vtoken.MissingSignalError, match="cls_attention"):
        vtoken.patch(no_cls, "fastervlm")
